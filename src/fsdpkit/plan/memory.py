"""Bytes per rank of one training step of fsdpkit's trainer, from the config alone.

The figures follow what the code keeps alive, tensor by tensor (see fsdpkit.train.model.transformer and
fsdpkit.train.parallel.shard):
- sharded state: fp32 parameters, fp32 gradients and AdamW's two fp32 moments, each 1/shard of the
  (dim-0 padded) parameters; all on the host with CPU offload;
- FSDP buffers: the root unit (embeddings, final norm, head) stays gathered from forward through
  backward; each block is gathered (plus `fsdp_prefetch` blocks ahead) in the compute dtype; in
  backward a block's unsharded gradients and the reduce-scatter input (reduce dtype);
- activations each decoder block saves for backward, counted per saved tensor (the RMSNorms' fp32
  inputs and normalised values, the q/k/v projections' shared input, q, k and v after RoPE, the attention output
  and its log-sum-exp, o_proj's input, and SwiGLU's four ffn-wide tensors); with LoRA the frozen
  norms keep no normalised values and a frozen projection no input unless an undropped adapter
  reads it (the adapters keep their own); with activation checkpointing only the block input, plus
  one block recomputed in backward;
- the loss: one chunk of logits in the compute dtype, fp32 and log-softmax at a time (or the
  whole of them without chunking), and in backward the same with their gradients;
- the backward working set of one block: the gradient flowing through the residual stream and
  the SwiGLU gradients.
The peak is the largest of the start of backward (all activations, no gradients yet), its end
(all gradients, no activations) and a validation forward (no gradients; in slices of the training
micro-batch, as the trainer runs it; under DPO, the reference's forward on a whole micro-batch).
DPO without LoRA holds a frozen fp32 copy of the model's shards as its reference; with LoRA the
reference is the base with its adapters off, and costs nothing.
QLoRA's base projections are NF4 (about 0.52 bytes a parameter) when sharded, gathered and kept; each
is dequantized for its matmul, one full weight at a time in the backward working set.
- one process under autocast instead of FSDP: each weight's compute-dtype copy, saved for its
  backward, and the head's gradient made in the compute dtype and summed in fp32;
- compiled blocks: what inductor's partitioner keeps (fewer tensors; the norms recomputed);
- context parallel over N ranks: every per-token figure counts this rank's 1/N of each sequence
  (attention, holding all tokens of 1/N of the heads, keeps as many);
- expert parallel over N ranks: the experts are no part of FSDP's units; each rank holds 1/N of
  them whole in fp32 with gradients and moments, and their compute-dtype copies made in forward;
  its experts receive up to EP_IMBALANCE times their even share of the routed rows.
The figure is of tensors (what the CUDA allocator's peak counts); tests/plan/test_plan.py checks
it against the tensor peak of real CPU runs, from torch.profiler's allocation events, and against
peaks measured on an H100 and an H200 (within 10% above, never more than 3% below); one eager
block's activations byte for byte against what autograd saves.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from fsdpkit.train.model.config import LoraShape, ModelConfig, nf4_bytes_per_param, projections

DTYPE_BYTES = {"fp32": 4, "bf16": 2}
# QLoRA's base projections (NF4 of the fp32 parameters): codes, int8 scalers, fp32 factors.
NF4_BYTES = nf4_bytes_per_param(4)
# Expert parallel: the rows a rank's experts receive, over their even share (the busiest rank's, at
# initialisation, on the suite's Mixtral shape: 1.46; the balancing loss brings it towards 1).
EP_IMBALANCE = 1.5


@dataclass(frozen=True)
class Workload:
    """Everything the estimate depends on, taken from a TrainConfig (see plan.planner.workload)."""

    model: ModelConfig
    seq: int
    micro_batch: int            # sequences per rank per micro-step
    val_batch: int              # sequences per rank per validation batch (forward only)
    grad_accum: int
    world: int                  # ranks (GPUs) in the job
    shard: int                  # ranks a parameter is sharded over (world, or world / replicas for HSDP)
    compute: str                # "bf16" | "fp32": dtype of matmuls and activations
    reduce: str                 # "bf16" | "fp32"
    ac: str                     # "none" | "full" | "selective"
    ac_every: int
    cpu_offload: bool
    prefetch: int               # blocks gathered ahead
    reshard: bool               # reshard_after_forward: gather again in backward
    loss_chunk: int             # tokens per cross-entropy chunk (0: no chunking)
    compiled: bool = False      # torch.compile: blocks save what inductor keeps; the unchunked loss is one kernel
    fused_norm: bool = False    # CUDA's fused RMSNorm kernel: saves its input and rstd, not the normalised x
    lora: LoraShape | None = None   # LoRA: the base frozen (no gradients, no optimizer state), adapters trained
    dpo: bool = False           # DPO: a reference forward (no gradients) on each micro-batch before the policy's
    cp: int = 1                 # context parallel: ranks that share each sequence
    ep: int = 1                 # expert parallel: ranks each MoE layer's experts are split over

    @property
    def tokens(self) -> int:
        """Tokens a rank computes per micro-step: its slice of every sequence (attention's head split
        holds as many: all tokens of 1/cp of the heads)."""
        return self.seq * self.micro_batch // self.cp

    @property
    def fsdp(self) -> bool:
        return self.world > 1

    @property
    def nf4(self) -> bool:
        """QLoRA: the base's projections stored (and gathered) in NF4."""
        return self.lora is not None and self.lora.nf4

    @property
    def reference_copy(self) -> bool:
        """DPO without LoRA: its reference is a frozen, sharded fp32 copy of the model."""
        return self.dpo and self.lora is None


