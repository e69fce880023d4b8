"""Every number plan.grace derives, pinned exactly and worked out by hand in the comments: the grace
period a stopping pod is given, the checkpoint cadence, the start-up HyperPod's deadlines are sized
by, the hang time its log rule waits, and the words `plan` and `--explain` print for each.

Llama 3.1 8B throughout: 8,030,261,248 parameters, 12 bytes each in a checkpoint = 96,363,134,976
bytes, written at 500 MB/s in 192.726269952 s (W below)."""

from __future__ import annotations

import pytest

from fsdpkit.plan.grace import (
    Cadence,
    GracePeriod,
    HangTime,
    StartUp,
    cadence,
    checkpoint_bytes,
    grace_period,
    startup,
    stop_tier,
    write_seconds,
)
from fsdpkit.train.model.config import LoraShape, count_params
from fsdpkit.train.model.presets import PRESETS

M = PRESETS["llama3_1_8b"]
SIZE = 96_363_134_976
W = 192.726269952


def test_a_checkpoint_is_twelve_bytes_a_parameter_and_takes_its_size_over_the_rate():
    assert count_params(M) == 8_030_261_248
    assert checkpoint_bytes(M) == SIZE
    assert write_seconds(M, 500) == pytest.approx(W, rel=1e-15)
    assert write_seconds(M, 2000) == pytest.approx(W / 4, rel=1e-15)


def test_the_grace_period_is_a_minute_two_steps_and_one_and_a_half_writes_in_tens_of_seconds():
    # 60 + 2 x 2.0 + 1.5 x W = 353.09 -> 360; without a step time 349.09 -> 350.
    assert grace_period(M, 500, step_s=2.0) == GracePeriod(360, SIZE, 500, pytest.approx(W), 2.0, "shared storage")
    assert grace_period(M, 500) == GracePeriod(350, SIZE, 500, pytest.approx(W), None, "shared storage")
    # 60 + 2 x 11.0 + 1.5 x W = 371.09 -> 380 (a step of 11 s, not of 1 s, is what is added twice).
    assert grace_period(M, 500, step_s=11.0).seconds == 380
    # 2,000 MB/s: 60 + 1.5 x 48.18 = 132.27 -> 140; the tier is carried as given.
    assert grace_period(M, 2000, tier="node memory").seconds == 140
    assert grace_period(M, 2000, tier="node memory").tier == "node memory"


def test_the_grace_period_says_how_it_was_worked_out():
    assert GracePeriod(360, SIZE, 500, W, 2.0).explain() == (
        "360 s = 60 s + 2 x 2.0 s to finish the step + 1.5 x 193 s to write the 96.4 GB checkpoint at 500 MB/s "
        "to shared storage")
    assert GracePeriod(350, SIZE, 500, W, None).explain() == (
        "350 s = 60 s + 1.5 x 193 s to write the 96.4 GB checkpoint at 500 MB/s to shared storage")
    # 450,000,000 bytes is 0.45 GB to the byte, printed as 0.5 (the next float above 0.45).
    assert "the 0.5 GB checkpoint at 1200 MB/s to node memory" in GracePeriod(
        70, 450_000_000, 1200, 0.375, None, "node memory").explain()
    assert GracePeriod(360, SIZE, 500, W, 2.0).to_dict() == {
        "seconds": 360, "checkpoint_bytes": SIZE, "write_mb_per_s": 500, "write_s": W, "step_s": 2.0,
        "tier": "shared storage", "explanation": GracePeriod(360, SIZE, 500, W, 2.0).explain()}


def test_the_stop_s_checkpoint_goes_to_shared_storage_or_with_tiered_to_every_node_s_memory():
    assert stop_tier(False, 500, 4) == (500, "shared storage")
    assert stop_tier(True, 500, 4) == (4000, "node memory (tiered, 1000 MB/s a node)")
    assert stop_tier(True, 500, 1) == (1000, "node memory (tiered, 1000 MB/s a node)")


def test_the_cadence_keeps_saving_under_five_percent_and_at_least_ten_minutes_apart():
    # W / 5% = 3,854.5 s = 64.2 min -> every 65 min; saving takes W / (3,900 + W) of the run.
    assert cadence(M, 500) == Cadence("65m", 3900, pytest.approx(W), pytest.approx(W / (3900 + W), rel=1e-15))
    assert cadence(M, 500).share == pytest.approx(0.04708994866501549, rel=1e-15)
    # A fast volume: 0.096 s / 5% is 1.9 s, under the ten-minute floor.
    assert cadence(M, 1e6) == Cadence("10m", 600, pytest.approx(W / 2000), pytest.approx(W / 2000 / (600 + W / 2000)))
    # 1,200 MB/s: 80.3 s / 5% = 1,606 s = 26.8 min -> 27 min.
    assert cadence(M, 1200).every == "27m"
    assert cadence(M, 500).explain() == (
        "every 65m: writing it takes 193 s, 4.7% of the run (at most 5%, at least 10 min apart); the last step is "
        "always saved")
    assert cadence(M, 500).to_dict()["explanation"] == cadence(M, 500).explain()


