"""Expert parallel (fsdpkit.train.model.expert_parallel): every MoE layer's experts split over N CPU
ranks under gloo, tokens sent to their experts' rank and back by all-to-all.

What it must show (issue 51, point 2): Mixtral and Qwen3-MoE shapes on 2 and 4 ranks match EP=1
step by step (loss, gradient norm, tokens per expert); a checkpoint written at EP=2 resumes at EP=1
and at EP=4 (4 ranks: one expert a rank), and at EP=2 over 4 ranks (two copies of each expert,
their gradients added up), each continuing as EP=1 does from the same checkpoint."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from conftest import read_metrics, run_cli
from launch_cases import launch

pytestmark = pytest.mark.slow

SHAPES = {
    "mixtral": ["--family", "mixtral", "--n-experts", "4", "--experts-per-token", "2"],
    "qwen3_moe": ["--family", "qwen3_moe", "--n-experts", "8", "--experts-per-token", "2"],
}


def flags(shape: str, run_dir: Path, *extra: str) -> list[str]:
    return ["--preset", "debug", *SHAPES[shape], "--seq-len", "128", "--train-batch-size", "4", "--max-steps", "6",
            "--logging-freq", "1", "--validation-freq", "0", "--progress", "off", "--tensorboard", "0",
            "--run-dir", str(run_dir), *extra]


def train(args: list[str]) -> str:
    """A run on 2 ranks, through `fsdpkit train --nproc 2`."""
    r = run_cli("train", "--nproc", "2", *args)
    assert r.returncode == 0, r.stderr[-3000:]
    return r.stdout


def steps(run_dir: Path) -> list[tuple[float, float, list[int]]]:
    """Each step's loss, gradient norm and rank 0's tokens per expert."""
    return [(r["loss"], r["grad_norm"], r["expert_tokens"]) for r in read_metrics(run_dir)]


def assert_same_steps(got: list, want: list) -> None:
    assert len(got) == len(want) and got
    for (loss, norm, load), (loss0, norm0, load0) in zip(got, want, strict=True):
        # fp32, the expert products' sums in another order: equal to 1e-5; the routing the same.
        assert (loss, norm) == pytest.approx((loss0, norm0), rel=1e-5) and load == load0


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """A shape's two runs on 2 ranks, at EP=1 and at EP=2 (checkpointing every 3 steps), made once
    per shape: (their folder, what the EP=2 run printed). The EP=2 run's step-3 checkpoint is also
    the one the four-rank test resumes."""
    made: dict[str, tuple[Path, str]] = {}

    def runs(shape: str) -> tuple[Path, str]:
        if shape not in made:
            root = tmp_path_factory.mktemp(shape)
            train(flags(shape, root / "ep1"))
            made[shape] = root, train(flags(shape, root / "ep2", "--expert-parallel", "2", "--checkpoint-dir",
                                               str(root / "ck"), "--checkpoint-every", "3"))
        return made[shape]
    return runs


@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_two_ranks_at_ep2_train_as_ep1_does_and_its_checkpoint_resumes_at_ep1(shape, pair, tmp_path):
    root, out = pair(shape)
    experts = int(SHAPES[shape][3])
    assert (f"fsdpkit: expert parallel 2: each rank holds {experts // 2} of the {experts} experts of every layer, "
            "tokens travel to theirs by all-to-all; 1 copy(ies) of each expert") in out
    reference = steps(root / "ep1")
    assert_same_steps(steps(root / "ep2"), reference)
    if shape != "mixtral":
        return   # resuming reads the same DTensors for every family: Mixtral shows it
    (tmp_path / "half").mkdir()
    shutil.copytree(root / "ck" / "step-00000003", tmp_path / "half" / "step-00000003")
    train(flags(shape, tmp_path / "rest", "--checkpoint-dir", str(tmp_path / "half"), "--resume", "auto"))
    assert_same_steps(steps(tmp_path / "rest"), reference[3:])


def test_an_ep2_checkpoint_resumes_on_four_ranks_at_ep4_and_at_ep2_as_at_ep1(pair, tmp_path):
    """The three resumes in one launch of four ranks (tests/launch_cases.py), each from its own copy
    of the step-3 checkpoint."""
    root, _ = pair("mixtral")
    cases = []
    for degree in (1, 2, 4):
        ck = tmp_path / f"ck-{degree}"
        shutil.copytree(root / "ck" / "step-00000003", ck / "step-00000003")
        cases.append({"id": f"ep{degree}", "flags": flags("mixtral", tmp_path / f"at{degree}", "--expert-parallel",
                                                          str(degree), "--checkpoint-dir", str(ck), "--resume",
                                                          "auto", "--max-steps", "5")})
    launch("launch_cases", cases, tmp_path, 4)
    runs = {degree: steps(tmp_path / f"at{degree}") for degree in (1, 2, 4)}
    assert len(runs[1]) == 2
    assert_same_steps(runs[4], runs[1])
    assert_same_steps(runs[2], runs[1])
