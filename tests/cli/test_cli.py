"""The `fsdpkit` command itself: verbs, help, presets listing."""

from __future__ import annotations

import json


def test_presets_lists_every_preset_with_counts(cli):
    r = cli("presets", "--json")
    assert r.returncode == 0, r.stderr
    data = {row["name"]: row for row in json.loads(r.stdout)["data"]}
    assert {"tiny", "debug", "llama2_7b", "llama3_1_8b", "llama3_2_1b", "mixtral_8x7b"} <= set(data)
    assert round(data["llama3_1_8b"]["params"] / 1e9, 2) == 8.03
    assert data["mixtral_8x7b"]["active_params"] < data["mixtral_8x7b"]["params"]
    human = cli("presets")
    assert human.returncode == 0 and "llama3_1_70b" in human.stdout and "70.55B" in human.stdout


def test_train_help_lists_reference_flags(cli):
    r = cli("train", "--help")
    assert r.returncode == 0
    for flag in ("--max_context_width", "--hidden_width", "--num_layers", "--sharding_strategy",
                 "--checkpoint_dir", "--nproc", "--activation_checkpointing"):
        assert flag in r.stdout


def test_unknown_verb_exits_nonzero(cli):
    r = cli("frobnicate")
    assert r.returncode != 0


def test_help_shows_typed_values_one_default_each_and_next_steps(cli):
    text = cli("train", "--help").stdout
    assert "--lr FLOAT" in text and "--max_steps INT" in text and "--compile BOOL" in text
    assert "--lr_decay_style {cosine,linear,constant}" in text and "--checkpoint_dir DIR" in text
    assert " V " not in text and "(default: None)" not in text
    assert text.count("(default:") == text.count("default:")   # never two defaults for one option
    top = cli("--help").stdout
    assert "next steps:" in top and "fsdpkit train --nproc 2" in top


def test_a_near_miss_of_an_option_is_named(cli):
    r = cli("train", "--max_step", "10")
    assert r.returncode == 2 and r.stderr.strip() == (
        "error: unknown option '--max_step'; did you mean --max_steps? (see `fsdpkit train --help`)")


def test_a_reader_that_goes_away_ends_the_command_quietly():
    """`fsdpkit ... --json | head`: no BrokenPipeError traceback, and the exit of a process SIGPIPE ends."""
    import subprocess
    import sys

    from conftest import ROOT

    r = subprocess.run(["bash", "-c", f"'{sys.executable}' -m fsdpkit presets --json | true; "
                        "echo ${PIPESTATUS[0]} >&2"], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert r.stderr == "141\n"