@dataclass
class MemoryEstimate:
    params: int
    grads: int
    optimizer: int
    fsdp_buffers: int
    activations: int
    loss: int
    backward_working: int
    peak: int                   # bytes per rank on the device
    host: int                   # bytes per rank kept on the host (CPU offload)
    peak_at: str                # "start of backward" | "end of backward" | "validation"
    # The three moments the peak is the largest of (what `plan --json` shows beside it).
    backward_start: int
    backward_end: int
    validation: int

    def to_dict(self) -> dict[str, int | str]:
        return asdict(self)


def _padded(shape: tuple[int, ...], shard: int) -> int:
    """Elements of a parameter after FSDP2 pads dim 0 to a multiple of the shard count."""
    rest = math.prod(shape[1:])
    return math.ceil(shape[0] / shard) * shard * rest


def adapter_shapes(m: ModelConfig, lora: LoraShape | None) -> list[tuple[int, ...]]:
    """A block's LoRA adapters: A (rank, in) and B (out, rank) for each adapted projection."""
    if lora is None:
        return []
    return [s for name, (out, inp) in projections(m).items() if name in lora.targets
            for s in ((lora.rank, inp), (out, lora.rank))]


def block_shapes(m: ModelConfig, lora: LoraShape | None = None, experts: bool = True) -> list[tuple[int, ...]]:
    """One decoder block's parameter shapes; without the experts' stacks for `experts` False (under
    expert parallel they are no part of the block's FSDP unit)."""
    hd = m.head_size
    shapes = [(m.dim,), (m.n_heads * hd, m.dim), (m.n_kv_heads * hd, m.dim), (m.n_kv_heads * hd, m.dim),
              (m.dim, m.n_heads * hd), (m.dim,)]
    if m.qkv_bias:
        shapes += [(m.n_heads * hd,), (m.n_kv_heads * hd,), (m.n_kv_heads * hd,)]
    if m.qk_norm:
        shapes += [(hd,), (hd,)]
    shapes += adapter_shapes(m, lora)
    if m.is_moe:
        shapes += [(m.n_experts, m.dim)]
        shapes += [(m.n_experts, 2 * m.ffn_dim, m.dim), (m.n_experts, m.dim, m.ffn_dim)] if experts else []
    else:
        shapes += [(m.ffn_dim, m.dim), (m.ffn_dim, m.dim), (m.dim, m.ffn_dim)]
    return shapes


