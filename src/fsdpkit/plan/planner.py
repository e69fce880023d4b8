"""Will it fit, how fast, what to change: memory and communication per rank (plan.memory,
plan.comm) against an instance type's GPUs and network, compute time at a stated MFU, and, when
the plan does not fit or waits on the network, the same plan with each change that helps.

Assumptions, stated because they are not measurements:
- usable GPU memory is 90% of the GPU's less 1 GiB (CUDA context, NCCL buffers, allocator slack);
- with CPU offload, the host holds each rank's parameters, gradients and optimizer state and may
  use 80% of the instance's memory;
- compute time = FLOPs / (peak x MFU), with activation checkpointing's recomputed forward added;
- communication overlaps compute (FSDP prefetch), so a step takes the longer of the two; within a
  node collectives run over NVLink, across nodes each GPU gets its share of the node's EFA bandwidth;
- context and expert parallel's all-to-alls sit on the layer's path: they add to compute (over
  NVLink within a node; an expert-parallel group larger than a node crosses EFA);
- CPU offload adds its copies over PCIe (25 GB/s per GPU) and AdamW on the host (20 GB/s of state
  per rank) to every step.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field
from typing import Any

from fsdpkit.errors import UserError
from fsdpkit.hardware.accelerators import GPU_PEAK_TFLOPS
from fsdpkit.hardware.instances import Instance, lookup
from fsdpkit.plan.comm import StepComm, step_comm
from fsdpkit.plan.memory import MemoryEstimate, Workload, estimate
from fsdpkit.plan.workload import workload
from fsdpkit.train.model.config import context_degrees, expert_degrees
from fsdpkit.train.model.flops import flops_per_token

GIB = 2**30
# Per-GPU one-direction NVLink bandwidth (bytes/s); other GPUs talk over PCIe.
NVLINK = {"H100": 450e9, "H200": 450e9, "A100": 300e9}
PCIE = 25e9
HOST_ADAM = 20e9   # bytes/s of AdamW state one rank's share of the host streams through


def usable_gpu_bytes(inst: Instance) -> int:
    return int(inst.accel_memory_gib * GIB * 0.9 - GIB)


@dataclass
class Plan:
    workload: Workload
    instance: Instance | None
    nodes: int
    memory: MemoryEstimate
    comm: StepComm
    mfu: float
    fits: bool | None = None            # None: no instance type to compare with
    usable_bytes: int | None = None
    host_fits: bool | None = None
    compute_s: float | None = None
    comm_s: float | None = None
    bound: str | None = None
    tokens_per_s: float | None = None
    offload_s: float = 0.0
    all_to_all_s: float = 0.0           # context or expert parallel's all-to-alls, not overlapped
    change: str = ""                    # the flags that turn the asked-for plan into this one
    alternatives: list[Plan] = field(default_factory=list)

    @property
    def step_s(self) -> float | None:
        """Seconds per optimizer step: compute and communication overlap; offload's copies add."""
        if self.compute_s is None or self.comm_s is None:
            return None
        return max(self.compute_s + self.all_to_all_s, self.comm_s) + self.offload_s

    def summary(self, price: float | None = None) -> dict[str, Any]:
        w = self.workload
        out: dict[str, Any] = {
            "change": self.change or None,
            "instance_type": self.instance.name if self.instance else None, "nodes": self.nodes,
            "world": w.world, "seq_len": w.seq, "micro_batch": w.micro_batch, "grad_accum": w.grad_accum,
            "dtype": w.compute, "sharding": "hybrid" if w.shard < w.world else "full" if w.fsdp else "none",
            "activation_checkpointing": w.ac, "cpu_offload": w.cpu_offload, "context_parallel": w.cp,
            "expert_parallel": w.ep,
            "fits": self.fits, "peak_gib": round(self.memory.peak / GIB, 2),
            "usable_gib": round(self.usable_bytes / GIB, 2) if self.usable_bytes else None,
            "memory_gib": {k: round(v / GIB, 3) for k, v in self.memory.to_dict().items() if isinstance(v, int)},
            "peak_at": self.memory.peak_at, "host_fits": self.host_fits,
            "comm_bytes": self.comm.to_dict(),
            "compute_s": _round(self.compute_s), "comm_s": _round(self.comm_s),
            "all_to_all_s": _round(self.all_to_all_s) if max(w.cp, w.ep) > 1 else None, "bound": self.bound,
            "offload_s": _round(self.offload_s) if w.cpu_offload else None,
            "step_s": _round(self.step_s),
            "tokens_per_s": round(self.tokens_per_s) if self.tokens_per_s else None, "mfu": self.mfu,
        }
        if price:
            out["cost_per_hour"] = round(self.nodes * price, 2)
        return out


