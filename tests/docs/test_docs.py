"""The docs cannot drift from the CLI: the reference is regenerated and compared; every
`fsdpkit ...` line in the README, the docs and the agent skills names a real command, subcommand
and flags (checked against the parsers the CLI builds, as `--help` would show them); and every such
line that needs no cloud is run as written, each document's lines in order in a folder of its own,
and must succeed."""

from __future__ import annotations

import argparse
import itertools
import os
import re
import shutil
from pathlib import Path

import pytest
from doc_commands import argv as shell_argv
from doc_commands import command_lines, short_sequences
from doc_commands import tokens as argv_of

from fsdpkit.cli.main import VERBS
from fsdpkit.cli.reference import render, subcommands, verb_parser

from conftest import ROOT, run_cli

SKILL_FILES = sorted((ROOT / "src" / "fsdpkit" / "skills" / "data").glob("*/SKILL.md"))
DOC_FILES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), *SKILL_FILES]
COMMANDS = [(str(path.relative_to(ROOT)), line) for path in DOC_FILES if path.name != "reference.md"
            for line in command_lines(path)]


def test_command_reference_is_generated_from_the_cli():
    assert (ROOT / "docs" / "reference.md").read_text() == render(), \
        "docs/reference.md is stale: python -m fsdpkit.cli.reference > docs/reference.md"


def _parsers():
    """Every parser of the CLI: each verb's and each of their subcommands'."""
    todo = [verb_parser(v) for v in VERBS]
    while todo:
        parser = todo.pop()
        yield parser
        todo += list({id(p): p for p in subcommands(parser).values()}.values())


def test_help_names_no_file_a_wheel_lacks_and_prints_as_argparse_does():
    """An installed fsdpkit has no docs/, examples/, benchmarks/ or tests/: help that points there
    sends a user nowhere. And the reference shows what --help shows (`5%`, not the source's `5%%`)."""
    texts = [t for p in _parsers() for t in (p.description, p.epilog, *(a.help for a in p._actions)) if t]
    assert len(texts) > 300
    stray = [t for t in texts if re.search(r"(?<![\w/.-])(docs|examples|benchmarks|tests)/", t)]
    assert not stray, stray
    assert "%%" not in render() and "within 2% of training compute" in render()


def test_the_docs_show_commands():
    assert len(COMMANDS) > 20


def _options(parser: argparse.ArgumentParser) -> set[str]:
    return {o for a in parser._actions for o in a.option_strings}


def _resolve(line: str) -> tuple[list[str], argparse.ArgumentParser]:
    """The command path (verb, subcommand, sub-subcommand...) a documented line names, and its parser."""
    tokens = argv_of(line)
    path, parser = [tokens[1]], verb_parser(tokens[1])
    words = iter(t for t in tokens[2:] if not t.startswith("-"))
    while subs := subcommands(parser):
        sub = next(words, None)
        assert sub in subs, f"`{line}`: `{parser.prog}` has no subcommand {sub!r}"
        path.append(sub)
        parser = subs[sub]
    return path, parser


@pytest.mark.parametrize("doc,line", COMMANDS, ids=[f"{d}:{c[:60]}" for d, c in COMMANDS])
def test_documented_command_exists_with_its_flags(doc, line):
    tokens = argv_of(line)
    assert tokens[1] in VERBS, f"{doc}: `{line}` names no fsdpkit command"
    path, parser = _resolve(line)
    known = _options(parser)
    if path == ["plan"]:  # plan passes trainer flags through to the trainer's own parser
        from fsdpkit.train.config import build_parser

        known |= _options(build_parser())
    for t in tokens[2:]:
        if t.startswith("--"):
            assert t.split("=")[0] in known, f"{doc}: `{line}`: {t.split('=')[0]} is not an option of {parser.prog}"


@pytest.mark.parametrize("command", sorted({tuple(_resolve(line)[0]) for _, line in COMMANDS}), ids=" ".join)
def test_documented_command_runs_with_help(command, capsys):
    from fsdpkit.cli.main import main

    with pytest.raises(SystemExit) as done:
        main([*command, "--help"])
    assert done.value.code == 0
    assert "usage:" in capsys.readouterr().out


# -- documented commands, run as written ------------------------------------------------------------
# What a line needs that this machine lacks: such a line is not run (its flags are checked above).
NEEDS = [
    (r"^fsdpkit (cluster (check|validate|addons|delete)|storage fsx (create|status|delete|list)"
     r"|infra (create|delete|status)|image (build|push|test)|deploy"
     r"|ray (submit\b(?!.*--dry-run)|delete|status|exec))\b",
     "an AWS account or a Kubernetes cluster"),
    (r"^fsdpkit (cluster create|cluster nodepool|ray create|storage fsx storage-class)\b(?!.*--dry-run)",
     "an AWS account or a cluster"),
    (r"^fsdpkit cluster team .*--apply", "a Kubernetes cluster with Kueue"),
    (r"--eks-cluster|--context", "an AWS account or a cluster"),
    (r"--dry-run=server", "a Kubernetes API server to ask"),
    (r"^fsdpkit job (status|logs|wait|watch|delete|list)\b", "a job that is running"),
    (r"^fsdpkit job submit (?!.*--dry-run)", "a cluster (or Slurm's sbatch), or it starts a job in the background"),
    (r"--pvc|/fsx/|/ckpt/", "a cluster's shared storage"),
    (r"allenai/", "the Hugging Face hub"),
    (r"--tasks (hellaswag|arc_)", "the Hugging Face hub (the harness's task data)"),
    (r"^fsdpkit metrics\b", "a Prometheus with the cluster's GPU series"),
    (r"^fsdpkit mcp\b", "an MCP client on its stdin (tests/cli/test_mcp.py drives it with the SDK's)"),
]