def nf4_elements(w: Workload) -> int:
    """Elements of one block held in NF4 (QLoRA: every dense projection; none otherwise)."""
    return sum(out * inp for out, inp in projections(w.model).values()) if w.nf4 else 0


def fsdp_block_shapes(w: Workload) -> list[tuple[int, ...]]:
    """The shapes of one block's FSDP unit: every parameter, but the experts under expert parallel."""
    return block_shapes(w.model, w.lora, experts=w.ep == 1)


def local_expert_elements(w: Workload) -> int:
    """Expert-parallel weights one rank holds per layer (their experts whole); 0 without."""
    m = w.model
    return 3 * m.n_experts * m.ffn_dim * m.dim // w.ep if w.ep > 1 else 0


def block_bytes(w: Workload, shard: int, dtype_bytes: int) -> float:
    """Bytes of one block gathered whole: its parameters in `dtype_bytes`, QLoRA's projections in NF4."""
    q = nf4_elements(w)
    return (unit_elements(fsdp_block_shapes(w), shard) - q) * dtype_bytes + q * NF4_BYTES


def root_shapes(m: ModelConfig) -> list[tuple[int, ...]]:
    return [(m.vocab_size, m.dim), (m.dim,)] + ([] if m.tie_embeddings else [(m.vocab_size, m.dim)])


def unit_elements(shapes: list[tuple[int, ...]], shard: int) -> int:
    """Elements of an FSDP unit gathered whole (padding included)."""
    return sum(_padded(s, shard) for s in shapes)


def sharded_elements(w: Workload) -> int:
    """Elements of all parameters one rank holds."""
    shard = w.shard if w.fsdp else 1
    total = unit_elements(fsdp_block_shapes(w), shard) * w.model.n_layers + \
        unit_elements(root_shapes(w.model), shard)
    return total // shard + local_expert_elements(w) * w.model.n_layers


def trained_elements(w: Workload) -> tuple[int, int]:
    """Elements of one block and of the root unit that train (have gradients and optimizer
    state), gathered whole: all of them, or with LoRA the adapters alone."""
    shard = w.shard if w.fsdp else 1
    if w.lora is None:
        return unit_elements(fsdp_block_shapes(w), shard), unit_elements(root_shapes(w.model), shard)
    return unit_elements(adapter_shapes(w.model, w.lora), shard), 0


def adapter_activations(w: Workload) -> int:
    """Bytes a block's adapters save for backward: each A's output (and with dropout, the dropped
    input and its mask: a bool mask from CUDA's fused dropout kernel, elsewhere a tensor of the
    input's dtype that the input is multiplied by)."""
    if w.lora is None:
        return 0
    cb, n = DTYPE_BYTES[w.compute], w.tokens
    mask = 1 if w.fused_norm else cb   # fused_norm: the CUDA kernels
    adapted = [inp for name, (_, inp) in projections(w.model).items() if name in w.lora.targets]
    return sum(n * w.lora.rank * cb + (n * inp * (cb + mask) if w.lora.dropout else 0) for inp in adapted)


