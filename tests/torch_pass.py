"""Which tests depend on torch, so CI's second pass (the newest torch release) runs them and only them.

`.ci/run` runs every test on CI's pinned torch, then `pytest -m torch` on the newest release. The
`torch` marker is applied here, by reading the tests' code, so a test added without a marker still
lands in the newest pass when it:
- imports torch or a package built on it (transformers, PEFT, TRL, torchao, bitsandbytes,
  lm-eval), directly or through an fsdpkit module or a test helper that does when imported;
- starts the training program: a command line (a call's arguments, a list, a parameter) whose verb
  runs it (`fsdpkit train|export|eval|data|tokenizer|selftest`, `run_cli("train", ...)`), `torchrun`,
  `python -m fsdpkit.train` or `-m benchmarks.NAME`, a text naming such a command
  ("fsdpkit train ...", "make run"), a script under tests/ that imports torch, or `job submit` of
  a spec on the local backend (its ranks train on this machine).
A command the product renders and the test then runs (a Slurm batch script, a pod's command), a
document's line, or a fixture asked for by name at run time (`request.getfixturevalue`) is out of
this reading's sight: such a test, or its parameter, says `pytest.mark.torch` itself.
An import at a module's top level marks all its tests; one inside a function, like a command, marks
the tests that reach that function: the test itself, its fixtures, its parameters, and the functions
and constants of the test's module and helpers that those name (followed transitively). The reading
errs towards torch: a test marked that needs no torch costs the newest pass some seconds; one
missed would leave a torch release untested.
"""

from __future__ import annotations

import ast
import functools
import inspect
import itertools
import textwrap
from collections.abc import Iterable
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent
SRC = TESTS.parent / "src"

# Packages whose import loads torch.
TORCH_PACKAGES = frozenset({"torch", "torchao", "torchvision", "transformers", "peft", "trl", "bitsandbytes",
                            "lm_eval", "accelerate", "safetensors.torch"})
# fsdpkit's verbs whose command imports the training program (tests/test_torch_pass.py holds this to
# the CLI's own table), and the programs that are torch.
TORCH_VERBS = frozenset({"train", "export", "eval", "data", "tokenizer", "selftest"})
TORCH_PROGRAMS = frozenset({"torchrun", "fsdpkit-torchrun"})
TORCH_MODULES = ("fsdpkit.train", "torch.", "benchmarks.")   # as `python -m NAME`
# Imports by name at run time: conftest's require(), importlib's, pytest's.
DYNAMIC_IMPORTS = frozenset({"require", "import_module", "importorskip"})
# Texts that name a training command (a document's line, a shell script's).
TORCH_PHRASES = (*(f"fsdpkit {v} " for v in sorted(TORCH_VERBS)), "make run", "-m fsdpkit.train", "backend: local")


def _is_torch_package(name: str) -> bool:
    return any(name == p or name.startswith(p + ".") for p in TORCH_PACKAGES)


def _load_time_nodes(tree: ast.AST):
    """The nodes a module runs when imported: everything but function bodies and TYPE_CHECKING blocks."""
    stack = [tree]
    while stack:
        node = stack.pop()
        yield node
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                stack.extend(child.decorator_list if not isinstance(child, ast.Lambda) else [])
                continue
            if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                stack.extend(child.orelse)
                continue
            stack.append(child)


