"""Real training runs: the default job learns, N ranks match 1 process, metrics land on disk."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from conftest import FAST, ROOT, losses, read_metrics, run_cli, write_fixture

pytestmark = pytest.mark.slow

STEPS = ["--max_steps", "6", "--logging_freq", "1", "--warmup_steps", "2", "--tensorboard", "0"]


def test_make_run_default_job_learns(tmp_path):
    """`make run` (the README's first command) on the embedded default, shortened to 50 of its 300
    steps as the README shows (`RUN_ARGS="--max-steps 50"`): loss falls clearly (by a quarter on
    the pinned torch: 3.98 -> 2.95, validation 2.82). The whole run's time and losses are the
    README's measured figures; 300 steps is the default config's (test_config)."""
    run_dir = tmp_path / "default"
    # The virtual environment this suite runs in (CI also runs it in one with the newest torch).
    env = {**os.environ, "RUN_ARGS": f"--run_dir {run_dir} --progress off --max-steps 50",
           "VENV": str(Path(os.sys.executable).parents[1])}
    r = subprocess.run(["make", "run"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    assert "Batch 50 Loss:" in r.stdout and "samples/sec" in r.stdout and "MFU:" in r.stdout
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == 50
    assert summary["final_loss"] < 0.8 * summary["first_loss"], summary
    assert summary["final_val_loss"] < 0.8 * summary["first_loss"], summary


@pytest.fixture(scope="module")
def single_process_run(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("single") / "run"
    r = run_cli("train", *FAST, *STEPS, "--train_batch_size", "8", "--val_batch_size", "8",
                "--run_dir", str(run_dir), "--tensorboard", "1")
    assert r.returncode == 0, r.stderr[-3000:]
    return run_dir


@pytest.mark.parametrize(
    "extra",
    [
        [],
        ["--activation_checkpointing", "full"],
        ["--sharding_strategy", "hybrid", "--dp_replicate", "2", "--activation_checkpointing", "selective"],
        ["--cpu_offload", "1", "--reshard_after_forward", "0"],
    ],
    ids=["fsdp", "fsdp+ac", "hsdp+selective-ac", "offload+no-reshard"],
)
def test_two_ranks_match_one_process(single_process_run, tmp_path, extra):
    run_dir = tmp_path / "run"
    r = run_cli("train", *FAST, *STEPS, "--train_batch_size", "4", "--val_batch_size", "4", "--nproc", "2",
                "--run_dir", str(run_dir), *extra)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "2 x cpu" in r.stdout
    # Hybrid is a real 2-D mesh (replicate x shard), never an alias of full sharding.
    mesh = "dp_replicate=2 x dp_shard=1" if "hybrid" in extra else "mesh dp_shard=2;"
    assert mesh in r.stdout
    # One MFU denominator for the run, the one the start line gives: every step's MFU is its
    # TFLOP/s over that figure (the ranks measured it together and agreed on it).
    peaks = [float(x) for x in re.findall(r"MFU denominator ([\d.]+) TFLOP/s \(measured-gemm\)", r.stdout)]
    assert len(peaks) == 1 and "MFU denominator" not in r.stdout.split("MFU denominator", 1)[1]
    rows = [m for m in read_metrics(run_dir) if m["mfu"] is not None]
    # --nproc is recorded as given (torchrun's parser never sees it): `--config` of this starts two again.
    assert yaml.safe_load((run_dir / "config.yaml").read_text())["parallel"]["nproc"] == 2
    assert all(m["tflops_per_device"] / m["mfu"] == pytest.approx(peaks[0], abs=5e-4) for m in rows)
    one, two = losses(single_process_run), losses(run_dir)
    assert len(one) == len(two) == 6
    assert one[-1] < one[0]  # it trained
    assert two == pytest.approx(one, abs=1e-5)
    # Validation covers the same held-out blocks split over the ranks, averaged across them.
    val_one, val_two = read_metrics(single_process_run, "val"), read_metrics(run_dir, "val")
    assert val_two[-1]["val_loss"] == pytest.approx(val_one[-1]["val_loss"], abs=1e-5)


def test_gradient_accumulation_matches_larger_batch(single_process_run, tmp_path):
    run_dir = tmp_path / "run"
    r = run_cli("train", *FAST, *STEPS, "--train_batch_size", "4", "--grad_accum_steps", "2",
                "--run_dir", str(run_dir))
    assert r.returncode == 0, r.stderr[-3000:]
    assert losses(run_dir) == pytest.approx(losses(single_process_run), abs=1e-5)


def test_same_seed_reproduces_and_other_seed_differs(single_process_run, tmp_path):
    again, other = tmp_path / "again", tmp_path / "other"
    for d, seed in ((again, "1234"), (other, "99")):
        r = run_cli("train", *FAST, *STEPS, "--train_batch_size", "8", "--run_dir", str(d), "--seed", seed)
        assert r.returncode == 0, r.stderr[-3000:]
    assert losses(again) == losses(single_process_run)
    assert losses(other) != pytest.approx(losses(single_process_run), abs=1e-3)


def test_metrics_jsonl_and_tensorboard_events(single_process_run):
    rows = read_metrics(single_process_run)
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6]
    for r in rows:
        assert r["tokens_per_s"] > 0 and r["tokens_per_s_per_device"] > 0
        assert 0 < r["mfu"] < 1 and r["tflops_per_device"] > 0
        assert r["peak_memory_gib"] > 0 and r["grad_norm"] > 0 and r["lr"] > 0
        assert r["host_page_faults_per_step"] >= 0 and r["skipped_steps"] == 0
    val = read_metrics(single_process_run, "val")
    assert val and val[-1]["step"] == 6 and val[-1]["val_loss"] > 0

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = list((single_process_run / "tensorboard").glob("events.out.tfevents.*"))
    assert events
    acc = EventAccumulator(str(single_process_run / "tensorboard"))
    acc.Reload()
    tags = acc.Tags()["scalars"]
    assert {"train/loss", "train/mfu", "train/tokens_per_s", "val/val_loss"} <= set(tags)
    tb_losses = [e.value for e in acc.Scalars("train/loss")]
    assert tb_losses == pytest.approx([r["loss"] for r in rows], rel=1e-6)
    assert (single_process_run / "config.yaml").is_file()


def test_exact_max_steps_with_several_epochs(tmp_path):
    """The reference trained past max_steps with several epochs; here it stops exactly."""
    run_dir = tmp_path / "run"
    r = run_cli("train", *FAST, "--max_steps", "3", "--logging_freq", "1", "--epochs", "3",
                "--train_batch_size", "2", "--tensorboard", "0", "--run_dir", str(run_dir))
    assert r.returncode == 0, r.stderr[-3000:]
    assert [m["step"] for m in read_metrics(run_dir)] == [1, 2, 3]
    assert json.loads(Path(run_dir / "summary.json").read_text())["steps"] == 3


def test_moe_in_bf16_under_fsdp_trains(tmp_path):
    """Mixtral-style MoE, bf16 parameters, 2 ranks: runs and learns (routing differs per rank)."""
    run_dir = tmp_path / "run"
    r = run_cli("train", *FAST, "--max_steps", "8", "--logging_freq", "2", "--train_batch_size", "4",
                "--n_experts", "4", "--experts_per_token", "2", "--mixed_precision", "bf16",
                "--nproc", "2", "--tensorboard", "0", "--run_dir", str(run_dir))
    assert r.returncode == 0, r.stderr[-3000:]
    assert "bfloat16" in r.stdout
    got = losses(run_dir)
    assert len(got) == 4 and got[-1] < got[0]
    # Expert load: rank 0's last micro-batch, every layer's routed slots (256 tokens x top-2).
    n_layers = yaml.safe_load((run_dir / "config.yaml").read_text())["derived"]["model"]["n_layers"]
    for row in read_metrics(run_dir):
        assert len(row["expert_tokens"]) == 4 and sum(row["expert_tokens"]) == 256 * 2 * n_layers
        assert row["expert_load_max_over_mean"] == max(row["expert_tokens"]) / (sum(row["expert_tokens"]) / 4)
    assert "expert load max/mean" in r.stdout


def test_compiled_blocks_match_eager(single_process_run, tmp_path):
    run_dir = tmp_path / "run"
    r = run_cli("train", *FAST, *STEPS, "--train_batch_size", "8", "--compile", "1",
                "--run_dir", str(run_dir), timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "compile True" in r.stdout
    assert losses(run_dir) == pytest.approx(losses(single_process_run), abs=1e-4)


def test_progress_bar_when_asked(tmp_path):
    r = run_cli("train", *FAST, "--max_steps", "4", "--logging_freq", "2", "--train_batch_size", "2",
                "--progress", "on", "--tensorboard", "0", "--run_dir", str(tmp_path / "run"))
    assert r.returncode == 0, r.stderr[-3000:]
    assert "4/4" in r.stderr and "step" in r.stderr  # tqdm's bar reached the end
    assert "Batch 4 Loss:" in r.stdout or "Batch 4 Loss:" in r.stderr


def test_document_masking_trains(tmp_path):
    run_dir = tmp_path / "run"
    r = run_cli("train", *FAST, "--max_steps", "6", "--logging_freq", "2", "--train_batch_size", "4",
                "--document_masking", "1", "--tensorboard", "0", "--run_dir", str(run_dir))
    assert r.returncode == 0, r.stderr[-3000:]
    got = losses(run_dir)
    assert len(got) == 3 and got[-1] < got[0]


def test_config_yaml_reproduces_the_run(tmp_path):
    """config.yaml holds what was given and, apart, every value derived from it (the model's shape,
    the schedule): `--config` with it trains the same run again, loss for loss."""
    import yaml

    a, b = tmp_path / "a", tmp_path / "b"
    r = run_cli("train", *FAST, *STEPS, "--n_layers", "2", "--lr", "0.004", "--train_batch_size", "4",
                "--run_dir", str(a))
    assert r.returncode == 0, r.stderr[-3000:]
    saved = yaml.safe_load((a / "config.yaml").read_text())
    assert saved["run_dir"] == str(a) and saved["model"] == {"n_layers": 2}
    derived = saved["derived"]
    assert derived["model"]["dim"] == 128
    assert saved["data"]["seq_len"] == 64 and saved["log"]["validation_batches"] == 2   # given (FAST)
    assert derived["data"]["val_batch_size"] == 4 and derived["optim"]["min_lr"] == 0.0004
    r = run_cli("train", "--config", str(a / "config.yaml"), "--run_dir", str(b))
    assert r.returncode == 0, r.stderr[-3000:]
    assert losses(b) == losses(a) and len(losses(a)) == 6


def test_a_run_with_a_checkpoint_dir_saves_its_last_step(tmp_path):
    """Without --checkpoint_freq, and when the data runs out before max_steps."""
    from fsdpkit.train.checkpoint.catalog import list_checkpoints

    r = run_cli("train", *FAST, *STEPS, "--train_batch_size", "2", "--run_dir", str(tmp_path / "r1"),
                "--checkpoint_dir", str(tmp_path / "ck1"))
    assert r.returncode == 0, r.stderr[-3000:]
    assert [c.step for c in list_checkpoints(tmp_path / "ck1")] == [6]
    data = write_fixture(tmp_path / "data", "jsonl")
    r = run_cli("train", *FAST, "--dataset", str(data), "--epochs", "1", "--max_steps", "100000", "--logging_freq",
                "1", "--train_batch_size", "16", "--tensorboard", "0", "--run_dir", str(tmp_path / "r2"),
                "--checkpoint_dir", str(tmp_path / "ck2"), "--checkpoint_freq", "1000")
    assert r.returncode == 0, r.stderr[-3000:]
    assert "the data ran out" in r.stdout
    last = read_metrics(tmp_path / "r2")[-1]["step"]
    assert [c.step for c in list_checkpoints(tmp_path / "ck2")] == [last] and 1 < last < 100000


def test_an_mfu_above_100_percent_is_never_printed(tmp_path):
    """A denominator far too low (as a CPU peak measured while the machine is busy would be): the
    line says the figure is impossible instead of printing it, and metrics.jsonl records none."""
    import re

    run_dir = tmp_path / "run"
    r = run_cli("train", *FAST, *STEPS, "--train_batch_size", "2", "--peak_tflops", "0.000001",
                "--run_dir", str(run_dir))
    assert r.returncode == 0, r.stderr[-3000:]
    assert not re.findall(r"MFU: [\d.]+%", r.stdout)
    assert r.stdout.count("MFU: n/a (above the peak: see --peak-tflops)") == 6
    assert all(m["mfu"] is None and m["mfu_above_peak"] for m in read_metrics(run_dir))


def _torchrun_exit_race(mode: str) -> subprocess.CompletedProcess:
    worker = Path(__file__).parent / "exit_race_worker.py"
    return subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(worker), mode],
        capture_output=True, text=True, timeout=120,
    )


def test_a_worker_leaves_cleanly_while_gloo_still_holds_a_collectives_tensor():
    # The abort seen at the end of finished 2-rank runs: gloo's thread waiting for the GIL to
    # release an all-reduce's tensor as Python finalizes. First the hazard, then the way out.
    plain = _torchrun_exit_race("plain")
    if plain.returncode == 0:
        pytest.skip("this torch no longer aborts when gloo's thread meets interpreter finalization")
    assert "SIGABRT" in plain.stderr, plain.stderr[-2000:]
    left = _torchrun_exit_race("leave")
    assert left.returncode == 0, left.stderr[-2000:]