def block_activations(w: Workload) -> int:
    """Bytes one decoder block saves for backward (no checkpointing)."""
    m, s, cb = w.model, w.tokens, DTYPE_BYTES[w.compute]
    d = m.dim
    if w.compiled and not m.is_moe:
        # What inductor's partitioner keeps of a compiled block, counted with saved-tensor hooks on
        # one (CPU and H100 agree): five dim-wide tensors (the block input, the residual after
        # attention, both norms' outputs, o_proj's input), q and the expanded K/V and the attention
        # output, three ffn-wide SwiGLU tensors, the attention's log-sum-exp and both norms' rstd.
        # Everything else, the fp32 norm work included, is recomputed in backward.
        q_width = m.n_heads * m.head_size
        return s * (5 * d + 4 * q_width + 3 * m.ffn_dim) * cb + s * (m.n_heads * 4 + 2 * 4)
    # Each RMSNorm keeps its fp32 input and rstd, and unfused (CPU) also the normalised x for its
    # weight's gradient, which a frozen (LoRA) weight does not have.
    norms = 2 * ((1 if w.fused_norm or w.lora else 2) * s * d * 4 + s * 4)
    # A projection's input is kept for its weight's gradient; a frozen one (LoRA) keeps it only where
    # an adapter reads it undropped (with dropout the adapter keeps its own dropped copy instead).
    def kept(*names: str) -> int:
        return int(w.lora is None or (not w.lora.dropout and any(n in w.lora.targets for n in names)))

    attn_in = kept("q_proj", "k_proj", "v_proj") * s * d * cb   # q/k/v projections share their input
    qkv = 3 * s * d * cb                        # q, and K/V repeated to every query head for SDPA
    # The kernel's output and its log-sum-exp; o_proj's (reshaped) input.
    attn_out = s * d * cb + s * m.n_heads * 4 + kept("o_proj") * s * d * cb
    if m.is_moe:   # under expert parallel the routed rows are the ones this rank's experts receive
        routed = s * m.experts_per_token * (EP_IMBALANCE if w.ep > 1 else 1)
        mlp = int(s * d * cb + s * m.n_experts * 4 * 2 + routed * (d * cb + 4 * m.ffn_dim * cb))
    else:   # the input; gate, silu(gate) and up; their product, down_proj's input
        mlp = kept("gate_proj", "up_proj") * s * d * cb + (3 + kept("down_proj")) * s * m.ffn_dim * cb
    return norms + attn_in + qkv + attn_out + mlp + adapter_activations(w)


def checkpointed_blocks(w: Workload) -> int:
    L = w.model.n_layers
    return {"none": 0, "full": L}.get(w.ac, math.ceil(L / w.ac_every))


def recomputed_block(w: Workload) -> int:
    """Bytes of the one checkpointed block whose activations backward recomputes at a time."""
    return block_activations(w) if checkpointed_blocks(w) else 0


def activations(w: Workload) -> int:
    """Bytes saved for backward by the whole forward, the recomputed block included."""
    L, per_block, checkpointed = w.model.n_layers, block_activations(w), checkpointed_blocks(w)
    block_input = w.tokens * w.model.dim * DTYPE_BYTES[w.compute]
    acts = checkpointed * block_input + (L - checkpointed) * per_block + recomputed_block(w)
    # Final norm (fp32 input copy) and its output, which the head's chunks keep; a frozen (LoRA)
    # head that is not chunked needs no input for a gradient of its own.
    unchunked = w.loss_chunk == 0 or w.loss_chunk >= w.tokens
    output = 0 if w.lora and unchunked and not w.compiled else DTYPE_BYTES[w.compute]
    return acts + w.tokens * w.model.dim * (4 + output)


def fp32_copy(w: Workload) -> int:
    """Bytes per element of the loss's fp32 copy of the logits: `.float()` copies only bf16 ones."""
    return 0 if w.compute == "fp32" else 4


def loss_bytes(w: Workload) -> tuple[int, int]:
    """(kept for backward, transient at its peak) of the output head and cross-entropy."""
    V, cb = w.model.vocab_size, DTYPE_BYTES[w.compute]
    n = w.tokens
    per_token = V * (cb + fp32_copy(w) + 4)   # logits, their fp32 copy (none in fp32), log-softmax
    if w.compiled and (w.loss_chunk == 0 or w.loss_chunk >= n):
        # Inductor fuses the fp32 log-softmax: the logits are kept in the compute dtype, and
        # backward writes their gradient over them (measured on an H100: the peak holds one copy).
        return n * V * cb, 0
    if w.loss_chunk == 0 or w.loss_chunk >= n:
        # Only the fp32 log-probabilities are saved (log-softmax keeps its output, not the logits);
        # backward adds their gradient and the logits' fp32 gradient.
        return n * V * 4, n * V * 8
    if w.compiled:
        # Inside a compiled graph the chunks' checkpoints do not recompute: every chunk's logits
        # stay, about 2 compute-dtype and one fp32 value per logit (measured on an H100).
        return n * V * (2 * cb + 4), 0
    c = w.loss_chunk
    return 0, c * per_token + c * V * (4 + cb)      # one chunk recomputed, with its gradients


