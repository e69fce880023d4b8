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


@pytest.mark.parametrize("doc,line", COMMANDS, ids=[f"{d}:{c[:60]}" for d, c in COMMANDS])
def test_documented_command_exists_with_its_flags(doc, line):
    tokens = _tokens(line)
    verb = tokens[1]
    assert verb in VERBS, f"{doc}: `{line}` names no fsdpkit command"
    parser = verb_parser(verb)
    subs = subcommands(parser)
    if subs:
        sub = next((t for t in tokens[2:] if not t.startswith("-")), None)
        assert sub in subs, f"{doc}: `{line}`: `fsdpkit {verb}` has no subcommand {sub!r}"
        parser = subs[sub]
    known = _options(parser)
    for t in tokens[2:]:
        if t.startswith("--"):
            assert t.split("=")[0] in known, f"{doc}: `{line}`: {t.split('=')[0]} is not an option of {parser.prog}"


def _verb_and_sub(line: str) -> tuple[str, ...]:
    tokens = _tokens(line)
    subs = subcommands(verb_parser(tokens[1]))
    sub = next((t for t in tokens[2:] if not t.startswith("-")), None) if subs else None
    return (tokens[1], sub) if sub else (tokens[1],)


@pytest.mark.parametrize("command", sorted({_verb_and_sub(line) for _, line in COMMANDS}), ids=" ".join)
def test_documented_command_runs_with_help(command, capsys):
    from fsdpkit.cli.main import main

    with pytest.raises(SystemExit) as done:
        main([*command, "--help"])
    assert done.value.code == 0
    assert "usage:" in capsys.readouterr().out
