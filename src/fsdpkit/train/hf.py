"""Hugging Face `config.json` for a model config.

Parameter names already match `transformers` (v5) so a state dict maps one to one; this module
holds the config side. Keys are the long-standing ones (`rope_scaling`, `rope_theta`), which
transformers v4 reads as is and v5 converts on load.
"""

from __future__ import annotations

from typing import Any

from fsdpkit.train.model import ModelConfig

ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "mixtral": "MixtralForCausalLM"}


def hf_config_dict(cfg: ModelConfig) -> dict[str, Any]:
    family = "mixtral" if cfg.is_moe else cfg.family
    out: dict[str, Any] = {
        "architectures": [ARCHITECTURES[family]],
        "model_type": family,
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.dim,
        "intermediate_size": cfg.ffn_dim,
        "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.n_kv_heads,
        "head_dim": cfg.head_dim,
        "max_position_embeddings": cfg.max_seq_len,
        "rms_norm_eps": cfg.norm_eps,
        "rope_theta": cfg.rope_theta,
        "tie_word_embeddings": cfg.tie_embeddings,
        "hidden_act": "silu",
        "initializer_range": cfg.init_std,
        "attention_bias": False,
        "attention_dropout": 0.0,
    }
    if cfg.rope_scaling is not None:
        s = cfg.rope_scaling
        out["rope_scaling"] = {
            "rope_type": "llama3", "factor": s.factor, "low_freq_factor": s.low_freq_factor,
            "high_freq_factor": s.high_freq_factor,
            "original_max_position_embeddings": s.original_max_position_embeddings,
        }
    if family in ("mistral", "mixtral"):
        out["sliding_window"] = cfg.sliding_window
    if family == "mixtral":
        out.update(num_local_experts=cfg.n_experts, num_experts_per_tok=cfg.experts_per_token,
                   router_aux_loss_coef=cfg.router_aux_loss_coef)
    return out
