"""Configuration: reference flags, YAML precedence, validation, and one-line errors for bad input."""

from __future__ import annotations

from pathlib import Path

import pytest

from fsdpkit.errors import UserError
from fsdpkit.train.config import TrainConfig, parse_args

# The flags a reference job manifest passes (kubernetes/llama3_1_8b-fsdp.yaml), shrunk to run here.
REFERENCE_FLAGS = [
    "--max_context_width=128", "--num_key_value_heads=2", "--intermediate_size=96", "--hidden_width=64",
    "--num_layers=2", "--num_heads=4", "--model_type=llama_v3", "--checkpoint_freq=0",
    "--validation_freq=25", "--max_steps=7", "--train_batch_size=2", "--val_batch_size=1",
    "--sharding_strategy=full", "--offload_activations=1", "--activation_checkpointing=1", "--bf16=0",
    "--lr=0.0001", "--grad_clip=1.0", "--weight_decay=0.2", "--beta1=0.9", "--beta2=0.95", "--seed=9",
]


def test_reference_flags_map_to_fields():
    cfg, notices = parse_args(REFERENCE_FLAGS)
    m = cfg.model_config()
    assert (m.dim, m.n_layers, m.n_heads, m.n_kv_heads, m.ffn_dim, m.family) == (64, 2, 4, 2, 96, "llama")
    assert cfg.seq_len() == 128
    assert cfg.optim.max_steps == 7 and cfg.optim.lr == 1e-4 and cfg.seed == 9
    assert cfg.data.train_batch_size == 2 and cfg.data.val_batch_size == 1
    assert cfg.parallel.activation_checkpointing == "full"
    assert cfg.parallel.mixed_precision == "fp32"
    assert any("offload_activations" in n for n in notices)


def test_defaults_come_from_one_place():
    cfg, _ = parse_args([])
    assert cfg == TrainConfig()
    assert cfg.preset == "tiny" and cfg.data.dataset == "embedded"


def test_yaml_then_flags(tmp_path: Path):
    y = tmp_path / "run.yaml"
    y.write_text("preset: debug\noptim:\n  max_steps: 11\n  lr: 0.01\nnum_layers: 3\n")
    cfg, _ = parse_args(["--config", str(y), "--lr", "0.02"])
    assert cfg.preset == "debug" and cfg.optim.max_steps == 11 and cfg.optim.lr == 0.02
    assert cfg.model_config().n_layers == 3


def test_yaml_unknown_key(tmp_path: Path):
    y = tmp_path / "run.yaml"
    y.write_text("optim:\n  max_stepz: 3\n")
    with pytest.raises(UserError, match="max_stepz"):
        parse_args(["--config", str(y)])


@pytest.mark.parametrize(
    ("flags", "field"),
    [
        (["--lr_decay_style", "exponential"], "lr_decay_style"),
        (["--warmup_steps", "50", "--max_steps", "10"], "warmup_steps"),
        (["--experts_per_token", "3", "--n_experts", "2"], "experts_per_token"),
        (["--lr", "abc"], "lr"),
        (["--checkpoint_freq", "5"], "checkpoint_freq"),
    ],
)
def test_bad_values_name_the_field(flags, field):
    with pytest.raises(UserError, match=field):
        parse_args(flags)


BAD_INPUT = {
    "unknown preset": (["--preset", "llama9_1t"], "preset"),
    "heads not dividing hidden": (["--dim", "130", "--n_heads", "4"], "n_heads"),
    "kv heads not dividing heads": (["--n_heads", "4", "--n_kv_heads", "3"], "n_kv_heads"),
    "batch < 1": (["--train_batch_size", "0"], "train_batch_size"),
    "steps < 1": (["--max_steps", "0"], "max_steps"),
    "nproc above devices": (["--nproc", "4096"], "nproc"),
    "unknown flag": (["--not_a_flag", "1"], "not_a_flag"),
    "flag without value": (["--lr"], "--lr"),
}


@pytest.mark.parametrize("case", sorted(BAD_INPUT))
def test_bad_input_is_one_line_and_exit_2(case, cli, tmp_path):
    flags, field = BAD_INPUT[case]
    run_dir = tmp_path / "run"
    r = cli("train", *flags, "--run_dir", str(run_dir), timeout=60)
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and field in lines[0], r.stderr
    assert "Traceback" not in r.stderr
    assert not run_dir.exists()


def test_unwritable_run_dir_is_one_line_and_exit_2(cli, tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    r = cli("train", "--run_dir", str(blocker / "run"), timeout=60)
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "run_dir" in lines[0] and "not writable" in lines[0], r.stderr
    assert blocker.read_text() == "not a directory"
