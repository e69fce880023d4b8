"""The CLI's commands as agent tools: one tool per leaf command (`job submit` -> `job_submit`), its
JSON Schema made from the command's own argparse parser, and the argv a call becomes.

The parsers are the one source: a flag added to a command is a property of its tool, with the same
type, choices, default and help; what the command does (fsdpkit.effects, declared beside its parser)
is its tool's hints and consent rule. `fsdpkit mcp` serves these; tests/cli/test_tools.py checks that
every value a schema admits parses to the same meaning in the CLI, and that every skill's command
lines are tool calls.
"""

from __future__ import annotations

import argparse
from collections.abc import Iterator
from dataclasses import dataclass, replace
from typing import Any

from fsdpkit.cli.main import VERBS
from fsdpkit.cli.reference import help_text, subcommand_helps, subcommands, verb_parser
from fsdpkit.effects import CONSENT, Effect, Effects, declared, in_words
from fsdpkit.errors import UserError
from fsdpkit.train.config import option_schema

# Verbs that are not tools: the server itself.
NOT_TOOLS = {"mcp"}
# Commands that take a command line of their own after `--` (fsdpkit ray submit SPEC -- python x.py):
# the tool property that carries it, as a list of words.
AFTER_DASHES = {"ray_submit": "entrypoint", "ray_exec": "command"}
_DURATION = {"type": ["number", "string"], "pattern": r"^\d+(\.\d+)?[smhd]?$",
             "description_suffix": "seconds, or 30s, 15m, 2h, 1d"}
# argparse `type=` functions by name -> the JSON Schema of the values they take.
_TYPES: dict[str, dict[str, Any]] = {
    "int": {"type": "integer"},
    "float": {"type": "number"},
    "duration": _DURATION,
    "_count": {"type": "integer", "minimum": 0},
    "_days": {"type": "number", "minimum": 0},
    "_limit": {"type": "number", "exclusiveMinimum": 0},
    "_batch": {"type": "integer", "minimum": 1},
}


@dataclass(frozen=True)
class Option:
    """One property of a tool: the argparse action behind it (and for a training option, whose
    parser keeps strings, the schema of its config field: type, choices, range)."""

    name: str
    action: argparse.Action
    field: dict[str, Any] | None = None

    @property
    def positional(self) -> bool:
        return not self.action.option_strings

    @property
    def flag(self) -> str:
        return next(o for o in self.action.option_strings if o.startswith("--"))

    @property
    def many(self) -> bool:
        return isinstance(self.action, argparse._AppendAction) or self.action.nargs in ("+", "*")

    @property
    def switch(self) -> bool:
        return self.action.nargs == 0

    @property
    def optional_value(self) -> bool:
        """`--dry-run` alone or `--dry-run=server`: true stands for the flag alone."""
        return self.action.nargs == "?" and bool(self.action.option_strings)


@dataclass(frozen=True)
class Tool:
    name: str
    words: tuple[str, ...]          # the command: ("job", "submit")
    description: str
    options: tuple[Option, ...]
    effects: Effects
    after_dashes: str | None = None

    @property
    def confirms(self) -> bool:
        """The CLI asks for --yes itself before it deletes or changes what exists."""
        return any(o.name == "yes" for o in self.options)

    @property
    def consents(self) -> bool:
        """Some call of it needs the user's yes (it creates, deletes, costs or overwrites)."""
        return bool(self.effects.possible & CONSENT)

    @property
    def destructive(self) -> bool:
        """It may delete or overwrite what exists (`replace` of a job, `force` of a file)."""
        return bool(self.effects.possible & (Effect.DELETES | Effect.OVERWRITES))

    @property
    def long(self) -> bool:
        return bool(self.effects.possible & Effect.LONG)

    @property
    def read_only(self) -> bool:
        """No call of it writes, creates, deletes or costs anything."""
        return not self.effects.possible & (CONSENT | Effect.WRITES)

    @property
    def open_world(self) -> bool:
        """It reaches beyond this machine: AWS, a cluster, a registry, a hub."""
        return bool(self.effects.possible & (Effect.REMOTE | Effect.CREATES | Effect.DELETES | Effect.COSTS))

    def schema(self) -> dict[str, Any]:
        """The tool's input schema (JSON Schema 2020-12)."""
        props = {o.name: _property(o) for o in self.options}
        if self.after_dashes:
            props[self.after_dashes] = {"type": "array", "items": {"type": "string"}, "minItems": 1,
                                        "description": "the command line to run, as a list of words"}
        if self.consents and not self.confirms:
            props["yes"] = {"type": "boolean", "description": "the user agreed to what this call does ("
                            f"{in_words(self.effects.possible & CONSENT)}): ask them first"}
        required = [o.name for o in self.options if (o.positional and o.action.nargs not in ("?", "*"))
                    or o.action.required]
        if self.after_dashes:
            required.append(self.after_dashes)
        return {"type": "object", "properties": props, "required": required, "additionalProperties": False}

    def argv(self, arguments: dict[str, Any]) -> list[str]:
        """`fsdpkit` argv for a call: the command's words, positionals, `--flag=value` options
        (a value that starts with `-` stays a value), `--json`, then `-- words` where the command
        takes a command line."""
        unknown = set(arguments) - {o.name for o in self.options} - {self.after_dashes} - (
            {"yes"} if self.consents else set())
        if unknown:
            raise UserError(f"{self.name}: no argument {', '.join(sorted(unknown))}; "
                            f"use the ones its schema lists")
        argv = list(self.words)
        for o in self.options:
            if o.name not in arguments or arguments[o.name] is None:
                continue
            value = arguments[o.name]
            values = value if isinstance(value, list) else [value]
            if o.positional:
                argv += [_word(v) for v in values]
            elif o.switch or (o.optional_value and isinstance(value, bool)):
                argv += [o.flag] if value is True else []
            elif isinstance(o.action, argparse._AppendAction):
                argv += [f"{o.flag}={_word(v)}" for v in values]
            elif o.many:
                argv += [o.flag, *(_word(v) for v in values)]
            else:
                argv.append(f"{o.flag}={_word(value)}")
        argv.append("--json")
        if self.after_dashes and arguments.get(self.after_dashes):
            argv += ["--", *map(str, arguments[self.after_dashes])]
        return argv

    def unconfirmed(self, arguments: dict[str, Any]) -> UserError | None:
        """The refusal of a call that would create, delete, cost or overwrite without the user's
        yes: it must say `yes` (after asking the user), or be a dry run, which does none of it."""
        effect = self.effects.of(arguments) & CONSENT
        if not effect or arguments.get("yes"):
            return None
        dry = "; or call it with dry_run: true to see what it would do" if any(
            o.name == "dry_run" for o in self.options) else ""
        return UserError(f"{self.name}: {in_words(effect)}, and nobody confirmed it",
                         hint=f"ask the user, then call it again with yes: true{dry}", code="unconfirmed")


