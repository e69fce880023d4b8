"""The `fsdpkit` command itself: verbs, help, presets listing."""

from __future__ import annotations

import json

import pytest


def test_presets_lists_every_preset_with_counts(cli):
    r = cli("presets", "--json")
    assert r.returncode == 0, r.stderr
    data = {row["name"]: row for row in json.loads(r.stdout)["data"]}
    assert {"tiny", "debug", "llama2_7b", "llama3_1_8b", "llama3_2_1b", "mixtral_8x7b"} <= set(data)
    assert round(data["llama3_1_8b"]["params"] / 1e9, 2) == 8.03
    assert data["mixtral_8x7b"]["active_params"] < data["mixtral_8x7b"]["params"]
    human = cli("presets")
    assert human.returncode == 0 and "llama3_1_70b" in human.stdout and "70.55B" in human.stdout


def test_train_help_lists_kebab_case_and_says_the_reference_flags_are_taken(cli):
    r = cli("train", "--help")
    assert r.returncode == 0
    for flag in ("--sharding-strategy", "--checkpoint-dir", "--nproc", "--activation-checkpointing"):
        assert flag in r.stdout
    assert "--sharding_strategy" not in r.stdout and "--max_context_width, --num_layers" in " ".join(r.stdout.split())


def test_every_option_follows_the_one_naming_rule():
    """Every listed option of every command is kebab case. Snake case only unlisted: the spelling of
    a listed option of the same command (one named after a training option), or on `train` a flag of
    the reference FSDP example."""
    import argparse
    import re

    from fsdpkit.cli.main import VERBS
    from fsdpkit.cli.reference import subcommands, verb_parser
    from fsdpkit.train.config import IGNORED_REFERENCE_FLAGS, field_index

    kebab = re.compile(r"^(-[a-zA-Z0-9]|--[a-z0-9]+(-[a-z0-9]+)*)$")
    reference = {f"--{name}" for name in [*field_index(), *IGNORED_REFERENCE_FLAGS]}
    broken, seen, count = [], set(), 0

    def walk(parser, path):
        nonlocal count
        actions = [a for a in parser._actions if a.option_strings and not isinstance(a, argparse._HelpAction)]
        listed = {o for a in actions if a.help != argparse.SUPPRESS for o in a.option_strings}
        for a in actions:
            count += len(a.option_strings)
            for o in a.option_strings:
                if a.help != argparse.SUPPRESS and not kebab.match(o):
                    broken.append(f"{path}: {o} is listed and not kebab case")
                elif a.help == argparse.SUPPRESS and not kebab.match(o) and o.replace("_", "-") not in listed \
                        and not (path == "train" and o in reference):
                    broken.append(f"{path}: {o} is neither a listed option's snake case nor a reference flag")
        for name, sub in subcommands(parser).items():
            if id(sub) not in seen:
                seen.add(id(sub))
                walk(sub, f"{path} {name}")

    # Every verb's parser kept alive while walked: ids are unique only among live objects.
    parsers = {verb: verb_parser(verb) for verb in VERBS}
    for verb, parser in parsers.items():
        walk(parser, verb)
    assert not broken, "\n".join(broken)
    assert count > 400   # every command was walked


def _options():
    """(command, option, action) for every option of every command, each parser once."""
    import argparse

    from fsdpkit.cli.main import VERBS
    from fsdpkit.cli.reference import subcommands, verb_parser

    seen: set[int] = set()
    # Every parser walked stays referenced here: an id is unique only among live objects, and a freed
    # verb's parsers would otherwise lend their ids to the next verb's, which the walk would then skip.
    alive: list[argparse.ArgumentParser] = []

    def walk(parser, path):
        alive.append(parser)
        for a in parser._actions:
            if a.option_strings and not isinstance(a, argparse._HelpAction):
                yield from ((path, o, a) for o in a.option_strings)
        for name, sub in subcommands(parser).items():
            if id(sub) not in seen:
                seen.add(id(sub))
                yield from walk(sub, f"{path} {name}")

    for verb in VERBS:
        if verb != "train":   # the trainer's options are its config's fields (checkpoint_every: steps or time)
            yield from walk(verb_parser(verb), verb)


def test_one_name_and_one_grammar_for_each_concept():
    """How long to wait is --timeout, how often to look is --poll, a window is --since: each takes a
    duration (seconds, or 30s, 15m, 2h, 1d) through the one parser of them; no other spelling of
    those concepts (--interval, a --wait that takes seconds); create and delete, never up and down;
    no verb under two names."""
    from fsdpkit.envelope import duration

    options = list(_options())
    timed = {"--timeout", "--poll", "--since", "--stall-after", "--sample-seconds"}
    wrong = [f"{c} {o}" for c, o, a in options if o in timed and a.type is not duration]
    assert not wrong, f"a duration option that does not take durations: {wrong}"
    other = [f"{c} {o}" for c, o, a in options if o == "--interval" or (o == "--wait" and a.nargs != 0)]
    assert not other, f"another name for --poll or --timeout: {other}"
    assert {o for _, o, _ in options} >= timed   # the walk saw them
    # Making and removing a thing is create and delete, on every command (cluster, storage, ray, infra).
    from fsdpkit.cli.main import VERBS
    from fsdpkit.cli.reference import subcommands, verb_parser

    def verbs(parser, path):
        for name, sub in subcommands(parser).items():
            yield f"{path} {name}", name, sub
            yield from verbs(sub, f"{path} {name}")

    named = [row for verb in VERBS if verb != "train" for row in verbs(verb_parser(verb), verb)]
    assert not [path for path, name, _ in named if name in ("up", "down", "cancel", "remove", "destroy")]
    assert {"cluster delete", "storage fsx delete", "ray delete", "infra delete", "job delete"} <= {
        path for path, _, _ in named}
    assert len({id(sub) for _, _, sub in named}) == len(named), "a verb with two names"