def needs(line: str) -> str | None:
    return next((why for rx, why in NEEDS if re.search(rx, line)), None)


# What a documented line shows other than success (its own comment says so): the exit code it ends with.
EXPECT = {r"^fsdpkit plan .*# does not fit": 1}
# The skills' lines run in tests/skills/test_skill_commands.py, against moto and kmock where they need them.
RUNNABLE = [(d, c) for d, c in COMMANDS if needs(c) is None and not d.endswith("SKILL.md")]


def _workspace(root: Path) -> dict[str, str]:
    """What a reader's folder holds before the first command of a document: a fresh clone's examples
    and some text of their own (my-corpus). Returns the env."""
    shutil.copytree(ROOT / "examples", root / "examples")
    corpus = root / "my-corpus"   # text of one's own: Python's library sources, as text files
    corpus.mkdir()
    for f in sorted(Path(os.__file__).parent.glob("*.py"))[:80]:
        (corpus / f"{f.stem}.txt").write_text(f.read_text(errors="replace"))
    return {"HOME": str(root / "home"), "FSDPKIT_HOME": str(root / "fsdpkit-home"), "HF_HUB_OFFLINE": "1",
            "MLFLOW_TRACKING_URI": f"file:{root / 'mlruns'}", "PATH": os.environ["PATH"]}


# A file a documented line names: a path whose suffix says it is one.
_FILE = re.compile(r"^[\w./-]+\.(ya?ml|txt|jsonl?|toml|jinja|sh|parquet)$")


@pytest.mark.parametrize("doc", sorted({d for d, _ in COMMANDS if not d.endswith("SKILL.md")}))
def test_every_file_a_documented_line_names_ships_or_an_earlier_line_writes_it(doc):
    """A reader copies the lines in order in a fresh clone: `ray create spec.yaml` or `image init
    --requirements requirements.txt` name nothing there. Lines that need a cluster are held to this
    too; what an earlier line names (an --out file, a run directory) counts as written by it. (The
    skills' lines name the user's own files: tests/skills runs them on fixtures.)"""
    earlier: set[str] = set()
    for line in (c for d, c in COMMANDS if d == doc):
        words = shell_argv(line.replace(" > ", " --out "))
        earlier |= {w for o, w in itertools.pairwise(words) if o in ("--out", "-o")}
        for word in words[1:]:
            path = word.split("=", 1)[-1]
            if _FILE.match(path) and not path.startswith("/"):
                written = any(path == e or path.startswith(e.rstrip("/") + "/") for e in earlier)
                assert written or (ROOT / path).exists(), f"{doc}: `{line}` names {path}: not in a fresh clone"
        earlier |= {w for w in words[1:] if not w.startswith("-")}


@pytest.fixture(scope="module")
def workspaces(tmp_path_factory):
    made: dict[str, tuple[Path, dict]] = {}

    def get(doc: str) -> tuple[Path, dict]:
        if doc not in made:
            root = tmp_path_factory.mktemp(re.sub(r"\W", "-", doc))
            made[doc] = (root, _workspace(root))
        return made[doc]
    return get


# The trainer's flags that count steps (both spellings).
_STEPS = {"--max-steps", "--max_steps", "--checkpoint-freq", "--checkpoint_freq"}


def _shortened(argv: list[str]) -> list[str]:
    """A documented training line at a hundredth of its steps, on sequences of 128 tokens where the
    line names no length of its own (nor a config that may), without a progress bar."""
    out = [str(max(1, int(v) // 100)) if flag in _STEPS else v for flag, v in itertools.pairwise(["", *argv])]
    named = {a.split("=")[0].replace("_", "-") for a in argv}
    return [*short_sequences([*out, *([] if "--max-steps" in named else ["--max_steps", "1"])]), "--progress", "off"]


@pytest.mark.slow
@pytest.mark.parametrize("doc,line", RUNNABLE, ids=[f"{d}:{c[:60]}" for d, c in RUNNABLE])
def test_documented_command_runs_as_written(doc, line, workspaces):
    """What is checked is that the command as written finds its files, parses and runs, and that a
    documented resume has steps left to train. Training runs are a hundred times shorter: each step
    count a line gives is divided by 100 (at least 1), a line that gives none stops after one step;
    their sequences are 128 tokens where the line leaves the length to its preset."""
    root, env = workspaces(doc)
    tokens = shell_argv(line.split(" > ")[0])
    argv = _shortened(tokens[1:]) if tokens[1] == "train" else tokens[1:]
    r = run_cli(*argv, cwd=root, env=env, timeout=600)
    code = next((c for rx, c in EXPECT.items() if re.search(rx, line)), 0)
    assert r.returncode == code, f"{doc}: `{line}` exited {r.returncode}, not {code}:\n{r.stderr[-2000:]}"
    if any(t.startswith("--resume") for t in tokens):   # continues the run an earlier line of the page made
        assert re.search(r"fsdpkit: resumed from \S+ at step [1-9]", r.stdout + r.stderr) and \
            "nothing to do" not in r.stdout + r.stderr, f"{doc}: `{line}` resumes nothing:\n{r.stdout[-2000:]}"
    if " > " in line:
        (root / line.split(" > ")[1].split()[0]).write_text(r.stdout)
