"""Named model configurations with the dimensions of the published models.

The large presets are the ones the reference FSDP example ships; `tiny` and `debug` are sized for
CPU tests and for `make run` (byte-level vocabulary of the embedded tokenizer).
"""

from __future__ import annotations

from fsdpkit.errors import UserError
from fsdpkit.train.model_config import ModelConfig, RopeScaling

_LLAMA31_SCALING = RopeScaling(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0)
_LLAMA32_SCALING = RopeScaling(factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0)

PRESETS: dict[str, ModelConfig] = {
    # Sized for a laptop CPU: learns visibly from bytes within a couple of minutes.
    "tiny": ModelConfig(
        vocab_size=258, dim=128, n_layers=4, n_heads=4, n_kv_heads=2, ffn_dim=352, max_seq_len=256,
        rope_theta=10000.0,
    ),
    # Same shape family as the big presets (GQA, untied head), small enough for CPU benchmarks.
    "debug": ModelConfig(
        vocab_size=258, dim=256, n_layers=4, n_heads=8, n_kv_heads=4, ffn_dim=688, max_seq_len=512,
        rope_theta=10000.0,
    ),
    "llama2_7b": ModelConfig(
        vocab_size=32000, dim=4096, n_layers=32, n_heads=32, n_kv_heads=32, ffn_dim=11008,
        max_seq_len=4096, rope_theta=10000.0,
    ),
    "llama2_13b": ModelConfig(
        vocab_size=32000, dim=5120, n_layers=40, n_heads=40, n_kv_heads=40, ffn_dim=13824,
        max_seq_len=4096, rope_theta=10000.0,
    ),
    "llama2_70b": ModelConfig(
        vocab_size=32000, dim=8192, n_layers=80, n_heads=64, n_kv_heads=8, ffn_dim=28672,
        max_seq_len=4096, rope_theta=10000.0,
    ),
    "llama3_1_8b": ModelConfig(
        vocab_size=128256, dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, ffn_dim=14336,
        max_seq_len=131072, rope_theta=500000.0, rope_scaling=_LLAMA31_SCALING,
    ),
    "llama3_1_70b": ModelConfig(
        vocab_size=128256, dim=8192, n_layers=80, n_heads=64, n_kv_heads=8, ffn_dim=28672,
        max_seq_len=131072, rope_theta=500000.0, rope_scaling=_LLAMA31_SCALING,
    ),
    "llama3_2_1b": ModelConfig(
        vocab_size=128256, dim=2048, n_layers=16, n_heads=32, n_kv_heads=8, ffn_dim=8192,
        max_seq_len=131072, rope_theta=500000.0, rope_scaling=_LLAMA32_SCALING, tie_embeddings=True,
    ),
    "llama3_2_3b": ModelConfig(
        vocab_size=128256, dim=3072, n_layers=28, n_heads=24, n_kv_heads=8, ffn_dim=8192,
        max_seq_len=131072, rope_theta=500000.0, rope_scaling=_LLAMA32_SCALING, tie_embeddings=True,
    ),
    # Mathstral 7B v0.1: the Mistral 7B architecture with a 32k context and no sliding window.
    "mathstral_7b": ModelConfig(
        vocab_size=32768, dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, ffn_dim=14336,
        max_seq_len=32768, rope_theta=1000000.0, family="mistral",
    ),
    "mixtral_8x7b": ModelConfig(
        vocab_size=32000, dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, ffn_dim=14336,
        max_seq_len=32768, rope_theta=1000000.0, n_experts=8, experts_per_token=2, family="mixtral",
    ),
}

# Names the reference's job files use for the same models.
ALIASES = {"mistral_8x7b": "mixtral_8x7b", "mashtral_7b": "mathstral_7b"}


def get_preset(name: str) -> ModelConfig:
    key = ALIASES.get(name, name)
    if key not in PRESETS:
        raise UserError(f"preset: unknown preset {name!r}; choose one of: {', '.join(PRESETS)}")
    return PRESETS[key]