def head_elements(m: ModelConfig) -> int:
    return m.vocab_size * m.dim


@dataclass
class _Copies:
    """The weights' and gradients' copies beside the shards: gathered (or cast) for compute, what
    backward's units hold, the head's gradient, and unsharded gradients under accumulation."""

    gathered: int
    end_copies: int
    val_copies: int
    fsdp_bwd: int
    root_bwd: int
    head_grad: int
    loss_grad: int
    accum: int = 0


def _state(w: Workload, shard: int, trained: tuple[int, int]) -> tuple[int, int, int, int]:
    """This rank's parameters, gradients and AdamW moments, and with CPU offload the host's share."""
    p = sharded_elements(w)
    block_trained, root_trained = trained
    # What has gradients and moments: FSDP's shards, and this rank's experts whole under expert parallel.
    t = (block_trained * w.model.n_layers + root_trained) // shard + local_expert_elements(w) * w.model.n_layers
    q = nf4_elements(w) * w.model.n_layers // shard   # this rank's NF4 elements
    params, grads, optimizer = int(4 * (p - q) + NF4_BYTES * q), 4 * t, 8 * t
    if w.reference_copy:   # the frozen reference's shards (the policy's shapes, no adapters: there are none)
        params += 4 * p
    if w.cpu_offload and w.fsdp:
        return 0, 0, 0, params + grads + optimizer
    return params, grads, optimizer, 0


def _fsdp_copies(w: Workload, shard: int, cb: int, rb: int, recompute: int, trained: tuple[int, int]) -> _Copies:
    m, L = w.model, w.model.n_layers
    block_trained, root_trained = trained   # per block, and the root's
    frozen_head = w.lora is not None   # LoRA: the head and embeddings make no gradient
    # Without resharding after forward every block stays gathered until its backward.
    gathered = int(unit_elements(root_shapes(m), shard) * cb + (L if not w.reshard else 1 + w.prefetch)
                   * block_bytes(w, shard, cb))
    # Backward: one block's unsharded gradients and the reduce-scatter input.
    fsdp_bwd = block_trained * (cb + rb)
    # The root unit is reduced last: the output head's unsharded gradient lives through the
    # whole backward; the root's reduce-scatter (embeddings and head, its parameters already
    # resharded, no block gathered any more) ends it.
    head_grad = 0 if frozen_head else head_elements(m) * cb
    accum = (block_trained * L + root_trained) * cb if w.grad_accum > 1 else 0   # no sync: every unit's stay
    gathered += accum
    # Expert-parallel weights (FSDP does not cast them) are cast to the compute dtype in each
    # forward and the copy saved for backward (a checkpointed block's made again); in backward
    # one layer's copy has a gradient of its own.
    experts_cast = local_expert_elements(w) * (0 if w.compute == "fp32" else cb)
    gathered += (L - checkpointed_blocks(w) + (1 if recompute else 0)) * experts_cast
    return _Copies(gathered, gathered, gathered, fsdp_bwd + experts_cast, root_trained * (cb + rb), head_grad,
                   head_grad, accum)


