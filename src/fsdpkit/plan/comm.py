"""FSDP2 collectives of one optimizer step, per rank, from the config alone.

Each FSDP unit (every decoder block, and the root: embeddings, final norm, head) is all-gathered in
the compute dtype in forward, and again in backward when it was resharded after forward (every
block but the last, and the root); with gradient accumulation, on every micro-step. QLoRA's NF4
projections travel as NF4 (4-bit codes and their scalers). Gradients are
reduce-scattered once per optimizer step in the reduce dtype (`set_requires_gradient_sync` holds
them back on the other micro-steps); with HSDP the sharded result is then all-reduced across
replicas. Sizes are the collectives' full tensors (all-gather output, reduce-scatter input),
padding included: what `torch.distributed` is handed. The gradient-norm all-reduce (one scalar)
is left out.

Context parallel over N ranks adds, in every block, an all-to-all of q, k, v and of the attention
output (fsdpkit.train.model.context): 4 in its forward, 4 of their gradients in backward and 4
more for each forward activation checkpointing recomputes, on every micro-step. K and V travel
with their own heads where N divides them, else expanded to one per query head. The group's
target count (one scalar all-reduce per micro-step) is left out. These are on attention's path,
within a node: they add to the step instead of overlapping it.

Expert parallel over N ranks takes the experts out of FSDP's units, and adds, in every MoE layer,
an all-to-all of the rows' counts per expert (int64) and two of the routed rows (to their experts
and back: each rank's tokens times top-k, model-wide, on average what a rank receives), in forward
and again when recomputed; in backward two of the rows' gradients. Once a step, the ranks that
hold the same experts all-reduce their fp32 gradients.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from fsdpkit.plan.memory import (
    DTYPE_BYTES,
    Workload,
    block_bytes,
    checkpointed_blocks,
    local_expert_elements,
    root_shapes,
    trained_elements,
    unit_elements,
)


@dataclass
class StepComm:
    all_gather_bytes: int        # sum of all-gather outputs
    reduce_scatter_bytes: int    # sum of reduce-scatter inputs
    all_reduce_bytes: int        # HSDP: sharded gradients all-reduced across replicas
    all_gathers: int
    reduce_scatters: int
    wire_bytes: int              # what each rank sends (= receives) with ring algorithms
    all_to_all_bytes: int = 0    # context parallel: sum of all-to-all inputs
    all_to_alls: int = 0
    all_to_all_wire_bytes: int = 0   # what each rank sends of them (the rest stays on the rank)

    def to_dict(self) -> dict[str, int]:
        return asdict(self)


def context_comm(w: Workload) -> tuple[int, int]:
    """(all-to-alls, their summed input bytes) of context parallel in one optimizer step."""
    if w.cp == 1:
        return 0, 0
    m = w.model
    kv_heads = m.n_kv_heads if m.n_kv_heads % w.cp == 0 else m.n_heads
    per_block = w.tokens * m.head_size * (2 * m.n_heads + 2 * kv_heads) * DTYPE_BYTES[w.compute]
    passes = w.grad_accum * (2 * m.n_layers + checkpointed_blocks(w))   # forward, backward, recomputed
    return 4 * passes, per_block * passes


def expert_comm(w: Workload) -> tuple[int, int]:
    """(all-to-alls, their summed input bytes) of expert parallel in one optimizer step, per rank."""
    if w.ep == 1:
        return 0, 0
    m = w.model
    rows = w.tokens * m.experts_per_token * m.dim * DTYPE_BYTES[w.compute]
    counts = m.n_experts * 8
    forward_calls, forward = 3, counts + 2 * rows
    recomputed = checkpointed_blocks(w)
    calls = m.n_layers * (forward_calls + 2) + recomputed * forward_calls
    moved = m.n_layers * (forward + 2 * rows) + recomputed * forward
    return w.grad_accum * calls, w.grad_accum * moved


def step_comm(w: Workload) -> StepComm:
    calls, moved = (a + b for a, b in zip(context_comm(w), expert_comm(w), strict=True))
    degree = w.cp if w.cp > 1 else w.ep
    context = {"all_to_all_bytes": moved, "all_to_alls": calls, "all_to_all_wire_bytes": moved * (degree - 1) // degree}
    if not w.fsdp:
        return StepComm(0, 0, 0, 0, 0, 0, **context)
    L, shard = w.model.n_layers, w.shard
    root = unit_elements(root_shapes(w.model), shard)
    block_trained, root_trained = trained_elements(w)   # LoRA: only the adapters' gradients are reduced
    cb, rb = DTYPE_BYTES[w.compute], DTYPE_BYTES[w.reduce]
    regathered_blocks = L - 1 if w.reshard else 0
    regathered_root = 1 if w.reshard else 0
    gathers = w.grad_accum * (L + 1 + regathered_blocks + regathered_root)
    block = block_bytes(w, shard, cb)   # QLoRA's projections are gathered in NF4
    gathered = int(w.grad_accum * ((L + regathered_blocks) * block + (1 + regathered_root) * root * cb))
    scattered = (L * block_trained + root_trained) * rb
    replicas = w.world // shard
    reduced = (L * block_trained + root_trained) // shard * rb if replicas > 1 else 0
    frac = (shard - 1) / shard
    wire = int((gathered + scattered) * frac + (2 * reduced * (replicas - 1) / replicas if replicas > 1 else 0))
    copies = w.world // w.ep   # ranks holding the same experts: their fp32 gradients all-reduced
    if copies > 1:
        experts = L * local_expert_elements(w) * 4
        reduced += experts
        wire += int(2 * experts * (copies - 1) / copies)
    return StepComm(gathered, scattered, reduced, gathers, L + (1 if root_trained else 0), wire, **context)
