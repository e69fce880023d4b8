"""The model's shape as plain data (no torch), so configuration, presets and job specs can be read
and checked without importing torch."""

from __future__ import annotations

from dataclasses import dataclass

from fsdpkit.errors import UserError

# QLoRA's NF4 (fsdpkit.train.model.nf4): an absmax scaler per 64 elements, the scalers quantized to
# int8 in groups of 256; a shard must hold whole groups.
NF4_BLOCK = 64
NF4_SCALER_BLOCK = 256
NF4_GRAIN = NF4_BLOCK * NF4_SCALER_BLOCK


@dataclass(frozen=True)
class RopeScaling:
    """RoPE frequency scaling as Hugging Face configs name it: `llama3` (Llama 3.1's smooth
    per-band scaling; the fields below) or `linear` (position interpolation: every frequency
    divided by `factor`)."""

    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    rope_type: str = "llama3"


@dataclass(frozen=True)
class LoraShape:
    """What a LoRA adapter set is (fsdpkit.train.model.lora): rank, scale numerator, dropout and
    the projections it adapts."""

    rank: int
    alpha: float
    dropout: float
    targets: tuple[str, ...]
    base_dtype: str = "auto"   # the frozen base's storage: "auto" (the parameters' dtype) or "nf4" (QLoRA)

    @property
    def scale(self) -> float:
        return self.alpha / self.rank

    @property
    def nf4(self) -> bool:
        """QLoRA: the frozen base's projections held in NF4 (fsdpkit.train.model.nf4)."""
        return self.base_dtype == "nf4"


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    ffn_dim: int
    max_seq_len: int
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    norm_eps: float = 1e-5
    tie_embeddings: bool = False
    sliding_window: int | None = None  # Mistral: attend to at most this many previous tokens
    n_experts: int = 0  # Mixtral: 0 means a dense SwiGLU MLP
    experts_per_token: int = 2
    router_aux_loss_coef: float = 0.02
    init_std: float = 0.02
    family: str = "llama"  # llama | mistral | mixtral | qwen2 | qwen3 | qwen3_moe: the weights' Hugging Face class
    head_dim: int | None = None  # Qwen 3: heads wider than dim / n_heads; None: dim / n_heads
    qkv_bias: bool = False  # Qwen 2 / 2.5: biases on the query, key and value projections
    qk_norm: bool = False   # Qwen 3: RMSNorm over each head of queries and keys, before RoPE
    # The padding token's embedding row, as transformers builds it (padding_idx): it takes no gradient.
    # Read from a Hugging Face config.json; None: every row trains.
    pad_token_id: int | None = None

    @property
    def head_size(self) -> int:
        """Width of each attention head: head_dim where given, else dim / n_heads."""
        return self.head_dim or self.dim // self.n_heads

    @property
    def is_moe(self) -> bool:
        return self.n_experts > 0


# What each family's Hugging Face class fixes of its attention (qkv_bias, qk_norm): Qwen 2's biased
# query/key/value projections, Qwen 3's per-head q/k norms; the other families have neither.
FAMILY_ATTENTION = {"qwen2": (True, False), "qwen3": (False, True), "qwen3_moe": (False, True)}


def family_attention(family: str) -> dict[str, bool]:
    qkv_bias, qk_norm = FAMILY_ATTENTION.get(family, (False, False))
    return {"qkv_bias": qkv_bias, "qk_norm": qk_norm}


def count_params(cfg: ModelConfig, active: bool = False) -> int:
    """Parameter count from the config alone; `active` counts only the experts a token uses."""
    D, F_, L, V = cfg.dim, cfg.ffn_dim, cfg.n_layers, cfg.vocab_size
    q, kv = cfg.n_heads * cfg.head_size, cfg.n_kv_heads * cfg.head_size
    attn = 2 * D * q + 2 * D * kv + (q + 2 * kv if cfg.qkv_bias else 0) + (2 * cfg.head_size if cfg.qk_norm else 0)
    experts = cfg.experts_per_token if active else cfg.n_experts
    mlp = 3 * D * F_ * experts + D * cfg.n_experts if cfg.is_moe else 3 * D * F_
    per_layer = attn + mlp + 2 * D
    head = 0 if cfg.tie_embeddings else V * D
    return V * D + L * per_layer + D + head


def params_text(n: int) -> str:
    """A parameter count as people write one: 70.55B, 124.44M."""
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.2f}M"