def _imported(node: ast.AST, package: str) -> list[str]:
    """The dotted names an import statement loads (for `from X import Y`: X, and X.Y should Y be a module)."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    if isinstance(node, ast.ImportFrom):
        base = node.module or ""
        if node.level:
            parts = package.split(".")[: len(package.split(".")) - node.level + 1]
            base = ".".join([*parts, base] if base else parts)
        return [base, *(f"{base}.{a.name}" for a in node.names)]
    return []


@functools.cache
def _parsed(path: Path) -> ast.Module:
    return ast.parse(path.read_text(), filename=str(path))


def _fsdpkit_path(name: str) -> Path | None:
    base = SRC.joinpath(*name.split("."))
    for path in (base.with_suffix(".py"), base / "__init__.py"):
        if path.is_file():
            return path
    return None


def _helper_path(name: str) -> Path | None:
    """A test helper module (tests/NAME.py, imported by its bare name)."""
    path = TESTS / f"{name}.py"
    return path if "." not in name and path.is_file() else None


@functools.cache
def module_loads_torch(name: str) -> bool:
    """Whether importing `name` (an fsdpkit module, a test helper, or a third-party package) loads torch:
    a walk over what each module imports when loaded, and its parent packages."""
    seen, todo = {name}, [name]
    while todo:
        current = todo.pop()
        if _is_torch_package(current):
            return True
        for n in _loads(current):
            if n not in seen:
                seen.add(n)
                todo.append(n)
    return False


@functools.cache
def _loads(name: str) -> tuple[str, ...]:
    """The modules that importing `name` imports first-hand (its parent packages among them)."""
    if name.startswith("fsdpkit"):
        path = _fsdpkit_path(name)
        parents = [".".join(name.split(".")[:i]) for i in range(1, name.count(".") + 1)]
        package = name if path is not None and path.name == "__init__.py" else name.rpartition(".")[0]
    elif (path := _helper_path(name)) is not None:
        parents, package = [], ""
    else:
        return ()
    if path is None:
        return tuple(parents)
    return (*parents, *(n for node in _load_time_nodes(_parsed(path)) for n in _imported(node, package)))


@functools.cache
def file_loads_torch(path: Path) -> bool:
    """Whether importing the file (a test module or script) loads torch."""
    return any(module_loads_torch(n) for node in _load_time_nodes(_parsed(path)) for n in _imported(node, ""))


def names_training(value: object) -> bool:
    """A text naming a training command, or a script under tests/ that imports torch."""
    if not isinstance(value, str):
        return False
    if any(p in value + " " for p in TORCH_PHRASES):
        return True
    name = Path(value).name
    return name.endswith(".py") and not set(name) & set("*?[") and any(file_loads_torch(p) for p in _scripts(name))


@functools.cache
def _scripts(name: str) -> tuple[Path, ...]:
    return tuple(TESTS.rglob(name))


# What a piece of a test can show: it needs torch outright, or it holds a job spec on the local
# backend, or it submits a job; the last two together train here (`job submit` of a local spec).
TORCH, LOCAL_SPEC, SUBMITS = "torch", "local spec", "submits"


def _argv_facts(argv: list[object], cli_call: bool = False, program: bool = False) -> set[str]:
    """What a command line (strings, with None for what is not a constant) does: it starts the
    training program (`fsdpkit VERB`, `-m fsdpkit.train`, `-m benchmarks.X`, `--backend local`;
    torchrun where the list is a program's argv, `program`; for a call to the test's CLI helpers,
    run_cli, cli_here or cli, the first argument is the verb), or it submits a job."""
    strings = [a if isinstance(a, str) else None for a in argv]
    facts = set()
    if cli_call and strings and strings[0] in TORCH_VERBS:
        facts.add(TORCH)
    if cli_call and strings[:2] == ["job", "submit"]:
        facts.add(SUBMITS)
    if program and strings and strings[0] in TORCH_PROGRAMS:
        facts.add(TORCH)
    for before, after in itertools.pairwise(strings):
        if before in ("fsdpkit", "fsdpkit.cli.main") and after in TORCH_VERBS:
            facts.add(TORCH)
        if before == "-m" and after is not None and after.startswith(TORCH_MODULES):
            facts.add(TORCH)
        if before == "--backend" and after == "local":
            facts.add(TORCH)
        if before == "job" and after == "submit":
            facts.add(SUBMITS)
    return facts


def _node_facts(node: ast.AST, parents: dict[ast.AST, ast.AST]) -> set[str]:
    """What an AST node shows: an import that loads torch, a text naming a training command, a
    call's or a list's command line, a job spec on the local backend."""
    if _imports_torch(node):
        return {TORCH}
    if isinstance(node, ast.Constant):
        return {TORCH} if names_training(node.value) else set()
    if isinstance(node, ast.Call):
        name = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
        first = _constant(node.args[0]) if node.args else None
        if name in DYNAMIC_IMPORTS and isinstance(first, str) and module_loads_torch(first):
            return {TORCH}
        return _argv_facts([_constant(a) for a in node.args], cli_call="cli" in name.lower())
    if isinstance(node, (ast.List, ast.Tuple)):
        return _argv_facts([_constant(e) for e in node.elts],
                           program=isinstance(parents.get(node), (ast.Call, ast.keyword)))
    if isinstance(node, ast.Dict) and any(_constant(k) == "backend" and _constant(v) == "local"
                                          for k, v in zip(node.keys, node.values, strict=True)):
        return {LOCAL_SPEC}
    return set()


def _constant(node: ast.AST | None) -> object:
    return node.value if isinstance(node, ast.Constant) else None


def _parents(tree: ast.AST) -> dict[ast.AST, ast.AST]:
    return {child: parent for parent in ast.walk(tree) for child in ast.iter_child_nodes(parent)}


def _imports_torch(node: ast.AST) -> bool:
    return any(module_loads_torch(i) for i in _imported(node, ""))


def _trains(facts: set[str]) -> bool:
    return TORCH in facts or {LOCAL_SPEC, SUBMITS} <= facts


class _Module:
    """A test module or helper: its top-level functions and constants, and the helpers it imports."""

    def __init__(self, path: Path):
        tree = _parsed(path)
        self.defs: dict[str, ast.AST] = {}
        self.helpers: dict[str, str] = {}   # local name -> helper module name
        self.from_helpers: dict[str, tuple[str, str]] = {}  # local name -> (helper, its name)
        for node in tree.body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                self.defs[node.name] = node
            elif isinstance(node, (ast.Assign, ast.AnnAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                for t in targets:
                    for n in ast.walk(t):
                        if isinstance(n, ast.Name):
                            self.defs[n.id] = node
            elif isinstance(node, ast.Import):
                for a in node.names:
                    if _helper_path(a.name):
                        self.helpers[a.asname or a.name] = a.name
            elif isinstance(node, ast.ImportFrom) and not node.level and node.module and _helper_path(node.module):
                for a in node.names:
                    self.from_helpers[a.asname or a.name] = (node.module, a.name)


@functools.cache
def _module(path: Path) -> _Module:
    return _Module(path)


def _body(node: ast.AST) -> Iterable[ast.AST]:
    """A definition's nodes, less a function's decorators (a parametrization is read per case, from
    the item's parameters)."""
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        for part in (*node.args.defaults, *node.args.kw_defaults, *node.body):
            if part is not None:
                yield from ast.walk(part)
        return
    yield from ast.walk(node)


Definition = tuple[Path, str]   # a module's file and a top-level name in it


@functools.cache
def _definition(definition: Definition) -> tuple[frozenset[str], tuple[Definition, ...]]:
    """What a top-level definition shows by itself, and the definitions it names (read once)."""
    path, name = definition
    module = _module(path)
    if name in module.from_helpers:
        helper, original = module.from_helpers[name]
        return frozenset(), ((TESTS / f"{helper}.py", original),)
    node = module.defs.get(name)
    return (frozenset(), ()) if node is None else _scan(path, list(_body(node)), _parents(node))


def _scan(path: Path, nodes: list[ast.AST],
          parents: dict[ast.AST, ast.AST]) -> tuple[frozenset[str], tuple[Definition, ...]]:
    module = _module(path)
    facts: set[str] = set()
    named: dict[Definition, None] = {}
    for n in nodes:
        facts |= _node_facts(n, parents)
        if isinstance(n, ast.Name):
            named[(path, n.id)] = None
        elif isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and n.value.id in module.helpers:
            named[(TESTS / f"{module.helpers[n.value.id]}.py", n.attr)] = None
    return frozenset(facts), tuple(named)


@functools.cache
def _reached_facts(start: tuple[Definition, ...]) -> frozenset[str]:
    """What the definitions `start` show, with all they name, transitively."""
    facts: set[str] = set()
    seen, todo = set(start), list(start)
    while todo and TORCH not in facts:
        direct, named = _definition(todo.pop())
        facts |= direct
        for d in named:
            if d not in seen:
                seen.add(d)
                todo.append(d)
    return frozenset(facts)


def _function_facts(func: object) -> frozenset[str]:
    """What a test or fixture function defined under tests/ shows (nothing for one defined elsewhere)."""
    func = inspect.unwrap(func)  # type: ignore[arg-type]
    try:
        path = Path(inspect.getsourcefile(func) or "").resolve()  # type: ignore[arg-type]
    except TypeError:
        return frozenset()
    if TESTS not in path.parents:
        return frozenset()
    if file_loads_torch(path):
        return frozenset({TORCH})
    name = getattr(func, "__name__", "")
    if getattr(func, "__qualname__", name) == name and name in _module(path).defs:
        return _reached_facts(((path, name),))
    # A method (a test class's) or a nested function: its own source.
    try:
        definition = ast.parse(textwrap.dedent(inspect.getsource(func))).body[0]  # type: ignore[arg-type]
    except (OSError, TypeError, SyntaxError):
        return frozenset({TORCH})
    direct, named = _scan(path, list(_body(definition)), _parents(definition))
    return direct | _reached_facts(named)


def _param_facts(value: object) -> set[str]:
    if isinstance(value, (list, tuple)):
        facts = _argv_facts(list(value), cli_call=True)
        return facts | ({TORCH} if any(names_training(v) for v in value) else set())
    return {TORCH} if names_training(value) or (isinstance(value, str) and value in TORCH_VERBS) else set()


def needs_torch(item: pytest.Item) -> bool:
    """Whether a collected test depends on torch (see the module's docstring)."""
    if item.get_closest_marker("torch") is not None or file_loads_torch(Path(str(item.path)).resolve()):
        return True
    facts: set[str] = set()
    if (func := getattr(item, "function", None)) is not None:
        facts |= _function_facts(func)
    info = getattr(item, "_fixtureinfo", None)
    for defs in (info.name2fixturedefs.values() if info is not None else ()):
        for d in defs:
            facts |= _function_facts(d.func)
    if (callspec := getattr(item, "callspec", None)) is not None:
        for value in callspec.params.values():
            facts |= _param_facts(value)
    return _trains(facts)


def mark(items: list[pytest.Item]) -> None:
    """Apply the `torch` marker to every test that depends on torch."""
    for item in items:
        if needs_torch(item):
            item.add_marker(pytest.mark.torch)