def test_start_up_is_ten_minutes_one_and_a_half_reads_and_the_compile_in_whole_minutes():
    # 600 + 1.5 x W + 300 = 1,189.1 -> 1,200; compiling is the default.
    assert startup(M, 500) == StartUp(1200, pytest.approx(W), 300)
    assert startup(M) == startup(M, 500, compiles=True)
    # 600 + 1.5 x W = 889.1 -> 900 without compiling.
    assert startup(M, 500, compiles=False) == StartUp(900, pytest.approx(W), 0.0)
    # Nothing to read back (no storage) and nothing compiled: the ten minutes alone.
    assert startup(None, compiles=False) == StartUp(600, 0.0, 0.0)
    assert startup(None) == StartUp(900, 0.0, 300)
    # 2,000 MB/s: 600 + 1.5 x 48.18 + 300 = 972.3 -> 1,020.
    assert startup(M, 2000).seconds == 1020
    assert startup(None).to_dict() == {"seconds": 900, "read_s": 0.0, "compile_s": 300, "base_s": 0.0,
                                       "explanation": "900 s = 600 s to schedule, pull the image and rendezvous "
                                                      "+ 300 s to compile"}


# LoRA rank 16 on all seven projections of Llama 3.1 8B: r x (in + out) each, per layer
# 16 x (8,192 + 5,120 + 5,120 + 8,192 + 3 x 18,432) = 1,310,720; x 32 layers = 41,943,040 parameters.
LORA = LoraShape(16, 32.0, 0.0, ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"))
LORA_SIZE = 12 * 41_943_040
BASE_S = 2 * 8_030_261_248 / 500e6   # the bf16 base weights, 32.12 s at 500 MB/s


def test_a_lora_run_s_checkpoint_holds_its_adapters_and_each_start_reads_the_base():
    assert checkpoint_bytes(M, LORA) == LORA_SIZE == 503_316_480
    assert write_seconds(M, 500, LORA) == pytest.approx(1.00663296, rel=1e-15)
    # 60 + 2 x 2.0 + 1.5 x 1.007 = 65.5 -> 70 (the whole model's would be 360).
    assert grace_period(M, 500, 2.0, lora=LORA).seconds == 70
    assert grace_period(M, 500, 2.0, lora=LORA).checkpoint_bytes == LORA_SIZE
    assert cadence(M, 500, LORA).seconds == 600   # the ten-minute floor
    # 600 + 1.5 x (32.12 + 1.007) + 300 = 949.7 -> 960.
    start = startup(M, 500, lora=LORA, base=M)
    assert (start.seconds, start.base_s) == (960, pytest.approx(BASE_S, rel=1e-15))
    assert start.explain() == ("960 s = 600 s to schedule, pull the image and rendezvous + 1.5 x 32 s to read the base "
                               "weights + 1.5 x 1 s to read the checkpoint back + 300 s to compile")
    # Without storage to resume from, the base is still read: 600 + 1.5 x 32.12 = 648.2 -> 660.
    assert startup(None, 500, compiles=False, base=M).seconds == 660


def test_start_up_says_how_it_was_worked_out():
    assert StartUp(1200, W, 300).explain() == (
        "1200 s = 600 s to schedule, pull the image and rendezvous + 1.5 x 193 s to read the checkpoint back "
        "+ 300 s to compile")
    assert StartUp(600, 0.0, 0.0).explain() == "600 s = 600 s to schedule, pull the image and rendezvous"
    assert StartUp(900, W, 0.0).explain() == (
        "900 s = 600 s to schedule, pull the image and rendezvous + 1.5 x 193 s to read the checkpoint back")
    assert StartUp(900, 0.0, 300).explain() == (
        "900 s = 600 s to schedule, pull the image and rendezvous + 300 s to compile")


def test_the_hang_time_outlasts_five_logging_windows_a_write_and_a_minute():
    # 5 x 100 x 2.0 + 1.5 x W + 60 = 1,349.09 -> 1,380.
    planned = HangTime(2.0, 100, W, True)
    assert planned.seconds == 1380
    assert planned.explain() == (
        "5 logging windows of 100 steps at 2.0 s + 1.5 x 193 s to write a checkpoint + 60 s = 1349 s, in whole "
        "minutes, at least 600 s")
    # 5 x 10 x 2.0 + 1.5 x W + 60 = 449.09 -> 480, under the 600 s floor.
    assert HangTime(2.0, 10, W, True).seconds == 600
    # 5 x 200 x 3.0 + 60 = 3,060 s: exactly 51 minutes, not rounded up.
    assert HangTime(3.0, 200, 0.0, True).seconds == 3060
    # No step time planned: the windows count nothing, 349.09 s -> the floor.
    assert HangTime(None, 100, W, True).seconds == 600
    assert " at 0.0 s + " in HangTime(None, 100, W, True).explain()
    # Not a GPU the planner models: half an hour, said so.
    other = HangTime(None, 100, W, False)
    assert other.seconds == 1800
    assert other.explain() == "1800 s: no step time to plan from (no NVIDIA instance type)"