def _round(x: float | None) -> float | None:
    return None if x is None else round(x, 4)


def evaluate(w: Workload, inst: Instance | None, nodes: int, mfu: float, flops_per_token: float,
             change: str = "") -> Plan:
    mem, comm = estimate(w), step_comm(w)
    plan = Plan(w, inst, nodes, mem, comm, mfu, change=change)
    if inst is None:
        return plan
    plan.usable_bytes = usable_gpu_bytes(inst)
    per_node = w.world // nodes
    plan.host_fits = mem.host * per_node <= inst.memory_gib * GIB * 0.8
    plan.fits = mem.peak <= plan.usable_bytes and plan.host_fits
    peak = GPU_PEAK_TFLOPS.get(inst.accelerator)
    tokens = w.tokens * w.grad_accum
    if peak:
        recompute = {"none": 1.0, "full": 4 / 3}.get(w.ac, 1 + 1 / 3 / w.ac_every)
        # DPO's reference forward: a third of a training step's FLOPs more (not recomputed).
        reference = 1 / 3 if w.dpo else 0.0
        plan.compute_s = tokens * flops_per_token * (recompute + reference) / (peak[w.compute] * 1e12 * mfu)
        intra = NVLINK.get(inst.accelerator, PCIE)
        bw = intra if nodes == 1 else min(intra, inst.net_gbps * 1e9 / 8 / per_node)
        plan.comm_s = comm.wire_bytes / bw if comm.wire_bytes else 0.0
        exchange = intra if max(w.cp, w.ep) <= per_node else bw
        plan.all_to_all_s = comm.all_to_all_wire_bytes / exchange
        # The step's largest term: FSDP's collectives (overlapped with compute and the all-to-alls,
        # so they bound only past both), else the all-to-alls where they outlast the compute.
        plan.bound = ("network" if plan.comm_s > plan.compute_s + plan.all_to_all_s else
                      "all-to-all" if plan.all_to_all_s > plan.compute_s else "compute")
        step = max(plan.compute_s + plan.all_to_all_s, plan.comm_s)
        if w.cpu_offload:
            # Host <-> GPU copies of the fp32 shards (gathered twice, gradients back) and AdamW on the CPU.
            shard_elems = mem.host // 16
            plan.offload_s = shard_elems * 12 / PCIE + shard_elems * 16 / HOST_ADAM
            step += plan.offload_s
        plan.tokens_per_s = tokens * w.world / step
    return plan


