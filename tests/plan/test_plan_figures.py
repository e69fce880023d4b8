"""Every figure the planner derives, pinned to the byte and the digit for a matrix of jobs: the
memory estimate's terms and its peak, each FSDP collective's bytes, and the plan (fit, compute and
communication time, tokens/s, the changes it offers and its verdict) on the GPUs it models.

tests/plan/test_plan.py holds these figures to real runs (the tensor peak of CPU runs and of runs
on an H100 and an H200, the bytes of every collective of a real step) within measured bands; this
file holds them exactly, so that a change to any term shows as a changed figure here, named by job
and field, and is either a bug or a deliberate change of the model, recorded by running

    FSDPKIT_UPDATE_FIGURES=1 python -m pytest -p no:xdist tests/plan/test_plan_figures.py

and committing tests/plan/figures.json with the change that moved them."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest
from pinned import holds_recorded

from fsdpkit.hardware.instances import lookup
from fsdpkit.plan.comm import step_comm
from fsdpkit.plan.memory import estimate
from fsdpkit.plan.planner import Plan, _changes, advice, plan, plan_config
from fsdpkit.plan.workload import workload
from fsdpkit.train.config import parse_args
from fsdpkit.train.model.config import LoraShape
from fsdpkit.train.model.flops import flops_per_token
from fsdpkit.train.sections import LORA_TARGETS

FIGURES = Path(__file__).with_name("figures.json")

DEBUG = ["--preset", "debug", "--seq_len", "256", "--train_batch_size", "4"]
SMALL_8B = ["--preset", "llama3_1_8b", "--n_layers", "4", "--seq_len", "1024", "--train_batch_size", "2"]
DPO = ["--objective", "dpo", "--data-format", "preference"]

# (flags, ranks, device, nodes[, LoRA]): each a job the trainer runs, as `workload` reads its config
# (LoRA given as its shape: the trainer's config takes it only with a Hugging Face base to adapt).
WORKLOADS: dict[str, tuple[Any, ...]] = {
    "debug-1-cpu": (DEBUG, 1, "cpu", 1),
    "debug-1-cpu-bf16-ac-full": ([*DEBUG, "--mixed_precision", "bf16", "--activation_checkpointing", "full"], 1,
                                 "cpu", 1),
    "qwen2-1-cpu-tied-bf16": (["--preset", "qwen2_5_0_5b", "--n_layers", "1", "--seq_len", "128",
                               "--train_batch_size", "1", "--mixed_precision", "bf16"], 1, "cpu", 1),
    "debug-2-cpu": (DEBUG, 2, "cpu", 1),
    "debug-2-cpu-accum-noreshard": ([*DEBUG, "--grad_accum_steps", "3", "--reshard_after_forward", "false"], 2,
                                    "cpu", 1),
    "debug-2-cpu-prefetch2-bf16-reduce-fp32": ([*DEBUG, "--fsdp_prefetch", "2", "--mixed_precision", "bf16",
                                                "--reduce_dtype", "fp32"], 2, "cpu", 1),
    "debug-2-cpu-selective-ac3": ([*DEBUG, "--activation_checkpointing", "selective", "--ac_every", "3"], 2,
                                  "cpu", 1),
    "debug-2-cpu-offload": ([*DEBUG, "--cpu_offload", "true"], 2, "cpu", 1),
    "debug-2-cpu-val16": ([*DEBUG, "--train_batch_size", "1", "--val_batch_size", "16"], 2, "cpu", 1),
    "debug-2-cpu-chunked": ([*DEBUG, "--loss_chunk_tokens", "300"], 2, "cpu", 1),
    "debug-1-cpu-vocab8192-chunked": ([*DEBUG, "--vocab_size", "8192", "--loss_chunk_tokens", "300"], 1, "cpu", 1),
    "debug-1-cpu-vocab8192-unchunked": ([*DEBUG, "--vocab_size", "8192", "--loss_chunk_tokens", "0"], 1, "cpu", 1),
    "debug-1-cpu-vocab8192-bf16-chunked": ([*DEBUG, "--vocab_size", "8192", "--loss_chunk_tokens", "300",
                                            "--mixed_precision", "bf16"], 1, "cpu", 1),
    "debug-2-cpu-bf16-chunked": ([*DEBUG, "--loss_chunk_tokens", "300", "--mixed_precision", "bf16"], 2, "cpu", 1),
    # A chunk exactly a micro-batch's tokens (256 x 4): one chunk, the loss unchunked.
    "debug-1-cpu-chunk-1024": ([*DEBUG, "--loss_chunk_tokens", "1024"], 1, "cpu", 1),
    "debug-1-cuda-chunk-1024": ([*DEBUG, "--loss_chunk_tokens", "1024"], 1, "cuda", 1),
    "debug-1-cpu-lora-chunk-1024": ([*DEBUG, "--loss_chunk_tokens", "1024"], 1, "cpu", 1,
                                    LoraShape(8, 16.0, 0.0, ("q_proj",))),
    "debug-2-cpu-accum2": ([*DEBUG, "--grad_accum_steps", "2"], 2, "cpu", 1),
    "debug-1-cpu-vocab301": ([*DEBUG, "--vocab_size", "301"], 1, "cpu", 1),
    "debug-3-cpu-vocab301": ([*DEBUG, "--vocab_size", "301", "--n_kv_heads", "2"], 3, "cpu", 1),
    "debug-4-cpu-hybrid-2nodes": ([*DEBUG, "--sharding_strategy", "hybrid"], 4, "cpu", 2),
    "debug-1-cuda": (DEBUG, 1, "cuda", 1),
    "debug-1-cuda-chunked": ([*DEBUG, "--loss_chunk_tokens", "300"], 1, "cuda", 1),
    "debug-2-cuda-unchunked": ([*DEBUG, "--loss_chunk_tokens", "0"], 2, "cuda", 1),
    "debug-2-cuda-eager": ([*DEBUG, "--compile", "0"], 2, "cuda", 1),
    "debug-1-cpu-lora-qv": (DEBUG, 1, "cpu", 1, LoraShape(8, 16.0, 0.0, ("q_proj", "v_proj"))),
    "debug-2-cpu-lora-all": (DEBUG, 2, "cpu", 1, LoraShape(8, 16.0, 0.0, LORA_TARGETS)),
    "debug-2-cpu-lora-o-down-dropout": (DEBUG, 2, "cpu", 1, LoraShape(4, 16.0, 0.1, ("o_proj", "down_proj"))),
    "debug-2-cpu-lora-gate-up": (DEBUG, 2, "cpu", 1, LoraShape(8, 16.0, 0.0, ("gate_proj", "up_proj"))),
    "debug-2-cuda-lora-all-dropout": ([*DEBUG, "--compile", "0"], 2, "cuda", 1,
                                      LoraShape(8, 16.0, 0.1, LORA_TARGETS)),
    "debug-1-cpu-lora-unchunked": ([*DEBUG, "--loss_chunk_tokens", "0"], 1, "cpu", 1,
                                   LoraShape(8, 16.0, 0.0, ("q_proj",))),
    "debug-2-cpu-lora-k-gate": (DEBUG, 2, "cpu", 1, LoraShape(8, 16.0, 0.0, ("k_proj", "gate_proj"))),
    "debug-2-cpu-lora-v-up": (DEBUG, 2, "cpu", 1, LoraShape(8, 16.0, 0.0, ("v_proj", "up_proj"))),
    "debug-1-cuda-lora": (DEBUG, 1, "cuda", 1, LoraShape(8, 16.0, 0.0, ("q_proj", "v_proj"))),
    "qwen2-2-cuda": (["--preset", "qwen2_5_0_5b", "--n_layers", "2", "--seq_len", "512", "--train_batch_size", "2"],
                     2, "cuda", 1),
    "qwen3-2-cpu": (["--preset", "qwen3_0_6b", "--n_layers", "2", "--seq_len", "256", "--train_batch_size", "2"],
                    2, "cpu", 1),
    "mixtral-2-cuda": (["--preset", "mixtral_8x7b", "--n_layers", "2", "--seq_len", "512", "--train_batch_size", "1"],
                       2, "cuda", 1),
    "mixtral-1-cpu": (["--preset", "mixtral_8x7b", "--n_layers", "1", "--seq_len", "128", "--train_batch_size", "1"],
                      1, "cpu", 1),
    "8b-16-cuda-hybrid-2nodes": ([*SMALL_8B, "--sharding_strategy", "hybrid"], 16, "cuda", 2),
    "debug-2-cpu-dpo": ([*DEBUG, *DPO], 2, "cpu", 1),
    # Context parallel: 4 ranks a sequence, K/V (4 heads) shared out; 2 groups over 8 ranks, recomputed.
    "debug-8-cuda-cp4-ac": ([*DEBUG, "--context_parallel", "4", "--activation_checkpointing", "full"], 8, "cuda", 1),
    # Expert parallel: 2 copies of each half of the experts over 4 ranks; and 2 ranks, all of them once.
    "mixtral-4-cuda-ep2": (["--preset", "mixtral_8x7b", "--n_layers", "2", "--seq_len", "512",
                            "--train_batch_size", "1", "--expert_parallel", "2"], 4, "cuda", 1),
    "mixtral-2-cpu-ep2-accum": (["--preset", "mixtral_8x7b", "--n_layers", "1", "--seq_len", "128",
                                 "--train_batch_size", "1", "--expert_parallel", "2", "--grad_accum_steps", "2"], 2,
                                "cpu", 1),
    "debug-2-cuda-lora-dpo": ([*DEBUG, *DPO, "--compile", "0"], 2, "cuda", 1, LoraShape(8, 16.0, 0.0, LORA_TARGETS)),
}

# (flags, instance type or None, nodes, mfu, ranks per node): plans as `fsdpkit plan` makes them.
PLANS: dict[str, tuple[list[str], str | None, int, float, int | None]] = {
    "70b-p5-1-node": (["--preset", "llama3_1_70b", "--seq_len", "4096", "--train_batch_size", "2"], "p5.48xlarge", 1,
                      0.4, None),
    "70b-p5-8-nodes-ac": (["--preset", "llama3_1_70b", "--seq_len", "4096", "--train_batch_size", "1",
                           "--activation_checkpointing", "full"], "p5.48xlarge", 8, 0.4, None),
    "8b-p5-4-nodes": (["--preset", "llama3_1_8b", "--seq_len", "8192", "--train_batch_size", "1"], "p5.48xlarge", 4,
                      0.45, None),
    "8b-p5-4-nodes-selective": (["--preset", "llama3_1_8b", "--seq_len", "2048", "--train_batch_size", "1",
                                 "--activation_checkpointing", "selective", "--ac_every", "2"], "p5.48xlarge", 4,
                                0.5, None),
    "1b-p4d-2-nodes-fp32": (["--preset", "llama3_2_1b", "--seq_len", "2048", "--train_batch_size", "1",
                             "--mixed_precision", "fp32"], "p4d.24xlarge", 2, 0.3, None),
    "8b-g5-12xlarge": (["--preset", "llama3_1_8b", "--seq_len", "2048", "--train_batch_size", "4"], "g5.12xlarge", 1,
                       0.4, None),
    "8b-g5-12xlarge-offload": (["--preset", "llama3_1_8b", "--seq_len", "2048", "--train_batch_size", "1",
                                "--activation_checkpointing", "full", "--cpu_offload", "true"], "g5.12xlarge", 1,
                               0.4, None),
    "70b-g5-12xlarge-offload": (["--preset", "llama3_1_70b", "--seq_len", "1024", "--train_batch_size", "1",
                                 "--activation_checkpointing", "full", "--cpu_offload", "true"], "g5.12xlarge", 1,
                                0.4, None),
    "70b-g5-xlarge": (["--preset", "llama3_1_70b", "--seq_len", "1024", "--train_batch_size", "1"], "g5.xlarge", 1,
                      0.4, None),
    "1b-p5-4-ranks": (["--preset", "llama3_2_1b", "--seq_len", "4096", "--train_batch_size", "2"], "p5.48xlarge", 1,
                      0.4, 4),
    "debug-no-instance": (DEBUG, None, 1, 0.4, None),
    # A sequence that fits only split over ranks; a mixture of experts that waits on gathering them.
    "8b-p5-131072": (["--preset", "llama3_1_8b", "--seq_len", "131072", "--train_batch_size", "1"], "p5.48xlarge", 1,
                     0.4, None),
    "qwen3-moe-p5-2-nodes": (["--preset", "qwen3_30b_a3b"], "p5.48xlarge", 2, 0.4, None),
    "qwen3-moe-p5-2-nodes-ep16": (["--preset", "qwen3_30b_a3b", "--expert_parallel", "16"], "p5.48xlarge", 2, 0.4,
                                  None),
    # More changes fit than the three best shown.
    "1b-p4d-batch16": (["--preset", "llama3_2_1b", "--seq_len", "4096", "--train_batch_size", "16",
                        "--activation_checkpointing", "none"], "p4d.24xlarge", 1, 0.4, None),
    "8b-p5-2-nodes-hybrid": (["--preset", "llama3_1_8b", "--seq_len", "4096", "--train_batch_size", "2",
                              "--sharding_strategy", "hybrid"], "p5.48xlarge", 2, 0.4, None),
    "8b-p5-1-node-dpo": (["--preset", "llama3_1_8b", "--seq_len", "4096", "--train_batch_size", "1", *DPO],
                         "p5.48xlarge", 1, 0.4, None),
}


def workload_figures(flags: list[str], ranks: int, device: str, nodes: int, lora: LoraShape | None = None
                     ) -> dict[str, Any]:
    w = dataclasses.replace(workload(parse_args(flags), ranks, device, nodes), lora=lora)
    return {"memory": estimate(w).to_dict(), "comm": step_comm(w).to_dict()}


def plan_figures(flags: list[str], instance: str | None, nodes: int, mfu: float,
                 per_node: int | None) -> dict[str, Any]:
    p = plan_config(parse_args(flags), instance, nodes, mfu, per_node)
    return summarised(p)


def summarised(p: Plan) -> dict[str, Any]:
    return {"plan": p.summary(price=98.3257), "alternatives": [a.summary() for a in p.alternatives],
            "advice": advice(p)}


def _changes_tried(flags: list[str], ranks: int, nodes: int) -> list[list[Any]]:
    w = workload(parse_args(flags), ranks, "cuda", nodes)
    return [[c, n, cw.micro_batch, cw.ac, cw.world, cw.shard, cw.cpu_offload]
            for c, cw, n in _changes(w, nodes, ranks // nodes)]


def _lora_plan() -> dict[str, Any]:
    """LoRA on 8 x A100 80GB: the frozen base's plan (the planner's own entry, given the shape)."""
    cfg = parse_args(["--preset", "llama3_1_8b", "--seq_len", "4096", "--train_batch_size", "2"])
    w = dataclasses.replace(workload(cfg, 8, "cuda"), lora=LoraShape(16, 32.0, 0.05, LORA_TARGETS))
    return summarised(plan(w, lookup("p4de.24xlarge"), 1, 0.4, flops_per_token(cfg.shape, 4096)))


# Each figure by key, worked out when its test runs (so a mutation tool sees which test reaches what).
FIGURE = {
    **{f"workload {k}": (lambda v=v: workload_figures(*v)) for k, v in WORKLOADS.items()},
    **{f"plan {k}": (lambda v=v: plan_figures(*v)) for k, v in PLANS.items()},
    "plan 8b-lora-p4de": _lora_plan,
    # The changes tried, in order, for a plan that does not fit (each with its node count).
    "changes 70b-p5-1-node": lambda: _changes_tried(PLANS["70b-p5-1-node"][0], 8, 1),
    "changes 8b-hybrid-2-nodes-ac": lambda: _changes_tried(
        [*SMALL_8B, "--sharding_strategy", "hybrid", "--activation_checkpointing", "full"], 16, 2),
}


@pytest.mark.parametrize("key", list(FIGURE))
def test_every_planned_figure_is_the_one_recorded(key):
    holds_recorded(FIGURES, key, FIGURE[key](), "FSDPKIT_UPDATE_FIGURES")


def test_the_matrix_takes_every_branch_the_planner_has():
    """The jobs above are chosen to reach each way a figure comes about; this names the ones a
    reader would otherwise have to check by hand."""
    recorded = json.loads(FIGURES.read_text())
    plans = {k.removeprefix("plan "): v for k, v in recorded.items() if k.startswith("plan ")}
    assert plans["70b-p5-1-node"]["plan"]["fits"] is False and plans["70b-p5-1-node"]["alternatives"]
    assert plans["70b-p5-8-nodes-ac"]["plan"]["fits"] is True
    assert {p["plan"]["bound"] for p in plans.values()} == {"compute", "network", "all-to-all", None}
    assert any(p["plan"]["fits"] and p["alternatives"] for p in plans.values())   # network-bound: faster options
    assert plans["70b-g5-12xlarge-offload"]["plan"]["host_fits"] is False
    assert plans["debug-no-instance"]["advice"].startswith("needs ")
    assert any(a.startswith("does not fit") and "no change fsdpkit tries" in a
               for a in (p["advice"] for p in plans.values()))
    peaks = {v["memory"]["peak_at"] for k, v in recorded.items() if k.startswith("workload ")}
    # Validation is never the peak of these (it runs in slices of the training micro-batch).
    assert peaks == {"start of backward", "end of backward"}
    assert lookup("g5.12xlarge").accelerator not in ("H100", "H200", "A100")   # the PCIe path


def test_the_planner_takes_an_mfu_up_to_one_and_nodes_from_one_and_models_nvidia_gpus_only():
    from fsdpkit.errors import UserError

    cfg = parse_args(DEBUG)
    assert plan_config(cfg, "p5.48xlarge", 1, mfu=1.0).mfu == 1.0
    assert plan_config(cfg, None, 1).nodes == 1
    for mfu in (0.0, 1.01):
        with pytest.raises(UserError, match=rf"^mfu: {mfu} is out of range \(0, 1\]$"):
            plan_config(cfg, "p5.48xlarge", 1, mfu=mfu)
    with pytest.raises(UserError, match=r"^nodes: 0 is out of range \(at least 1\)$"):
        plan_config(cfg, "p5.48xlarge", 0)
    with pytest.raises(UserError, match=r"^instance_type: trn1.32xlarge has Trainium chips; the planner models "
                                        r"NVIDIA GPUs$"):
        plan_config(cfg, "ml.trn1.32xlarge", 1)


def test_dpo_holds_a_frozen_copy_without_lora_none_with_it_and_computes_a_third_more():
    sft, dpo = (workload(parse_args([*DEBUG, *extra]), 2, "cpu", 1) for extra in ([], DPO))
    a, b = estimate(sft), estimate(dpo)
    assert (b.params, b.grads, b.optimizer) == (2 * a.params, a.grads, a.optimizer)
    lora = LoraShape(8, 16.0, 0.0, LORA_TARGETS)
    a, b = (estimate(dataclasses.replace(w, lora=lora)) for w in (sft, dpo))
    assert (b.params, b.grads, b.optimizer, b.backward_start) == (a.params, a.grads, a.optimizer, a.backward_start)
    flags = ["--preset", "llama3_1_8b", "--seq_len", "4096", "--train_batch_size", "1"]
    for ac, factor in (("none", 4 / 3), ("full", 5 / 4)):
        base, pref = (plan_config(parse_args([*flags, "--activation_checkpointing", ac, *extra]), "p5.48xlarge", 1)
                      for extra in ([], DPO))
        assert pref.compute_s == pytest.approx(base.compute_s * factor, rel=1e-12)