def test_a_duration_is_read_in_any_unit_and_a_bad_one_is_one_line(cli, tmp_path):
    from fsdpkit.durations import seconds

    assert [seconds(v) for v in ("90", "90s", "1.5", "15m", "2h", "1d", " 2H ", "1e9", "0")] == [
        90, 90, 1.5, 900, 7200, 86400, 7200, 1e9, 0]
    for bad in ("soon", "2 weeks", "1h30m", "", "inf", "nan", "--5"):
        with pytest.raises(ValueError, match=r"expected seconds \(90\) or a duration \(30s, 15m, 2h, 1d\)"):
            seconds(bad)
    for negative in ("-5", "-1e3", "-5m", "-0.5h", "-inf"):
        with pytest.raises(ValueError, match=rf"^a duration is at least 0, got '{negative}'$"):
            seconds(negative)
    # A century at most: a number too long for a float (infinity), a window a datetime cannot
    # subtract, or a wait that would outlive everyone is refused, not taken as "forever".
    assert seconds(str(100 * 365 * 86400)) == 3_153_600_000
    for huge, shown in (("9" * 400 + "d", "9" * 37 + "..."), ("1e17", "1e17"), ("1000000000d", "1000000000d"),
                        ("3153600001", "3153600001"), ("36501d", "36501d")):
        with pytest.raises(ValueError) as caught:
            seconds(huge)
        assert str(caught.value) == f"a duration is at most 100 years (3153600000 s), got '{shown}'"
    r = cli("metrics", "some-job", "--since", "1000000000d")
    assert r.returncode == 2 and r.stderr.strip().splitlines() == [
        "error: argument --since: a duration is at most 100 years (3153600000 s), got '1000000000d' "
        "(see `fsdpkit metrics --help`)"], r.stderr
    r = cli("job", "wait", "some-job", "--timeout", "soon", "--backend", "local")
    assert r.returncode == 2 and r.stderr.strip().splitlines() == [
        "error: argument --timeout: expected seconds (90) or a duration (30s, 15m, 2h, 1d), got 'soon' "
        "(see `fsdpkit job wait --help`)"], r.stderr
    # A value with a minus sign reaches the option's own check, not argparse's "expected one argument";
    # an option with no value at all is still that.
    r = cli("job", "wait", "some-job", "--timeout", "-5m", "--backend", "local")
    assert r.returncode == 2 and r.stderr.strip().splitlines() == [
        "error: argument --timeout: a duration is at least 0, got '-5m' (see `fsdpkit job wait --help`)"]
    r = cli("train", "--lr", "-1e-3")
    assert r.returncode == 2 and r.stderr.strip().splitlines() == [
        "error: lr: -0.001 is out of range; it must be >= 0.0"]
    r = cli("job", "wait", "some-job", "--backend", "local", "--timeout")
    assert r.returncode == 2 and r.stderr.strip().splitlines() == [
        "error: argument --timeout: expected one argument (see `fsdpkit job wait --help`)"]


def test_unknown_verb_exits_nonzero(cli):
    r = cli("frobnicate")
    assert r.returncode != 0


def test_help_shows_typed_values_one_default_each_and_next_steps(cli):
    text = cli("train", "--help").stdout
    assert "--lr FLOAT" in text and "--max-steps INT" in text and "--compile BOOL" in text
    assert "--lr-decay-style {cosine,linear,constant}" in text and "--checkpoint-dir DIR" in text
    assert " V " not in text and "(default: None)" not in text
    assert text.count("(default:") == text.count("default:")   # never two defaults for one option
    top = cli("--help").stdout
    assert "next steps:" in top and "fsdpkit train --nproc 2" in top


def test_a_near_miss_of_an_option_is_named(cli):
    r = cli("train", "--max_step", "10")
    assert r.returncode == 2 and r.stderr.strip() == (
        "error: unknown option '--max_step'; did you mean --max-steps? (see `fsdpkit train --help`)")


def test_a_reader_that_goes_away_ends_the_command_quietly():
    """`fsdpkit ... --json | head`: no BrokenPipeError traceback, and the exit of a process SIGPIPE ends."""
    import subprocess
    import sys

    from conftest import ROOT

    r = subprocess.run(["bash", "-c", f"'{sys.executable}' -m fsdpkit presets --json | true; "
                        "echo ${PIPESTATUS[0]} >&2"], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert r.stderr == "141\n"
