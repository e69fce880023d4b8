"""The docs cannot drift from the CLI: the reference is regenerated and compared, and every
`fsdpkit ...` line in the README, the docs and the agent skills names a real command, subcommand
and flags (checked against the parsers the CLI builds, as `--help` would show them)."""

from __future__ import annotations

import argparse
import re
import shlex

import pytest

from fsdpkit.cli.main import VERBS
from fsdpkit.cli.reference import render, subcommands, verb_parser

from conftest import ROOT

SKILL_FILES = sorted((ROOT / "src" / "fsdpkit" / "skills" / "data").glob("*/SKILL.md"))
DOC_FILES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), *SKILL_FILES]
FENCE = re.compile(r"```[a-z]*\n(.*?)```", re.S)


def documented_commands() -> list[tuple[str, str]]:
    found = []
    for path in DOC_FILES:
        if path.name == "reference.md":
            continue
        for block in FENCE.findall(path.read_text()):
            for line in block.replace("\\\n", " ").splitlines():
                line = re.sub(r"^\s*(\$\s*)?(\.venv/bin/)?", "", line)
                if line.startswith("fsdpkit "):
                    found.append((str(path.relative_to(ROOT)), line))
    return found


COMMANDS = documented_commands()


def test_command_reference_is_generated_from_the_cli():
    assert (ROOT / "docs" / "reference.md").read_text() == render(), \
        "docs/reference.md is stale: python -m fsdpkit.cli.reference > docs/reference.md"


def test_the_docs_show_commands():
    assert len(COMMANDS) > 20


def _options(parser: argparse.ArgumentParser) -> set[str]:
    return {o for a in parser._actions for o in a.option_strings}


def _tokens(line: str) -> list[str]:
    """A documented command line as argv, up to a pipe or `&&`, and up to a bare `--` (what follows
    is the entrypoint's own command line)."""
    tokens = shlex.split(line.split(" | ")[0].split(" && ")[0], comments=True)
    return tokens[:tokens.index("--")] if "--" in tokens else tokens


def _resolve(line: str) -> tuple[list[str], argparse.ArgumentParser]:
    """The command path (verb, subcommand, sub-subcommand...) a documented line names, and its parser."""
    tokens = _tokens(line)
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
    tokens = _tokens(line)
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
