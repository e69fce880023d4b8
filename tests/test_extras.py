"""fsdpkit.extras: a command that reaches a module of an extra not installed is one line naming the
extra. The table is held to the installed packages' own metadata, and the verbs are run as in the
install `make run` makes (the core dependencies only): every module outside their closure hidden."""

from __future__ import annotations

import ast
import importlib.metadata as md
import json
import os
import re
import subprocess
import sys

import pytest
from packaging.requirements import Requirement

from fsdpkit.extras import EXTRA_OF

from conftest import ROOT
from job_specs import TOKEN, write_spec


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def closure(requirements: list[Requirement]) -> set[str]:
    """The installed distributions these requirements bring, with everything they require."""
    seen: set[str] = set()
    todo = list(requirements)
    while todo:
        req = todo.pop()
        name = _norm(req.name)
        if name in seen:
            continue
        try:
            dist = md.distribution(name)
        except md.PackageNotFoundError:
            continue
        seen.add(name)
        for text in dist.requires or []:
            sub = Requirement(text)
            if sub.marker is None or sub.marker.evaluate({"extra": ""}) or \
                    any(sub.marker.evaluate({"extra": x}) for x in req.extras):
                todo.append(sub)
    return seen


OURS = [Requirement(r) for r in md.distribution("fsdpkit").requires or []]
CORE = closure([r for r in OURS if r.marker is None])


def modules_of(dists: set[str]) -> set[str]:
    return {m for m, owners in md.packages_distributions().items() if any(_norm(d) in dists for d in owners)}


def extra_closure(extra: str) -> set[str]:
    return closure([Requirement(r.name) for r in OURS if r.marker is not None and r.marker.evaluate({"extra": extra})])


def imported_by_source() -> set[str]:
    names = set()
    for path in (ROOT / "src" / "fsdpkit").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names |= {a.name.split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                names.add(node.module.split(".")[0])
    return {n for n in names if n not in sys.stdlib_module_names and n != "fsdpkit"}


def test_every_module_the_source_imports_beyond_the_core_is_in_the_table_under_an_extra_that_brings_it():
    core = modules_of(CORE)
    assert {"torch", "yaml", "pydantic", "jinja2"} <= core
    beyond = imported_by_source() - core
    assert {"kubernetes", "boto3", "requests"} <= beyond
    assert beyond - set(EXTRA_OF) == set()
    for module, extra in EXTRA_OF.items():
        assert module not in core, module   # the core brings it: no extra to name
        assert module in modules_of(extra_closure(extra) - CORE), (module, extra)


# What a training-only install lacks: every installed module outside the core's closure (pytest's
# own too, which such an install would not have either). The commands run one after another in one
# such process, each as `fsdpkit ARGV` would (its exit code, its stdout and stderr).
HIDE = """
import contextlib, io, json, sys
HIDDEN = set(sys.argv[1].split(","))
class Hidden:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in HIDDEN:
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
sys.meta_path.insert(0, Hidden())
from fsdpkit.cli.main import main
results = []
for argv in json.loads(sys.argv[2]):
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(argv)
        except SystemExit as e:
            code = e.code
        except BaseException as e:
            code, _ = 1, print(f"Traceback: {type(e).__name__}: {e}", file=err)
    results.append([code, out.getvalue(), err.getvalue()])
print(json.dumps(results))
"""


def training_only(*commands: list[str], env: dict | None = None) -> list[tuple[int, str, str]]:
    hidden = modules_of({_norm(d.metadata["Name"]) for d in md.distributions()} - CORE - {"fsdpkit"}) \
        - modules_of(CORE)
    assert {"kubernetes", "boto3", "botocore", "prometheus_api_client"} <= hidden
    r = subprocess.run([sys.executable, "-c", HIDE, ",".join(sorted(hidden)), json.dumps(list(commands))],
                       capture_output=True, text=True, cwd=ROOT, timeout=300, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    return [tuple(x) for x in json.loads(r.stdout.splitlines()[-1])]


CLUSTER_VERBS = [
    ["job", "submit", "{spec}"], ["job", "submit", "{spec}", "--dry-run=server"], ["job", "status", "llama-tiny"],
    ["job", "logs", "llama-tiny"], ["job", "wait", "llama-tiny"], ["job", "watch", "llama-tiny", "--once"],
    ["job", "delete", "llama-tiny", "--yes"], ["job", "list", "--backend", "pytorchjob"], ["deploy", "{spec}"],
    ["cluster", "check"], ["cluster", "validate", "gpu"], ["ray", "status", "my-ray"], ["ray", "create", "{spec}"],
    ["ckpt", "list", "ckpts", "--pvc", "claim", "--image", "my/image:1"], ["storage", "fsx", "status", "ckpt"],
    ["infra", "status"], ["metrics", "llama-tiny", "--prometheus", "http://127.0.0.1:9"],
]


@pytest.fixture(scope="module")
def answers(tmp_path_factory):
    """Each cluster verb's (exit code, stdout, stderr) in the training-only install, from one process."""
    spec = str(write_spec(tmp_path_factory.mktemp("spec")))
    return dict(zip(map(tuple, CLUSTER_VERBS), training_only(
        *[[a.replace("{spec}", spec) for a in argv] for argv in CLUSTER_VERBS],
        env={**os.environ, "MY_HF_TOKEN": TOKEN}), strict=True))


@pytest.mark.parametrize("argv", CLUSTER_VERBS, ids=[" ".join(a[:3]) for a in CLUSTER_VERBS])
def test_in_a_training_only_install_each_cluster_verb_is_one_line_naming_the_cloud_extra(argv, answers):
    code, out, err = answers[tuple(argv)]
    # (deploy says which step it is at on stdout: its progress, not an object.)
    assert code == 2 and "Traceback" not in out + err, out + err[-2000:]
    [line] = err.splitlines()
    assert line.startswith("error: ") and "pip install 'fsdpkit[cloud]'" in line, line


def test_in_a_training_only_install_what_needs_no_cluster_still_works(tmp_path):
    spec = str(write_spec(tmp_path))
    (render, rbac, listing) = training_only(["job", "render", spec], ["cluster", "rbac", "-n", "team-a"],
                                            ["job", "list", "--json"])
    assert render[0] == 0 and "kind: PyTorchJob" in render[1], render[2][-2000:]
    assert rbac[0] == 0 and "kind: Role" in rbac[1]
    # `job list` lists the local jobs and says why the cluster's are not among them.
    assert listing[0] == 0 and json.loads(listing[1])["data"]["jobs"] == [], listing[2]
    assert "cluster jobs not listed" in listing[2] and "fsdpkit[cloud]" in listing[2]
