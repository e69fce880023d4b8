"""The command reference (docs/reference.md), generated from the CLI's own parsers so it cannot go stale.

    python -m fsdpkit.cli.reference > docs/reference.md

Each verb's parser (its module's build_parser) is described (arguments, defaults, choices, help)
in a fixed format, independent of the Python version's help layout. A test regenerates this and
compares it with the file.
"""

from __future__ import annotations

import argparse
import importlib
from typing import Any

from fsdpkit.cli.main import VERBS
from fsdpkit.errors import CODES


def verb_parser(verb: str) -> argparse.ArgumentParser:
    """The parser `fsdpkit VERB` runs: its module's build_parser (tokenizer_parser beside
    tokenizer_main), built without parsing anything."""
    module_name, _, func = VERBS[verb][0].partition(":")
    name = f"{func.removesuffix('_main')}_parser" if func else "build_parser"
    parser: argparse.ArgumentParser = getattr(importlib.import_module(module_name), name)()
    return parser


def help_text(action: argparse.Action) -> str:
    """An option's help as argparse prints it: %(default)s filled in, %% a plain %."""
    return (action.help or "").replace("%(default)s", str(action.default)).replace("%%", "%").replace("\n", " ")


def _describe(action: argparse.Action) -> str:
    if action.option_strings:
        name = ", ".join(f"`{o}`" for o in action.option_strings)
        if action.nargs != 0:
            name += f" `{action.metavar or action.dest.upper()}`"
    else:
        name = f"`{action.metavar or action.dest}`"
    text = help_text(action)
    extra = []
    if action.choices and not isinstance(action, argparse._SubParsersAction):
        extra.append("one of " + ", ".join(f"`{c}`" for c in action.choices))
    if action.default not in (None, False, argparse.SUPPRESS, []) and action.option_strings and action.nargs != 0:
        extra.append(f"default `{action.default}`")
    text = " ".join(filter(None, [text, f"({'; '.join(extra)})" if extra else ""]))
    return f"- {name}" + (f": {text}" if text else "")


def _subparsers_action(parser: argparse.ArgumentParser) -> argparse._SubParsersAction[Any] | None:
    return next((a for a in parser._actions if isinstance(a, argparse._SubParsersAction)), None)


def subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    """A parser's subcommands by name (empty for a verb without any)."""
    action = _subparsers_action(parser)
    return dict(action.choices) if action else {}


def subcommand_helps(parser: argparse.ArgumentParser) -> dict[str, str]:
    """Each subcommand's help line, by name (what describes one without a description of its own)."""
    action = _subparsers_action(parser)
    return {a.dest: a.help or "" for a in action._choices_actions} if action else {}


def _section(parser: argparse.ArgumentParser, depth: int, description: str | None = None) -> list[str]:
    lines = [f"{'#' * depth} `{parser.prog}`", ""]
    if description := parser.description or description:
        lines += [" ".join(description.split()), ""]
    for action in parser._actions:
        if isinstance(action, argparse._HelpAction | argparse._SubParsersAction) or action.help == argparse.SUPPRESS:
            continue
        lines.append(_describe(action))
    if lines[-1]:
        lines.append("")
    if subs := _subparsers_action(parser):
        # A subcommand without a description of its own is described by its help line.
        helps = subcommand_helps(parser)
        seen: set[int] = set()
        for name, sub in subs.choices.items():
            if id(sub) not in seen:  # an alias of a verb is the same parser
                seen.add(id(sub))
                lines += _section(sub, depth + 1, helps.get(name))
    return lines


def render() -> str:
    lines = ["# Command reference", "",
             "Generated from the CLI by `python -m fsdpkit.cli.reference > docs/reference.md`; do not edit.",
             "Every command takes `--help`; those with `--json` print one envelope "
             '`{"ok", "data", "error": {"code", "message", "hint"}}`.', ""]
    lines += [f"- `fsdpkit {verb}`: {text}" for verb, (_m, text) in VERBS.items()]
    lines += ["", "## The envelope", "",
              "`ok` is true exactly when the command exits 0. A command that ran and found problems (a check, a "
              "failed or stopped job) exits non-zero with `ok: false`, its findings in `data` and `error` saying "
              "what failed; a command that could not do its work has `data: null`. `error.hint` is the one action "
              "that fixes it, where there is one. `error.code` is one of:", ""]
    lines += [f"- `{code}`: {meaning}" for code, meaning in CODES.items()]
    lines.append("")
    for verb in VERBS:
        lines += _section(verb_parser(verb), 2)
    return "\n".join(lines).rstrip("\n") + "\n"


if __name__ == "__main__":
    print(render(), end="")
