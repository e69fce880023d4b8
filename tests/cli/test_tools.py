"""The MCP tools' schemas against the CLI's own parsers: every value a schema admits becomes argv
that the command's argparse parser reads with the same meaning, a value outside a schema's choices
is one the parser refuses too, and every command line of every SKILL.md is a call of some tool
that renders back to the same parse."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import pytest
from doc_commands import argv as line_argv
from doc_commands import command_lines
from jsonschema import Draft202012Validator
from pinned import holds_recorded

from fsdpkit.cli.main import VERBS
from fsdpkit.cli.reference import verb_parser
from fsdpkit.cli.tools import NOT_TOOLS, Option, Tool, _leaves, tool_of, tools
from fsdpkit.effects import Effect, declare, declared
from fsdpkit.errors import UserError
from fsdpkit.train.config import parse_args

from conftest import ROOT

TOOLS = tools()
BY_NAME = {t.name: t for t in TOOLS}
PARSERS = {verb: verb_parser(verb) for verb in {t.words[0] for t in TOOLS}}
SKILL_LINES = [(p.parent.name, line) for p in sorted((ROOT / "src/fsdpkit/skills/data").glob("*/SKILL.md"))
               for line in command_lines(p)]


def parsed(tool: Tool, argv: list[str]) -> dict[str, Any]:
    """What the CLI's parser makes of `fsdpkit ARGV`: the namespace's values by dest, and the words
    after `--` (as `fsdpkit plan` reads a leading job spec and hands other flags to the trainer's parser)."""
    argv = [a for a in argv if a != "--json"]
    rest: list[str] = []
    if "--" in argv:
        argv, rest = argv[:argv.index("--")], argv[argv.index("--") + 1:]
    assert tuple(argv[:len(tool.words)]) == tool.words
    words = argv[len(tool.words):]
    if tool.name == "plan":
        spec = words.pop(0) if words and not words[0].startswith("-") else None
        ns, unknown = PARSERS["plan"].parse_known_args(words)
        values = {**vars(PARSERS["train"].parse_args(unknown)), **vars(ns), "spec": spec}
    else:
        values = vars(PARSERS[tool.words[0]].parse_args([*tool.words[1:], *words]))
    return {**values, "--": rest}


def meaning(tool: Tool, values: dict[str, Any]) -> dict[str, Any]:
    return {o.name: values.get(o.action.dest) for o in tool.options} | {"--": values["--"]}


def sample(o: Option, prop: dict[str, Any]) -> Any:
    """A value the property's schema admits (a duration in its own unit)."""
    one = prop["items"] if prop.get("type") == "array" else prop
    if "anyOf" in prop:
        return True
    if "enum" in one:
        value: Any = one["enum"][-1]
    elif "minimum" in one or "maximum" in one:   # inside a training option's range
        value = one.get("minimum", one.get("maximum"))
        value = int(value) if one["type"] == "integer" else float(value)
    else:
        kind = one["type"][-1] if isinstance(one["type"], list) else one["type"]
        text = "15m" if "pattern" in one else "some-value"
        value = {"boolean": True, "integer": 3, "number": 2.5, "string": text}[kind]
    return [value] if prop.get("type") == "array" else value


def expected(o: Option, value: Any) -> Any:
    """What argparse stores for the value: the flag's constant, or the value through its type."""
    a = o.action
    if value is True and (o.switch or o.optional_value):
        return a.const
    convert = a.type if callable(a.type) else str
    if isinstance(value, bool):   # a training option's BOOL, which the config reads from its word
        return str(value).lower()
    if isinstance(value, list):
        return [convert(str(v)) for v in value]
    return convert(str(value))


def required_values(tool: Tool) -> dict[str, Any]:
    schema = tool.schema()
    return {name: sample(next((o for o in tool.options if o.name == name), None), schema["properties"][name])
            if name != tool.after_dashes else ["python", "x.py"] for name in schema["required"]}


@pytest.mark.parametrize("tool", TOOLS, ids=[t.name for t in TOOLS])
def test_every_value_a_schema_admits_parses_to_the_same_meaning_in_the_cli(tool):
    schema = tool.schema()
    Draft202012Validator.check_schema(schema)
    validator = Draft202012Validator(schema)
    base = required_values(tool)
    assert validator.is_valid(base)
    for o in tool.options:
        prop = schema["properties"][o.name]
        arguments = {**base, o.name: sample(o, prop)}
        assert validator.is_valid(arguments), (o.name, arguments)
        got = meaning(tool, parsed(tool, ["fsdpkit", *tool.argv(arguments)][1:]))
        assert got[o.name] == expected(o, arguments[o.name]), (o.name, tool.argv(arguments))
        if "enum" in prop:   # outside the choices: the schema and the CLI both refuse
            assert not validator.is_valid({**base, o.name: "no-such-choice"})
            with pytest.raises(UserError):
                parsed(tool, tool.argv({**base, o.name: "no-such-choice"}))
                # The training options' parser leaves values to the config's typed fields.
                parse_args([f"{o.flag}=no-such-choice"])
        for keyword, step in (("minimum", -1), ("maximum", 1)):   # a range, both sides: schema and CLI refuse
            if keyword in prop:
                value = prop[keyword] + step
                outside = {**base, o.name: value}
                assert not validator.is_valid(outside)
                if o.field is None:
                    with pytest.raises(UserError):
                        parsed(tool, tool.argv(outside))
                else:   # a training option: its typed config names the field and the range
                    with pytest.raises(UserError, match=f"{o.action.dest}: .* out of range"):
                        parse_args([f"{o.flag}={value}"])
    # A required argument left out: refused by the schema, and by the CLI where argparse checks it.
    for name in schema["required"]:
        assert not validator.is_valid({k: v for k, v in base.items() if k != name})


def test_the_catalogue_is_every_command_but_the_server():
    # A verb without subcommands is one tool; others one per subcommand (an alias is not a second tool).
    assert {"train", "plan", "job_submit", "job_delete", "storage_fsx_storage_class", "ray_exec"} <= set(BY_NAME)
    assert "mcp" not in BY_NAME and len(BY_NAME) == len(TOOLS)
    assert {t.name for t in TOOLS if t.confirms} == {"ckpt_prune", "cluster_delete", "cluster_check",
                                                    "cluster_nodepool", "storage_fsx_delete", "ray_delete",
                                                    "infra_delete", "job_delete"}
    assert BY_NAME["job_submit"].destructive and not BY_NAME["job_submit"].confirms   # --replace deletes a job


def tool_for(argv: list[str]) -> Tool:
    matches = [t for t in TOOLS if tuple(argv[1:1 + len(t.words)]) == t.words]
    assert matches, f"no tool for {' '.join(argv)}"
    return max(matches, key=lambda t: len(t.words))


def typed(prop: dict[str, Any], value: Any) -> Any:
    """A training option's word (its parser keeps strings) as the JSON value its schema types."""
    if not isinstance(value, str):
        return value
    kind = prop.get("type")
    if kind == "integer":
        return int(value)
    if kind == "number":
        return float(value)
    if kind == "boolean":
        return value.lower() in ("1", "true", "yes", "on")
    return value


def arguments_of(tool: Tool, values: dict[str, Any]) -> dict[str, Any]:
    """The tool call a parsed command line is: every value that is not the parser's default."""
    arguments: dict[str, Any] = {}
    props = tool.schema()["properties"]
    for o in tool.options:
        value = values.get(o.action.dest)
        if value is None or value is False or value == [] or value == o.action.default:
            continue
        arguments[o.name] = True if (o.optional_value and value == o.action.const) else typed(props[o.name], value)
    if values["--"]:
        arguments[tool.after_dashes] = values["--"]
    return arguments


@pytest.mark.parametrize(("skill", "line"), SKILL_LINES, ids=[f"{s}:{line[:60]}" for s, line in SKILL_LINES])
def test_every_skill_command_is_a_tool_call(skill, line):
    argv = line_argv(line)
    tool = tool_for(argv)
    before = parsed(tool, argv[1:])
    arguments = arguments_of(tool, before)
    assert not list(Draft202012Validator(tool.schema()).iter_errors(arguments)), arguments
    props = tool.schema()["properties"]
    assert {k: typed(props.get(k, {}), v) for k, v in meaning(tool, parsed(tool, tool.argv(arguments))).items()} \
        == {k: typed(props.get(k, {}), v) for k, v in meaning(tool, before).items()}


def test_every_command_is_in_some_skill():
    """An agent that reads the skills finds every command: each tool is some skill line's command."""
    taught = {tool_for(line_argv(line)).name for _, line in SKILL_LINES}
    assert sorted(set(BY_NAME) - taught) == []


def test_a_value_that_looks_like_a_flag_stays_a_value():
    tool = BY_NAME["job_submit"]
    values = parsed(tool, tool.argv({"spec": "job.yaml", "set": ["train.lr=-1e-4"], "name": "-odd"}))
    assert (values["set"], values["name"]) == (["train.lr=-1e-4"], "-odd")


def catalogue(catalogued: list[Tool]) -> dict[str, Any]:
    return {t.name: {"words": t.words, "description": t.description, "schema": t.schema(), "long": t.long,
                     "read_only": t.read_only, "confirms": t.confirms, "destructive": t.destructive,
                     "open_world": t.open_world, "consents": t.consents, "after_dashes": t.after_dashes,
                     "effects": [str(t.effects.always), [[k, str(v)] for k, v in t.effects.when]]}
            for t in catalogued}


def test_every_tool_s_schema_and_hints_are_held_to_the_recorded_catalogue():
    """What an agent is shown: each tool's words, description, schema (types, ranges, choices,
    defaults, required, the help of each property) and hints, in the CLI's order. A change is a
    change to the agents' interface: record it with FSDPKIT_UPDATE_TOOLS=1 and review the diff.
    Built here, not at import, so that the test sees the catalogue as the code now makes it."""
    built = tools()
    holds_recorded(Path(__file__).with_name("tools.json"), "tools", catalogue(built), "FSDPKIT_UPDATE_TOOLS")
    holds_recorded(Path(__file__).with_name("tools.json"), "order", [t.name for t in built], "FSDPKIT_UPDATE_TOOLS")


def test_plan_takes_a_job_spec_first_then_its_own_options_then_the_trainer_s():
    built = {t.name: t for t in tools()}
    plan, train = built["plan"], built["train"]
    names = [o.name for o in plan.options]
    assert names[0] == "spec" and not plan.options[0].action.option_strings
    own = [o.name for o in tool_of(plan.words, PARSERS["plan"], plan.description).options]
    assert names[1:1 + len(own)] == own
    assert names[1 + len(own):] == [o.name for o in train.options if o.name not in own]
    assert "spec" not in plan.schema()["required"]


def test_a_call_becomes_the_command_s_words_its_positionals_and_flags_in_the_parser_s_order():
    submit = BY_NAME["job_submit"]
    assert submit.argv({"spec": "job.yaml", "set": ["a=1", "b=2"], "replace": True, "dry_run": True}) == [
        "job", "submit", "job.yaml", "--set=a=1", "--set=b=2", "--dry-run", "--replace", "--json"]
    assert submit.argv({"spec": "job.yaml", "replace": False, "dry_run": "server", "name": None}) == [
        "job", "submit", "job.yaml", "--dry-run=server", "--json"]
    exec_ = BY_NAME["ray_exec"]
    assert exec_.argv({"name": "r", "command": ["python", "-c", 1]})[-4:] == ["--", "python", "-c", "1"]
    assert exec_.argv({"name": "r"})[-1] == "--json"
    with pytest.raises(UserError) as e:
        submit.argv({"spec": "job.yaml", "bogus": 1, "also": 2})
    assert str(e.value) == "job_submit: no argument also, bogus; use the ones its schema lists"


def test_only_a_confirmed_call_or_a_dry_run_creates_deletes_costs_or_overwrites():
    delete = BY_NAME["job_delete"]
    refused = delete.unconfirmed({"name": "j"})
    assert refused is not None
    assert (str(refused), refused.hint, refused.code) == (
        "job_delete: deletes what it names, and nobody confirmed it",
        "ask the user, then call it again with yes: true; or call it with dry_run: true to see what it would do",
        "unconfirmed")
    assert delete.unconfirmed({"name": "j", "yes": True}) is None
    assert delete.unconfirmed({"name": "j", "dry_run": True}) is None
    assert delete.unconfirmed({"name": "j", "yes": False}) is not None
    # What an argument adds: cluster check changes the cluster only with its fixes.
    check = BY_NAME["cluster_check"]
    assert check.unconfirmed({}) is None and check.unconfirmed({"fix": False}) is None
    fixing = check.unconfirmed({"fix": True})
    assert fixing is not None and str(fixing) == ("cluster_check: creates or changes cloud or cluster resources, "
                                                  "and nobody confirmed it")
    assert fixing.hint == "ask the user, then call it again with yes: true"   # it has no dry run
    assert check.unconfirmed({"fix": True, "yes": True}) is None
    assert BY_NAME["job_list"].unconfirmed({}) is None   # nothing to confirm
    submit = BY_NAME["job_submit"]
    assert str(submit.unconfirmed({"spec": "j.yaml", "replace": True})) == (
        "job_submit: deletes what it names, creates or changes cloud or cluster resources, starts what AWS bills, "
        "and nobody confirmed it")
    assert submit.unconfirmed({"spec": "j.yaml", "dry_run": True, "replace": True}) is None
    assert submit.unconfirmed({"spec": "j.yaml", "dry_run": "server"}) is None
    assert str(BY_NAME["image_check"].unconfirmed({"dockerfile": "D", "fix": True})) == (
        "image_check: overwrites local files, and nobody confirmed it")
    assert BY_NAME["image_check"].unconfirmed({"dockerfile": "D"}) is None
    assert BY_NAME["job_init"].unconfirmed({"out": "j.yaml"}) is None   # a new file: no consent
    assert BY_NAME["job_init"].unconfirmed({"out": "j.yaml", "force": True}) is not None


def test_yes_is_an_argument_of_every_tool_that_may_need_it_and_never_reaches_a_cli_without_it():
    submit = BY_NAME["job_submit"]
    assert submit.schema()["properties"]["yes"] == {
        "type": "boolean", "description": "the user agreed to what this call does (deletes what it names, creates or "
        "changes cloud or cluster resources, starts what AWS bills): ask them first"}
    assert submit.argv({"spec": "job.yaml", "yes": True}) == ["job", "submit", "job.yaml", "--json"]
    # A command that asks itself gets the CLI's own --yes.
    assert BY_NAME["job_delete"].argv({"job": "j", "yes": True})[-2:] == ["--yes", "--json"]
    assert "yes" not in BY_NAME["plan"].schema()["properties"]
    with pytest.raises(UserError):
        BY_NAME["plan"].argv({"yes": True})


def test_a_command_whose_parser_declares_no_effects_is_no_tool():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out")
    with pytest.raises(TypeError) as e:
        tool_of(("new", "verb"), parser, "")
    assert str(e.value) == "fsdpkit new verb: its parser declares no effects (fsdpkit.effects.declare)"
    declare(parser, Effect.WRITES, force=Effect.OVERWRITES)
    with pytest.raises(TypeError) as e:
        tool_of(("new", "verb"), parser, "")
    assert str(e.value) == "fsdpkit new verb: its effects name no option force"
    declare(parser, Effect.WRITES, out=Effect.OVERWRITES)
    assert tool_of(("new", "verb"), parser, "").consents


def test_every_command_of_every_verb_declares_its_effects():
    for verb in VERBS:
        if verb in NOT_TOOLS:
            continue
        for words, parser, _ in _leaves(verb_parser(verb), (verb,)):
            assert declared(parser) is not None, words
