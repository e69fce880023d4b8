"""A Llama-family decoder in plain PyTorch: Llama 2 / 3.x, Mistral (sliding window), Mixtral (MoE),
Qwen 2.5 (biased query/key/value projections) and Qwen 3 (per-head query/key RMSNorm).

Module and parameter names follow Hugging Face `transformers` (v5) so that a state dict maps to a
`LlamaForCausalLM` / `MistralForCausalLM` / `MixtralForCausalLM` / `Qwen2ForCausalLM` /
`Qwen3ForCausalLM` one by adding a "model." prefix.
The model is built on the meta device and materialised with `init_weights`, which sets every
parameter and buffer (RoPE included); see `fsdpkit.train.parallel.shard` for how that meets FSDP2.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Callable
from typing import cast

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

from fsdpkit.train.model.attention import (
    AttentionMask,
    causal_attention,
    document_ids,
    expand_kv,
    masked_attention,
)
from fsdpkit.train.model.config import ModelConfig, loss_chunk_size
from fsdpkit.train.model.context import SequenceSplit
from fsdpkit.train.model.expert_parallel import ExpertSplit


def rope_frequencies(cfg: ModelConfig) -> torch.Tensor:
    """Inverse frequencies per rotary pair, scaled as configured (llama3 or linear; fp32, on CPU)."""
    hd = cfg.head_size
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, hd, 2, dtype=torch.int64).float() / hd))
    s = cfg.rope_scaling
    if s is None:
        return inv_freq
    if s.rope_type == "linear":
        return inv_freq / s.factor
    low_wavelen = s.original_max_position_embeddings / s.low_freq_factor
    high_wavelen = s.original_max_position_embeddings / s.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / s.factor, inv_freq)
    smooth = (s.original_max_position_embeddings / wavelen - s.low_freq_factor) / (
        s.high_freq_factor - s.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
    is_medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate (B, H, T, hd) by position, in the "rotate half" layout Hugging Face checkpoints use.

    In the input's dtype, as transformers does: the tables are exact in fp32, and rotating bf16
    activations in fp32 would keep fp32 copies of q and k alive for backward (a third more
    activation memory in bf16 runs, measured) for no gain in a bf16 model."""
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in fp32, as the reference implementations do, and return the input's dtype
        # (also under autocast, where the weight stays fp32). The fused kernel is faster than the
        # same formula in separate ops.
        return F.rms_norm(x.float(), (x.shape[-1],), self.weight.float(), self.eps).to(x.dtype)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.n_heads, cfg.n_kv_heads, cfg.head_size
        bias = cfg.qkv_bias
        self.q_proj = nn.Linear(cfg.dim, cfg.n_heads * cfg.head_size, bias=bias)
        self.k_proj = nn.Linear(cfg.dim, cfg.n_kv_heads * cfg.head_size, bias=bias)
        self.v_proj = nn.Linear(cfg.dim, cfg.n_kv_heads * cfg.head_size, bias=bias)
        self.o_proj = nn.Linear(cfg.n_heads * cfg.head_size, cfg.dim, bias=False)
        self.q_norm = RMSNorm(cfg.head_size, cfg.norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_size, cfg.norm_eps) if cfg.qk_norm else None
        self.split: SequenceSplit | None = None   # context parallel (Transformer.split_sequences)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                mask: AttentionMask | None = None) -> torch.Tensor:
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, self.n_heads, self.head_dim)
        k = self.k_proj(x).view(B, T, self.n_kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = q.transpose(1, 2), k.transpose(1, 2)
        v = self.v_proj(x).view(B, T, self.n_kv_heads, self.head_dim).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if self.split is not None:  # this rank's tokens of every head -> every token of its heads
            if self.n_kv_heads % self.split.size:   # too few K/V heads to share out: one per query head
                k, v = expand_kv(k, v, self.n_heads)
            q, k, v = (self.split.gather_sequence(t) for t in (q, k, v))
        out = causal_attention(q, k, v) if mask is None else masked_attention(q, k, v, mask)
        if self.split is not None:
            out = self.split.scatter_sequence(out)
        return self.o_proj(out.transpose(1, 2).reshape(B, T, -1))


class MLP(nn.Module):
    """SwiGLU feed-forward: down(silu(gate(x)) * up(x))."""

    def __init__(self, dim: int, ffn_dim: int):
        super().__init__()
        self.gate_proj = nn.Linear(dim, ffn_dim, bias=False)
        self.up_proj = nn.Linear(dim, ffn_dim, bias=False)
        self.down_proj = nn.Linear(ffn_dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Experts(nn.Module):
    """The experts of one MoE layer as stacked weights (E, 2F, D) and (E, D, F). Tokens are sorted
    by expert once, every expert's rows then run as one grouped matrix product per projection
    (`F.grouped_mm`), and the weighted results are added back to their tokens. Under expert
    parallel (`split`) this rank holds E/N of them and the rows travel to their experts' ranks
    (fsdpkit.train.model.expert_parallel)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.empty(cfg.n_experts, 2 * cfg.ffn_dim, cfg.dim))
        self.down_proj = nn.Parameter(torch.empty(cfg.n_experts, cfg.dim, cfg.ffn_dim))
        self.split: ExpertSplit | None = None   # set by fsdpkit.train.parallel.shard

    def weights(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Both stacks (this rank's experts) in the compute dtype. Autocast covers nn.Linear but not
        grouped products, so one process under autocast (fp32 weights, bf16 activations) casts here,
        as do expert-parallel weights (FSDP does not manage them); under FSDP's bf16 parameters, and
        in fp32, this is a no-op."""
        stacks = [w.to_local() if isinstance(w, DTensor) else w for w in (self.gate_up_proj, self.down_proj)]
        return stacks[0].to(dtype), stacks[1].to(dtype)

    def forward(self, x: torch.Tensor, top_idx: torch.Tensor, top_w: torch.Tensor,
                counts: torch.Tensor | None = None) -> torch.Tensor:
        """x (N, D), each token's top-k experts and weights (N, k); `counts`: tokens per expert."""
        if self.split is None and not grouped_mm_supported(x):
            return self.forward_loop(x, top_idx, top_w)
        k = top_idx.shape[1]
        order = torch.argsort(top_idx.reshape(-1), stable=True)  # (token, slot) pairs sorted by expert
        token = order // k
        if counts is None:
            counts = tokens_per_expert(top_idx, self.gate_up_proj.shape[0])
        rows = x[token]
        h = self.run(rows, counts) if self.split is None else self.split.exchange(rows, counts, self.run)
        weight = top_w.reshape(-1)[order, None]
        return torch.zeros_like(x).index_add_(0, token, (h * weight).to(x.dtype))

    def run(self, rows: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """SwiGLU of `rows`, sorted by (this rank's) expert, `counts` rows each."""
        w_gate_up, w_down = self.weights(rows.dtype)
        if not grouped_mm_supported(rows):   # expert parallel without grouped products: expert by expert
            parts = torch.split(rows, counts.tolist())
            return torch.cat([F.linear(F.silu(g) * u, w_down[e]) for e, part in enumerate(parts)
                              for g, u in [F.linear(part, w_gate_up[e]).chunk(2, dim=-1)]])
        offs = counts.cumsum(0).to(torch.int32)
        gate, up = F.grouped_mm(rows, w_gate_up.transpose(-2, -1), offs=offs).chunk(2, dim=-1)
        return F.grouped_mm(F.silu(gate) * up, w_down.transpose(-2, -1), offs=offs)

    def forward_loop(self, x: torch.Tensor, top_idx: torch.Tensor, top_w: torch.Tensor) -> torch.Tensor:
        """One expert at a time: where grouped products are not available, and the reference the
        grouped path is tested against."""
        out = torch.zeros_like(x)
        w_gate_up, w_down = self.weights(x.dtype)
        for e in range(w_gate_up.shape[0]):
            token, slot = torch.where(top_idx == e)
            if token.numel() == 0:
                continue
            gate, up = F.linear(x[token], w_gate_up[e]).chunk(2, dim=-1)
            h = F.linear(F.silu(gate) * up, w_down[e])
            out.index_add_(0, token, (h * top_w[token, slot, None]).to(out.dtype))
        return out


def tokens_per_expert(top_idx: torch.Tensor, n_experts: int) -> torch.Tensor:
    """(E,) routed slots per expert. A one-hot sum, not bincount: its shape is static, which
    torch.compile needs."""
    return F.one_hot(top_idx.reshape(-1), n_experts).sum(dim=0)


def grouped_mm_supported(x: torch.Tensor) -> bool:
    """Grouped products run on the CPU (fp32, bf16) and on CUDA in bf16 from sm80 (Ampere) on;
    elsewhere (fp32 on a GPU, older GPUs, older torch) the experts run one at a time."""
    if not hasattr(F, "grouped_mm"):
        return False
    if x.device.type == "cpu":
        return True
    return bool(x.device.type == "cuda" and x.dtype == torch.bfloat16
                and torch.cuda.get_device_capability(x.device)[0] >= 8)


class MoE(nn.Module):
    """Mixtral sparse MLP: softmax router, top-k experts, weights renormalised over the chosen k."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.n_experts, self.top_k = cfg.n_experts, cfg.experts_per_token
        self.gate = nn.Linear(cfg.dim, cfg.n_experts, bias=False)
        self.experts = Experts(cfg)
        self.load: torch.Tensor | None = None          # routed slots per expert in the last forward
        self.router_prob: torch.Tensor | None = None   # mean routing probability per expert (with grad)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, D = x.shape
        flat = x.reshape(-1, D)
        probs = F.softmax(self.gate(flat).float(), dim=-1)
        top_w, top_idx = torch.topk(probs, self.top_k, dim=-1)
        top_w = (top_w / top_w.sum(dim=-1, keepdim=True)).to(x.dtype)
        counts = tokens_per_expert(top_idx, self.n_experts)
        self.load = counts.detach()  # what the trainer reports as expert load, and the balancing loss reads
        self.router_prob = probs.mean(dim=0)
        return self.experts(flat, top_idx, top_w, counts).view(B, T, D)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.mlp = MoE(cfg) if cfg.is_moe else MLP(cfg.dim, cfg.ffn_dim)
        self.checkpoint = False  # set by fsdpkit.train.parallel.shard.apply_activation_checkpointing

    def _forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                 mask: AttentionMask | None) -> torch.Tensor:
        h = x + self.self_attn(self.input_layernorm(x), cos, sin, mask)
        return h + self.mlp(self.post_attention_layernorm(h))

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                mask: AttentionMask | None = None) -> torch.Tensor:
        if self.checkpoint and torch.is_grad_enabled():
            return torch.utils.checkpoint.checkpoint(self._forward, x, cos, sin, mask, use_reentrant=False)
        return self._forward(x, cos, sin, mask)


class Model(nn.Module):
    """The decoder stack without the output head (Hugging Face's `LlamaModel`)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        # padding_idx: that row's gradient is zero, as in transformers (it would otherwise take the
        # gradient of every padded position and dominate clipping).
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.dim, padding_idx=cfg.pad_token_id)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)


class Transformer(nn.Module):
    """Decoder-only language model. `rope_len` sizes the RoPE table (the training sequence length)."""

    rope_cos: torch.Tensor   # buffers (register_buffer), declared for the type checker
    rope_sin: torch.Tensor

    def __init__(self, cfg: ModelConfig, rope_len: int | None = None):
        super().__init__()
        self.cfg = cfg
        self.rope_len = rope_len or cfg.max_seq_len
        self.model = Model(cfg)
        self.lm_head = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        self.loss_chunk_tokens: int | None = None  # set by fsdpkit.train.parallel.shard from the config
        self.split: SequenceSplit | None = None   # context parallel: see split_sequences
        if cfg.tie_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        # Derived from the config, so not saved in checkpoints; init_weights fills them.
        self.register_buffer("rope_cos", torch.empty(self.rope_len, cfg.head_size // 2), persistent=False)
        self.register_buffer("rope_sin", torch.empty(self.rope_len, cfg.head_size // 2), persistent=False)

    # -- initialisation ---------------------------------------------------------------------------
    def to_empty(self, *, device: torch.device | str | int | None, recurse: bool = True) -> Transformer:
        super().to_empty(device=device, recurse=recurse)
        # Moving off the meta device replaces each module's Parameter, which unties a shared head
        # (FSDP2 swaps tensors in place and keeps it): tie it again.
        if self.cfg.tie_embeddings and self.lm_head.weight is not self.model.embed_tokens.weight:
            self.lm_head.weight = self.model.embed_tokens.weight
        return self

    def init_std(self, name: str) -> float | None:
        """Standard deviation a parameter is initialised with; None for RMSNorm weights (ones) and
        0 for biases."""
        if name.endswith("norm.weight"):
            return None
        if name.endswith((".bias", "lora_B.weight")):   # LoRA's B at zero: the adapted model starts as the base
            return 0.0
        std = self.cfg.init_std
        if name.endswith(("o_proj.weight", "down_proj.weight", "experts.down_proj")):
            # Residual-branch outputs scaled by depth (GPT-2), so activations stay O(1) at any depth.
            std = std / math.sqrt(2 * self.cfg.n_layers)
        return std

    @torch.no_grad()
    def init_weights(self, seed: int = 0, fill: Callable[..., None] | None = None) -> None:
        """Initialise every parameter and buffer on the device they live on.

        Each parameter draws from its own generator, seeded by `seed` and its name, so values do
        not depend on the order of initialisation or on how the model is sharded. `fill` receives
        (param, init_fn) and writes init_fn's full-size result into a sharded parameter
        (see fsdpkit.train.parallel.shard); the default fills a plain tensor in place.
        """
        fill = fill or _fill_plain
        for name, p in self.named_parameters():
            # LoRA's A at PEFT's scale (its Kaiming-uniform bound, 1/sqrt(fan-in), as a normal's std).
            std = p.shape[1] ** -0.5 if name.endswith("lora_A.weight") else self.init_std(name)
            if std is None:
                fill(p, lambda t: t.fill_(1.0))
            elif std == 0.0:
                fill(p, lambda t: t.zero_())
            else:
                gen_seed = (seed * 1_000_003 + zlib.crc32(name.encode())) % (2**63)
                fill(p, _trunc_normal(std, gen_seed))
        self.init_buffers()

    @torch.no_grad()
    def init_buffers(self) -> None:
        freqs = torch.outer(torch.arange(self.rope_len, dtype=torch.float32), rope_frequencies(self.cfg))
        self.rope_cos.copy_(freqs.cos())
        self.rope_sin.copy_(freqs.sin())

    def split_sequences(self, split: SequenceSplit | None) -> None:
        """Context parallel (fsdpkit.train.model.context): every rank of `split`'s group is given the
        same whole sequences and computes its slice of them; None: this rank computes them whole."""
        self.split = split
        for layer in self.blocks():
            layer.self_attn.split = split

    # -- forward ----------------------------------------------------------------------------------
    def hidden_states(self, tokens: torch.Tensor, eos_id: int | None = None,
                      docs: torch.Tensor | None = None) -> torch.Tensor:
        """The last block's output, before the final norm: of this rank's slice of each sequence
        under context parallel, where the mask and positions are still the whole sequence's."""
        T = tokens.shape[1]
        if self.rope_len < T:
            raise ValueError(f"sequence of {T} tokens is longer than the RoPE table ({self.rope_len})")
        cos, sin = self.rope_cos[:T], self.rope_sin[:T]
        mask = self.attention_mask(tokens, eos_id, docs)
        if self.split is not None:
            tokens, cos, sin = self.split.local(tokens), self.split.local(cos, 0), self.split.local(sin, 0)
        h = self.model.embed_tokens(tokens)
        if torch.is_autocast_enabled(h.device.type):
            # One process under autocast: carry the residual stream in the compute dtype, as FSDP's
            # bf16 parameters make it, rather than in fp32 (half the activation memory and traffic).
            h = h.to(torch.get_autocast_dtype(h.device.type))
        for layer in self.model.layers:
            h = layer(h, cos, sin, mask)
        return h

    def attention_mask(self, tokens: torch.Tensor, eos_id: int | None,
                       docs: torch.Tensor | None = None) -> AttentionMask | None:
        """The batch's mask beyond causality, built once for every layer: packed documents (`docs`,
        each token's document, as chat data brings them; or found at each `eos_id`) and the sliding
        window where it is shorter than the sequence; None for neither."""
        T, w = tokens.shape[1], self.cfg.sliding_window
        window = w if w is not None and w < T else None
        if docs is None and eos_id is not None:
            docs = document_ids(tokens, eos_id)
        if docs is None and window is None:
            return None
        mask = AttentionMask(T, docs, window)
        if tokens.device.type == "cuda":
            mask.block_mask(tokens.device)  # here, outside the compiled blocks, once per batch
        return mask

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor | None = None, eos_id: int | None = None,
                docs: torch.Tensor | None = None,
                per_token: bool = False) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Logits (B, T, vocab) for (B, T) token ids; with `targets`, the loss instead (see `loss`),
        or with `per_token` each target's log-probability (see `token_logps`). With `eos_id` or
        `docs` (B, T), attention stays within documents.

        The loss is computed here, inside forward, so that under FSDP the output head's gathered
        weight is still in place when the chunked cross-entropy runs."""
        h = self.hidden_states(tokens, eos_id, docs)
        if targets is None:
            return self.lm_head(self.model.norm(h))
        if per_token:
            h = self.model.norm(h)
            nll = chunked_token_nll(self.lm_head, h.flatten(0, 1), targets.flatten(), self.loss_chunk_tokens)
            return -nll.view(targets.shape)
        ce = self.output_loss(h, targets)
        total = ce
        if self.cfg.is_moe:
            total = ce + self.cfg.router_aux_loss_coef * self.balancing_loss(tokens.numel())
        return ce, total

    def balancing_loss(self, n_tokens: int) -> torch.Tensor:
        """Switch-Transformer load balancing as transformers' Mixtral defines it, so that
        `router_aux_loss_coef` means what it means in a Mixtral config: over every layer's tokens,
        n_experts * sum_e(routed slots to e per token * mean routing probability of e); k (top-k)
        when perfectly balanced."""
        layers = self._moe_layers()
        loads = [m.load for m in layers if m.load is not None]
        slots = torch.stack(loads).sum(dim=0).float() / (n_tokens * len(layers))
        prob = torch.stack([m.router_prob for m in layers if m.router_prob is not None]).mean(dim=0)
        return self.cfg.n_experts * (slots * prob).sum()

    def expert_load(self) -> torch.Tensor | None:
        """Routed slots per expert in the last forward, summed over layers; None without MoE."""
        loads = [m.load for m in self._moe_layers() if m.load is not None] if self.cfg.is_moe else []
        return torch.stack(loads).sum(dim=0) if loads else None

    def _moe_layers(self) -> list[MoE]:
        return [layer.mlp for layer in self.blocks() if isinstance(layer.mlp, MoE)]

    def blocks(self) -> list[DecoderLayer]:
        """The decoder blocks, in order (what activation checkpointing, compile and FSDP wrap)."""
        return [cast(DecoderLayer, layer) for layer in self.model.layers]

    def output_loss(self, h: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Final norm, output head and mean cross-entropy: one method, so that `--compile` can fuse
        the norm and the loss's elementwise work as it does each block's. Under context parallel,
        this rank's share of its group's mean, times the group's size (fsdpkit.train.model.context)."""
        h = self.model.norm(h)
        if self.split is None:
            return chunked_cross_entropy(self.lm_head, h.flatten(0, 1), targets.flatten(), self.loss_chunk_tokens)
        targets = self.split.local(targets).flatten()
        count = self.split.total((targets != -100).sum()).clamp(min=1)
        return self.split.size * chunked_ce_sum(self.lm_head, h.flatten(0, 1), targets, self.loss_chunk_tokens) / count

    def loss(self, tokens: torch.Tensor, targets: torch.Tensor, eos_id: int | None = None,
             docs: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Mean next-token cross-entropy over the targets that are not -100, and the total loss
        (cross-entropy plus MoE balancing)."""
        return cast("tuple[torch.Tensor, torch.Tensor]", self(tokens, targets, eos_id, docs))

    def token_logps(self, tokens: torch.Tensor, targets: torch.Tensor,
                    docs: torch.Tensor | None = None) -> torch.Tensor:
        """(B, T): log p(target | tokens up to it) for each target, 0 where the target is -100
        (what a preference loss sums per sequence)."""
        return cast(torch.Tensor, self(tokens, targets, None, docs, per_token=True))


def chunked_cross_entropy(head: nn.Linear, h: torch.Tensor, targets: torch.Tensor, chunk: int | None) -> torch.Tensor:
    """Mean cross-entropy of head(h) against targets (-100 ignored) without materialising the full
    (tokens x vocab) fp32 logits: each chunk's logits are computed, reduced and dropped, and
    recomputed in backward (activation checkpointing of the head), so the peak holds one chunk."""
    return chunked_ce_sum(head, h, targets, chunk) / (targets != -100).sum().clamp(min=1)


def chunked_ce_sum(head: nn.Linear, h: torch.Tensor, targets: torch.Tensor, chunk: int | None) -> torch.Tensor:
    """The summed cross-entropy `chunked_cross_entropy` divides by the target count."""
    n = h.shape[0]
    size = loss_chunk_size(head.out_features, chunk)
    if size == 0 or size >= n:
        return _ce_sum(head, h, targets)
    total = h.new_zeros((), dtype=torch.float32)
    for start in range(0, n, size):
        part = slice(start, start + size)
        total = total + torch.utils.checkpoint.checkpoint(_ce_sum, head, h[part], targets[part], use_reentrant=False)
    return total


def chunked_token_nll(head: nn.Linear, h: torch.Tensor, targets: torch.Tensor, chunk: int | None) -> torch.Tensor:
    """Each target's negative log-likelihood under head(h) (0 where -100), chunked as
    `chunked_cross_entropy` is, so the full logits are never held at once."""
    size = loss_chunk_size(head.out_features, chunk)
    if size == 0 or size >= h.shape[0]:
        return _nll(head, h, targets)
    return torch.cat([torch.utils.checkpoint.checkpoint(_nll, head, h[i:i + size], targets[i:i + size],
                                                        use_reentrant=False) for i in range(0, h.shape[0], size)])


def _nll(head: nn.Module, h: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(head(h).float(), targets, ignore_index=-100, reduction="none")


def _ce_sum(head: nn.Module, h: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(head(h).float(), targets, ignore_index=-100, reduction="sum")


def _fill_plain(p: torch.Tensor, init_fn: Callable[[torch.Tensor], object]) -> None:
    init_fn(p)


def _trunc_normal(std: float, seed: int) -> Callable[[torch.Tensor], None]:
    def init(t: torch.Tensor) -> None:
        gen = torch.Generator(device=t.device).manual_seed(seed)
        nn.init.trunc_normal_(t, mean=0.0, std=std, a=-3 * std, b=3 * std, generator=gen)

    return init