def _changes(w: Workload, nodes: int, per_node: int) -> list[tuple[str, Workload, int]]:
    """Candidate changes, each cumulative on the one before, in the order a user would try them."""
    out: list[tuple[str, Workload, int]] = []
    flags: list[str] = []
    if w.ac != "full":
        flags.append("--activation-checkpointing full")
        w = dataclasses.replace(w, ac="full")
        out.append((" ".join(flags), w, nodes))
    # A smaller micro-batch; not made up for with more accumulation: under FSDP, accumulating
    # without a reduce-scatter per micro-step keeps unsharded gradients of the whole model.
    while w.micro_batch > 1:
        w = dataclasses.replace(w, micro_batch=w.micro_batch // 2)
        out.append((" ".join([*flags, f"--train-batch-size {w.micro_batch}"]), w, nodes))
    flags = [out[-1][0]] if out else []
    # Long sequences: activations fall with the ranks that share each sequence, not with more nodes.
    if w.cp == 1 and not w.dpo:
        for degree in context_degrees(w.model, w.seq, per_node):
            out.append((" ".join([*flags, f"--context-parallel {degree}"]).strip(),
                        dataclasses.replace(w, cp=degree), nodes))
    out += [(" ".join([*flags, change]).strip(), ew, nodes) for ew, change in _expert_layouts(w)]
    for n in sorted({nodes * 2, nodes * 4, nodes * 8} | set(range(nodes + 1, nodes + 8))):
        world = n * per_node
        replicas = w.world // w.shard
        scaled = dataclasses.replace(w, world=world, shard=world // replicas if replicas > 1 else world)
        out.append((" ".join([*flags, f"nodes={n}"]).strip(), scaled, n))
    out.append((" ".join([*flags, "--cpu-offload true"]).strip(), dataclasses.replace(w, cpu_offload=True), nodes))
    return out


def _expert_layouts(w: Workload) -> list[tuple[Workload, str]]:
    """A mixture of experts split over 2 ranks and up instead of gathered by every rank."""
    if w.ep > 1 or w.lora is not None or w.cpu_offload:
        return []
    return [(dataclasses.replace(w, ep=n), f"--expert-parallel {n}") for n in expert_degrees(w.model, w.world)]


def plan(w: Workload, inst: Instance | None, nodes: int, mfu: float, flops_per_token: float) -> Plan:
    """The plan as asked, with `alternatives` when it does not fit or is network-bound."""
    if not 0 < mfu <= 1:
        raise UserError(f"mfu: {mfu} is out of range (0, 1]")
    base = evaluate(w, inst, nodes, mfu, flops_per_token)
    if inst is None:
        return base
    per_node = w.world // nodes
    if base.fits is False:
        seen = set()
        for change, cw, n in _changes(w, nodes, per_node):
            alt = evaluate(cw, inst, n, mfu, flops_per_token, change)
            kind = re.sub(r"\s*nodes=\d+", "", change)   # the smallest node count that fits, per change
            if alt.fits and kind not in seen:
                seen.add(kind)
                base.alternatives.append(alt)
        # Best value first: tokens/s per node (what a node-hour buys).
        base.alternatives.sort(key=lambda p: -(p.tokens_per_s or 0) / p.nodes)
        del base.alternatives[3:]
    elif base.bound == "network":
        tries = [(dataclasses.replace(w, micro_batch=w.micro_batch * 2), f"--train-batch-size {w.micro_batch * 2}")]
        if nodes > 1 and w.shard == w.world:
            tries.insert(0, (dataclasses.replace(w, shard=per_node), "--sharding-strategy hybrid"))
        for cw, change in [*tries, *_expert_layouts(w)]:
            alt = evaluate(cw, inst, nodes, mfu, flops_per_token, change)
            if alt.fits:
                base.alternatives.append(alt)
    return base


def advice(p: Plan) -> str:
    """One line: the verdict and, if it does not fit, the first change that does."""
    if p.fits is None or p.usable_bytes is None:
        return f"needs {p.memory.peak / GIB:.1f} GiB per rank (give --instance-type to compare with a GPU)"
    if p.fits:
        return (f"fits: {p.memory.peak / GIB:.1f} of {p.usable_bytes / GIB:.1f} GiB usable per GPU; "
                f"{p.bound}-bound, about {p.tokens_per_s or 0:,.0f} tokens/s at {p.mfu:.0%} MFU")
    why = (f"needs {p.memory.peak / GIB:.1f} GiB per GPU, {p.usable_bytes / GIB:.1f} usable"
           if p.memory.peak > p.usable_bytes else "the host cannot hold the offloaded state")
    if not p.alternatives:
        return f"does not fit: {why}; no change fsdpkit tries makes it fit"
    best = p.alternatives[0]
    return (f"does not fit: {why}; fits with {best.change} ({best.memory.peak / GIB:.1f} GiB per GPU, "
            f"{best.nodes} node(s))")



def plan_config(cfg: Any, instance_type: str | None, nodes: int, mfu: float = 0.4,
                procs_per_node: int | None = None) -> Plan:
    """The plan for a TrainConfig on `nodes` x `instance_type` (one rank per GPU by default)."""
    if nodes < 1:
        raise UserError(f"nodes: {nodes} is out of range (at least 1)")
    inst = lookup(instance_type) if instance_type else None
    if inst is not None and inst.resource != "nvidia.com/gpu":
        raise UserError(f"instance_type: {inst.name} has {inst.accelerator} chips; the planner models NVIDIA GPUs")
    per_node = procs_per_node or (inst.accelerators if inst else cfg.parallel.nproc)
    w = workload(cfg, nodes * per_node, "cuda" if inst else "cpu", nodes)
    return plan(w, inst, nodes, mfu, flops_per_token(cfg.shape, cfg.data.seq_len))