def _word(value: Any) -> str:
    if isinstance(value, bool):
        return str(value).lower()
    return str(value)


def _help(action: argparse.Action) -> str:
    return " ".join(help_text(action).split())


def _jsonable(value: Any) -> bool:
    return value is None or isinstance(value, str | int | float | bool) or (
        isinstance(value, list | tuple) and all(_jsonable(v) for v in value))


def _property(o: Option) -> dict[str, Any]:
    a = o.action
    if o.switch:
        return {"type": "boolean", "description": _help(a)} if a.help else {"type": "boolean"}
    item = dict(o.field or _TYPES.get(getattr(a.type, "__name__", ""), {"type": "string"}))
    suffix = item.pop("description_suffix", "")
    if a.choices is not None:
        item = {"enum": list(a.choices)}
    prop: dict[str, Any] = {"type": "array", "items": item} if o.many else item
    if o.optional_value:
        prop = {"anyOf": [{"type": "boolean"}, item]}
    if description := "; ".join(filter(None, [_help(a), suffix])):
        prop["description"] = description
    default = a.default
    if default not in (None, argparse.SUPPRESS, []) and _jsonable(default):
        prop["default"] = list(default) if isinstance(default, tuple) else default
    return prop


def _option_name(action: argparse.Action) -> str:
    """The property's name: the long flag in snake case (`--dry-run` -> dry_run), a positional's dest."""
    long_flags = [o for o in action.option_strings if o.startswith("--")]
    return long_flags[0][2:].replace("-", "_") if long_flags else action.dest


def _leaves(parser: argparse.ArgumentParser, words: tuple[str, ...]) -> Iterator[tuple[tuple[str, ...],
                                                                                     argparse.ArgumentParser, str]]:
    subs = subcommands(parser)
    if not subs:
        yield words, parser, parser.description or ""
        return
    helps = subcommand_helps(parser)
    seen: set[int] = set()
    for name, sub in subs.items():
        if id(sub) in seen:  # an alias is the same parser
            continue
        seen.add(id(sub))
        for found, leaf, description in _leaves(sub, (*words, name)):
            yield found, leaf, description or helps.get(name, "")


def tool_of(words: tuple[str, ...], parser: argparse.ArgumentParser, description: str) -> Tool:
    name = "_".join(words).replace("-", "_")
    effects = declared(parser)
    if effects is None:
        raise TypeError(f"fsdpkit {' '.join(words)}: its parser declares no effects (fsdpkit.effects.declare)")
    # The trainer's parser is its config's (fsdpkit train and the options plan hands it).
    field = option_schema if words == ("train",) else (lambda dest: None)
    options = tuple(Option(_option_name(a), a, field(a.dest)) for a in parser._actions
                    if not isinstance(a, argparse._HelpAction | argparse._VersionAction)
                    and a.help != argparse.SUPPRESS and a.dest != "json")
    unknown = {argument for argument, _ in effects.when} - {o.name for o in options}
    if unknown:
        raise TypeError(f"fsdpkit {' '.join(words)}: its effects name no option {', '.join(sorted(unknown))}")
    return Tool(name, words, " ".join(description.split()) or f"fsdpkit {' '.join(words)}", options, effects,
                AFTER_DASHES.get(name))


def _plan_tool(plan: Tool, train: Tool) -> Tool:
    """`fsdpkit plan [JOBSPEC] [options] [trainer flags]`: its parser names neither the job spec,
    which comes first, nor the trainer's options, which go to the trainer's own parser."""
    spec = argparse._StoreAction([], "spec", nargs="?", help="a job spec YAML: its train options, instance type "
                                 "and nodes (omit to plan from the options alone)")
    own = {o.name for o in plan.options}
    return replace(plan, options=(Option("spec", spec), *plan.options,
                                  *(o for o in train.options if o.name not in own)))


def tools() -> list[Tool]:
    """Every leaf command of every verb, in the CLI's order."""
    found = [tool_of(words, parser, description)
             for verb in VERBS if verb not in NOT_TOOLS
             for words, parser, description in _leaves(verb_parser(verb), (verb,))]
    by_name = {t.name: t for t in found}
    return [_plan_tool(t, by_name["train"]) if t.name == "plan" else t for t in found]