def loss_chunk_size(vocab_size: int, setting: int | None, compiled: bool = False) -> int:
    """Tokens per cross-entropy chunk: `setting` (0: no chunking), or by default as many as keep
    one chunk's fp32 logits within 256 MiB (about 520 tokens at a 128k vocabulary; a byte-level
    vocabulary never chunks at usual batch sizes). With torch.compile the default is no chunking:
    the compiled loss fuses the fp32 log-softmax into one kernel and keeps only the logits in the
    compute dtype, which on an H100 was both faster and smaller than compiled chunks (figures in
    benchmarks/RESULTS.md)."""
    if setting is not None:
        return setting
    if compiled:
        return 0
    return max(256, 2**28 // (4 * vocab_size))


def projections(m: ModelConfig) -> dict[str, tuple[int, int]]:
    """(out, in) of each dense projection of a decoder block, by name (MoE experts are not Linear)."""
    hd = m.head_size
    attn = {"q_proj": (m.n_heads * hd, m.dim), "k_proj": (m.n_kv_heads * hd, m.dim),
            "v_proj": (m.n_kv_heads * hd, m.dim), "o_proj": (m.dim, m.n_heads * hd)}
    mlp = {} if m.is_moe else {"gate_proj": (m.ffn_dim, m.dim), "up_proj": (m.ffn_dim, m.dim),
                               "down_proj": (m.dim, m.ffn_dim)}
    return {**attn, **mlp}


def nf4_bytes_per_param(dtype_bytes: int = 4) -> float:
    """NF4's storage per parameter: 4-bit codes, an int8 scaler per block, a factor (the weight's
    dtype) per group of scalers."""
    return 0.5 + 1 / NF4_BLOCK + dtype_bytes / NF4_GRAIN


def check_nf4_layout(shape: ModelConfig, shard: int, world: int = 1) -> None:
    """Refuse, in one line, projections that cannot be stored in NF4 sharded over `shard` of
    `world` ranks."""
    if world > 1 and shard == 1:
        # FSDP2 hands a one-rank shard group's parameter over without an all-gather, which torchao's
        # NF4 does not take (measured: its fsdp_post_all_gather gets one tensor of three).
        raise UserError(f"base_dtype: nf4 needs its shards spread over 2 or more ranks; with {world} ranks in "
                        f"{world} replicas each holds the whole base: lower --dp-replicate, or use "
                        "--sharding-strategy full")
    for name, (out, inp) in projections(shape).items():
        if out % shard or (out // shard) * inp % NF4_GRAIN:
            fix = ("use --base-dtype auto for a projection this small" if out * inp % NF4_GRAIN else
                   "use a rank count that divides them so, or --base-dtype auto")
            raise UserError(f"base_dtype: nf4 stores {name} ({out} x {inp}) in blocks of {NF4_GRAIN} elements, and "
                            f"over {shard} shard rank(s) each rank's rows ({out / shard:g} x {inp}) are no whole "
                            f"number of them; {fix}")


def context_layout_error(shape: ModelConfig, seq_len: int, ranks: int) -> str | None:
    """Why this model and sequence length cannot be split over `ranks` context-parallel ranks
    (fsdpkit.train.model.context: equal slices of every sequence, whole heads per rank); None if
    they can."""
    if ranks == 1:
        return None
    if seq_len % ranks:
        return f"{ranks} must divide seq_len ({seq_len}): each rank holds an equal slice of every sequence"
    if shape.n_heads % ranks:
        return (f"{ranks} must divide the model's {shape.n_heads} attention heads: each rank attends with "
                f"1/{ranks} of them")
    if shape.is_moe:
        return ("a mixture-of-experts model's balancing loss counts its experts' load over whole sequences; train "
                "it without --context-parallel")
    return None


def check_context_layout(shape: ModelConfig, seq_len: int, ranks: int) -> None:
    if why := context_layout_error(shape, seq_len, ranks):
        raise UserError(f"context_parallel: {why}")


def expert_layout_error(shape: ModelConfig, ranks: int) -> str | None:
    """Why this model's experts cannot be split over `ranks` expert-parallel ranks
    (fsdpkit.train.model.expert_parallel: whole experts, the same number a rank); None if they can."""
    if ranks == 1:
        return None
    if not shape.is_moe:
        return (f"{shape.family} is a dense model; it has no experts to split (a mixture-of-experts model does: "
                "--family mixtral or qwen3_moe)")
    if shape.n_experts % ranks:
        return (f"{ranks} must divide the model's {shape.n_experts} experts: each rank of a group holds "
                f"1/{ranks} of them")
    return None


def check_expert_layout(shape: ModelConfig, ranks: int) -> None:
    if why := expert_layout_error(shape, ranks):
        raise UserError(f"expert_parallel: {why}")


def expert_degrees(shape: ModelConfig, world: int) -> list[int]:
    """The expert-parallel degrees above 1 a run of `world` ranks can take: they divide the ranks
    and the experts (none for a dense model)."""
    return [n for n in range(2, world + 1) if world % n == 0 and not expert_layout_error(shape, n)]


def context_degrees(shape: ModelConfig, seq_len: int, per_node: int) -> list[int]:
    """The context-parallel degrees above 1 this model and sequence length can take on nodes of
    `per_node` ranks."""
    return [n for n in range(2, per_node + 1) if per_node % n == 0 and not context_layout_error(shape, seq_len, n)]
