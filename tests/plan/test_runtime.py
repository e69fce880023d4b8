"""A run's planned time, pinned exactly: its steps, the validation passes among them and the
checkpoint saves at the job's own interval, each save as the trainer makes it (every N steps or T
of wall time, the last step always; with tiered checkpointing most to node memory).

Llama 3.1 8B: a checkpoint is 96,363,134,976 bytes, W = 192.726269952 s at 500 MB/s. Its default
validation, 8 batches every 500 steps and at the end, is 0.53% of 1,000 steps' FLOPs (two passes)."""

from __future__ import annotations

import pytest

from fsdpkit.plan.runtime import RunTime, run_time
from fsdpkit.train.config import TrainConfig, build

SIZE = 96_363_134_976
W = 192.726269952


def config(**fields: object) -> TrainConfig:
    return build([{"preset": "llama3_1_8b", "max_steps": 1000, **fields}])


def test_saves_every_n_steps_are_the_periodic_ones_and_the_last():
    cfg = config(checkpoint_dir="/ck", checkpoint_every="100")
    # 999 // 100 = 9 periodic saves (steps 100..900; step 1,000's is the last step's) + the last.
    run = run_time(cfg, 1000, 1_048_576, 2.0, 500)
    assert run == RunTime(1000, 1_048_576_000, 2000.0, pytest.approx(2000 * 2 * 8 / 3000, rel=1e-15), 10,
                          pytest.approx(10 * W, rel=1e-15))
    # Step 1,001: step 1,000 saves periodically (1,000 // 100 = 10), then the last; validation runs
    # at 500, 1,000 and the end.
    run = run_time(cfg, 1001, 1_048_576, 2.0, 500)
    assert (run.saves, run.tokens, run.validation_s) == (11, 1_049_624_576, pytest.approx(16.0, rel=1e-15))
    assert run.checkpoint_s == pytest.approx(11 * W, rel=1e-15)


def test_saves_by_wall_time_count_validation_as_time_too():
    cfg = config(checkpoint_dir="/ck", checkpoint_every="10m")
    # 1,000 steps of 0.6 s = 600 s of training + 3.2 s of validation: past 600 s once (without the
    # validation it would not be).
    run = run_time(cfg, 1000, 1, 0.6, 500)
    assert (run.train_s, run.validation_s, run.saves) == (600.0, pytest.approx(3.2, rel=1e-15), 2)
    assert run.checkpoint_s == pytest.approx(2 * W, rel=1e-15)


def test_without_an_interval_only_the_last_step_saves_and_without_storage_nothing():
    assert run_time(config(checkpoint_dir="/ck"), 1000, 1, 2.0, 500) == RunTime(
        1000, 1000, 2000.0, pytest.approx(32 / 3, rel=1e-15), 1, pytest.approx(W, rel=1e-15))
    nothing = RunTime(1000, 4_096_000, 2000.0, pytest.approx(32 / 3, rel=1e-15), 0, 0.0)
    assert run_time(config(), 1000, 4096, 2.0, 500) == nothing              # no checkpoint directory
    assert run_time(config(checkpoint_dir="/ck"), 1000, 4096, 2.0, None) == nothing   # no write rate (no storage)


def test_tiered_saves_go_to_node_memory_and_every_durable_every_th_to_storage():
    cfg = config(checkpoint_dir="/ck", checkpoint_every="100", tiered=True)
    assert cfg.checkpoint.durable_every == 4
    # 9 periodic saves: 9 // 4 = 2 durable (W each), 7 to memory at 1,000 MB/s a node; the last is durable.
    memory_2 = SIZE / 2000e6   # 48.181567488 s on two nodes
    two = run_time(cfg, 1000, 1, 2.0, 500, nodes=2)
    assert (two.saves, two.checkpoint_s) == (10, pytest.approx(3 * W + 7 * memory_2, rel=1e-15))
    one = run_time(cfg, 1000, 1, 2.0, 500)   # one node by default
    assert one.checkpoint_s == pytest.approx(3 * W + 7 * SIZE / 1000e6, rel=1e-15)


def test_the_run_time_adds_up_and_says_so_in_hours():
    run = RunTime(1000, 1_048_576_000, 2000.0, 10.0, 10, 1927.0)
    assert run.total_s == 3937.0
    assert run.to_dict() == {
        "steps": 1000, "tokens": 1_048_576_000, "train_s": 2000.0, "validation_s": 10.0, "saves": 10,
        "checkpoint_s": 1927.0, "total_s": 3937.0, "hours": 3937.0 / 3600,
        "explanation": "1,000 steps (1,048,576,000 tokens): training 0.56 h + validation 0.00 h + 10 checkpoint "
                       "save(s) 0.54 h = 1.09 h"}
    # 18 s is 0.005 h, printed as 0.01 (the float just above 0.005).
    assert RunTime(1, 1, 18.0, 0.0, 1, 0.0).explain() == (
        "1 steps (1 tokens): training 0.01 h + validation 0.00 h + 1 checkpoint save(s) 0.00 h = 0.01 h")