def _one_process_copies(w: Workload, shard: int, cb: int, recompute: int) -> _Copies:
    # One process under autocast: each weight's compute-dtype copy is saved for its backward
    # (a checkpointed block's are made again when it is recomputed), the embedding's excepted
    # (a lookup is not cast; an NF4 weight is kept as it is). Each block's copy goes with its backward.
    m, L = w.model, w.model.n_layers
    frozen_head = w.lora is not None
    cast = 0 if w.compute == "fp32" else cb
    copied = (unit_elements(block_shapes(m, w.lora), shard) - nf4_elements(w)) * cast
    kept_blocks = L - checkpointed_blocks(w) + (1 if recompute else 0)
    # The head's gradient is made in the compute dtype and accumulated in fp32: the loss's
    # backward holds the compute-dtype one (and with chunks the fp32 sum beside it); the fp32
    # one then lives through the rest of backward.
    chunked = 0 < w.loss_chunk < w.tokens and not w.compiled
    head_grad = 0 if frozen_head else head_elements(m) * 4
    loss_grad = 0 if frozen_head else head_elements(m) * (cb + (4 if chunked else 0))
    return _Copies(kept_blocks * copied + head_elements(m) * cast, copied, copied, 0, 0, head_grad, loss_grad)


def _validation_extra(w: Workload, cb: int) -> int:
    """Validation: no gradients kept, one block's forward working set (SwiGLU's ffn-wide tensors,
    the residual and its branch) and one chunk of logits (compiled and unchunked: the logits in
    the compute dtype, the loss fused). The trainer validates in slices of the training
    micro-batch, so a validation batch never holds more tokens than a training step. DPO's
    reference forward is such a forward, on a whole micro-batch."""
    m = w.model
    v = w.seq // w.cp * (w.micro_batch if w.dpo else min(w.val_batch, w.micro_batch))
    if w.compiled and (w.loss_chunk == 0 or w.loss_chunk >= v):
        val_loss = v * m.vocab_size * cb
    else:
        val_chunk = v if w.loss_chunk == 0 else min(w.loss_chunk, v)
        val_loss = val_chunk * m.vocab_size * (cb + fp32_copy(w) + 4)
    return v * (3 * m.ffn_dim + 3 * m.dim) * cb + val_loss


def estimate(w: Workload) -> MemoryEstimate:
    cb, rb = DTYPE_BYTES[w.compute], DTYPE_BYTES[w.reduce]
    shard = w.shard if w.fsdp else 1
    trained = trained_elements(w)
    params, grads, optimizer, host = _state(w, shard, trained)
    m, s = w.model, w.tokens
    recompute = recomputed_block(w)
    c = _fsdp_copies(w, shard, cb, rb, recompute, trained) if w.fsdp else _one_process_copies(w, shard, cb,
                                                                                               recompute)
    acts = activations(w)
    kept, loss_peak = loss_bytes(w)
    # The residual stream's gradient and its branch's, RMSNorm's two fp32 gradients, and two
    # ffn-wide SwiGLU gradients (a recomputed block frees its SwiGLU tensors as fast as their
    # gradients appear).
    working = s * (2 * m.dim + (0 if w.ac == "full" else 2 * m.ffn_dim)) * cb + 2 * s * m.dim * 4
    if w.nf4:   # an NF4 projection is dequantized for each matmul: one full weight at a time
        working += max(out * inp for out, inp in projections(m).values()) * cb
    # Backward begins with the loss and head, then the last block: activations are all still alive.
    # The loss's tensors are gone before the first block's backward (and its recomputation) starts.
    start = params + optimizer + c.gathered + acts - recompute + max(
        kept + loss_peak + c.loss_grad, c.head_grad + recompute + c.fsdp_bwd + working)
    # A tied embedding's gradient is made whole before it is added to the head's.
    tied = head_elements(m) * 4 if m.tie_embeddings and not w.fsdp and w.lora is None else 0
    end = params + optimizer + grads + max(c.end_copies + c.fsdp_bwd + working + tied, c.accum + c.root_bwd)
    val = params + optimizer + c.val_copies + _validation_extra(w, cb)
    peak, at = max((start, "start of backward"), (end, "end of backward"), (val, "validation"))
    return MemoryEstimate(params, grads, optimizer, c.gathered + max(c.fsdp_bwd, c.root_bwd), acts + kept, loss_peak,
                          working, peak, host, at, start, end, val)
