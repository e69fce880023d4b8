"""Context parallel (fsdpkit.train.model.context): every sequence split over N CPU ranks under gloo,
attention whole after an all-to-all over heads.

What it must show (issue 51, point 1): at 8192 tokens, with packed documents masked and with a
sliding window, a step on 2 and 4 ranks has one rank's loss and gradients; the activations a rank
keeps for backward fall to about 1/N; through `fsdpkit train` the losses are one process's step by
step, and a checkpoint resumes at another degree where the data stood."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import ROOT, read_metrics, run_cli

pytestmark = pytest.mark.slow

WORKER = ROOT / "tests" / "train" / "model" / "context_worker.py"
# 4 query heads over 2 K/V heads: 2 ranks share out the K/V heads, 4 ranks expand them first.
SHAPE = ["--preset", "debug", "--dim", "128", "--n-heads", "4", "--n-kv-heads", "2", "--n-layers", "2",
         "--vocab-size", "512", "--seq-len", "8192"]
MASKS = {"documents": ["--document-masking", "1"],
         "documents+window": ["--document-masking", "1", "--sliding-window", "1024"], "causal": []}


# The launches (ranks, context-parallel groups) and the masks each steps in turn: the steps of the
# tests below, and their one-rank references, in four launches rather than eight.
LAUNCHES = {(1, 1): ("documents", "documents+window", "causal"), (2, 1): ("documents", "causal"),
            (4, 2): ("documents",), (4, 1): ("documents+window", "causal")}


@pytest.fixture(scope="module")
def step_on(tmp_path_factory):
    """step_on(ranks, groups, mask): context_worker.py's step over the same 2 sequences on `ranks`
    ranks in `groups` context-parallel groups (each group its share of the sequences): the loss and
    gradients, and each rank's activations. Each launch of LAUNCHES runs once, when first asked for."""
    done: dict[tuple[int, int], Path] = {}

    def get(ranks: int, groups: int, mask: str) -> tuple[dict, list[int]]:
        if (ranks, groups) not in done:
            out = tmp_path_factory.mktemp(f"cp-{ranks}-{groups}")
            (out / "masks.json").write_text(json.dumps({m: MASKS[m] for m in LAUNCHES[ranks, groups]}))
            args = [str(WORKER), str(out), "2", str(out / "masks.json"), *SHAPE, "--context-parallel",
                    str(ranks // groups)]
            cmd = [sys.executable, *(["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}"]
                                     if ranks > 1 else []), *args]
            r = subprocess.run(cmd, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True,
                               cwd=ROOT, timeout=600)
            assert r.returncode == 0, r.stderr[-3000:]
            done[ranks, groups] = out
        out = done[ranks, groups] / mask
        kept = [json.loads((out / f"activations-rank{i}.json").read_text()) for i in range(ranks)]
        return torch.load(out / "step.pt"), kept
    return get


def assert_same_step(step: dict, reference: dict) -> None:
    # fp32 throughout, the sums only in another order: the loss equal to 1e-6, each gradient within
    # 1e-5 of its largest element (measured: 4e-7).
    torch.testing.assert_close(step["loss"], reference["loss"], rtol=1e-6, atol=0)
    assert step["grads"].keys() == reference["grads"].keys()
    for name, grad in reference["grads"].items():
        torch.testing.assert_close(step["grads"][name], grad, rtol=0, atol=1e-5 * grad.abs().max().item(), msg=name)


@pytest.mark.parametrize(("ranks", "groups", "mask"), [(2, 1, "documents"), (4, 2, "documents"),
                                                       (4, 1, "documents+window")],
                         ids=["cp2-documents", "dp2-cp2-documents", "cp4-documents-window"])
def test_a_step_over_n_ranks_has_one_rank_s_loss_and_gradients(step_on, ranks, groups, mask):
    """2 query heads a rank over 1 K/V head at 2 ranks; at 4, K/V expanded to the query heads first.
    Two groups of two: each its own sequence, FSDP's gradient mean over all four ranks."""
    step, _ = step_on(ranks, groups, mask)
    assert_same_step(step, step_on(1, 1, mask)[0])


def test_activations_per_rank_fall_to_one_nth(step_on):
    """Plain causal attention, as on a GPU, where masks are FlexAttention's block masks (the CPU's
    dense T x T mask is whole on every rank: its stand-in, not part of the split)."""
    _, [whole] = step_on(1, 1, "causal")
    for ranks in (2, 4):
        _, kept = step_on(ranks, 1, "causal")
        for per_rank in kept:
            assert whole / ranks <= per_rank <= 1.1 * whole / ranks, (ranks, per_rank / whole)


def train(tmp_path: Path, name: str, *flags: str) -> subprocess.CompletedProcess:
    r = run_cli("train", "--preset", "debug", "--seq-len", "256", "--document-masking", "1", "--train-batch-size", "4",
                "--max-steps", "6", "--logging-freq", "1", "--validation-freq", "0", "--progress", "off",
                "--tensorboard", "0", "--run-dir", str(tmp_path / name), *flags)
    assert r.returncode == 0, r.stderr[-3000:]
    return r


def rows(run_dir: Path) -> list[tuple[float, float]]:
    return [(r["loss"], r["grad_norm"]) for r in read_metrics(run_dir)]


def test_fsdpkit_train_over_a_compiled_pair_is_one_process_step_by_step_and_resumes_on_one(tmp_path):
    one = train(tmp_path, "one")
    # Compiled, as on a GPU by default: the all-to-alls are functional collectives inside the
    # blocks' graphs (a graph break or a frame dynamo gave up on would say so through its logger).
    pair = train(tmp_path, "pair", "--nproc", "2", "--context-parallel", "2", "--checkpoint-dir", str(tmp_path / "ck"),
                 "--checkpoint-every", "3", "--compile", "1")
    assert "torch/_dynamo" not in pair.stderr and "Traceback" not in pair.stderr, pair.stderr[-3000:]
    assert ("fsdpkit: context parallel 2: each rank holds 128 tokens of every sequence and attends with 4 of 8 "
            "heads; 1 data-parallel share(s) of the batch") in pair.stdout
    assert "global batch 4," in pair.stdout and "global batch 4," in one.stdout
    expected = rows(tmp_path / "one")
    assert len(expected) == 6
    for got, want in zip(rows(tmp_path / "pair"), expected, strict=True):
        assert got == pytest.approx(want, rel=1e-5)
    # The pair read one share of the data: 3 steps of 4 sequences, whatever its ranks.
    meta = json.loads((tmp_path / "ck" / "step-00000003" / "fsdpkit.json").read_text())
    assert (meta["samples"], meta["data_ranks"], meta["world_size"]) == (12, 1, 2)
    (tmp_path / "ck-half").mkdir()
    os.rename(tmp_path / "ck" / "step-00000003", tmp_path / "ck-half" / "step-00000003")
    rest = train(tmp_path, "rest", "--checkpoint-dir", str(tmp_path / "ck-half"), "--resume", "auto")
    assert "resumed from" in rest.stdout
    for got, want in zip(rows(tmp_path / "rest"), expected[3:], strict=True):
        assert got == pytest.approx(want, rel=1e-5)
