"""Hugging Face config.json both ways, without torch: configuration and the planner read a
checkpoint's shape before anything is built."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from fsdpkit.errors import UserError
from fsdpkit.readers import reading
from fsdpkit.train.model.config import ModelConfig, RopeScaling, family_attention

ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "mixtral": "MixtralForCausalLM",
                 "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM"}
# The families whose configs carry a per-layer sliding-window switch (use_sliding_window, off in
# every published checkpoint) rather than Mistral's plain window.
QWEN = ("qwen2", "qwen3", "qwen3_moe")
# The families whose models are mixtures of experts, each with its own config fields.
MOE = ("mixtral", "qwen3_moe")


def hf_config_dict(cfg: ModelConfig) -> dict[str, Any]:
    if cfg.family in MOE and not cfg.is_moe:
        # transformers would load such a config with freshly initialised experts, warning only.
        raise UserError(f"export: the model is of the {cfg.family} family but has no experts (n_experts 0): a "
                        f"{ARCHITECTURES[cfg.family]} needs them; train with --n-experts, or as --model_type llama")
    family = cfg.family if cfg.family in MOE or not cfg.is_moe else "mixtral"
    fixed = family_attention(family)
    if (cfg.qkv_bias, cfg.qk_norm) != (fixed["qkv_bias"], fixed["qk_norm"]):
        has = ", ".join(f"{k} {int(getattr(cfg, k))}" for k in fixed)
        raise UserError(f"export: the model was trained with {has}, which a {ARCHITECTURES[family]} cannot hold "
                        f"(its class has {', '.join(f'{k} {int(v)}' for k, v in fixed.items())}); train it with "
                        "the family's own attention (leave --qkv-bias and --qk-norm unset)")
    out: dict[str, Any] = {
        "architectures": [ARCHITECTURES[family]],
        "model_type": family,
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.dim,
        "intermediate_size": cfg.ffn_dim,
        "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.n_kv_heads,
        "head_dim": cfg.head_size,
        "max_position_embeddings": cfg.max_seq_len,
        "rms_norm_eps": cfg.norm_eps,
        "rope_theta": cfg.rope_theta,
        "tie_word_embeddings": cfg.tie_embeddings,
        "hidden_act": "silu",
        "initializer_range": cfg.init_std,
        "attention_dropout": 0.0,
    }
    if cfg.pad_token_id is not None:
        out["pad_token_id"] = cfg.pad_token_id
    if family != "qwen2":  # Qwen 2's biases are fixed by its class (query, key, value: always)
        out["attention_bias"] = False
    if cfg.rope_scaling is not None:
        s = cfg.rope_scaling
        out["rope_scaling"] = {"rope_type": s.rope_type, "factor": s.factor}
        if s.rope_type == "llama3":
            out["rope_scaling"].update(low_freq_factor=s.low_freq_factor, high_freq_factor=s.high_freq_factor,
                                       original_max_position_embeddings=s.original_max_position_embeddings)
    if family in ("mistral", "mixtral"):
        out["sliding_window"] = cfg.sliding_window
    if family in QWEN:
        out.update(use_sliding_window=False, sliding_window=None, max_window_layers=cfg.n_layers)
    if family == "mixtral":
        out.update(num_local_experts=cfg.n_experts, num_experts_per_tok=cfg.experts_per_token,
                   router_aux_loss_coef=cfg.router_aux_loss_coef)
    if family == "qwen3_moe":
        # Every layer sparse (no dense layers among them), the top-k weights renormalised: as fsdpkit's MoE.
        out.update(moe_intermediate_size=cfg.ffn_dim, num_experts=cfg.n_experts,
                   num_experts_per_tok=cfg.experts_per_token, norm_topk_prob=True, decoder_sparse_step=1,
                   mlp_only_layers=[], router_aux_loss_coef=cfg.router_aux_loss_coef)
    return out


def exported_config(cfg: ModelConfig, source: dict[str, Any] | None) -> dict[str, Any]:
    """config.json of an export: the one the run was imported from (`source`), with what training
    changed (the fields whose rendering of `cfg` differs from that of the imported shape) and
    nothing else; the family's own rendering where the run did not start from a Hugging Face model."""
    ours = hf_config_dict(cfg)
    if source is None:
        return ours
    imported = hf_config_dict(shape_of_config(source))
    dropped = imported.keys() - ours.keys()   # what the trained shape no longer has (another family's fields)
    out = {k: v for k, v in source.items() if k not in dropped}
    out.update({k: v for k, v in ours.items() if k not in imported or imported[k] != v})
    return out


ROPE_TYPES = ("default", "llama3", "linear")


def refuse_unrepresentable(c: dict[str, Any], family: str) -> None:
    """A config field our model would silently drop is an error: training would start from
    different weights or a different function than the checkpoint's, with nothing said."""
    if c.get("attention_bias") or c.get("mlp_bias"):
        which = " and ".join(k for k in ("attention_bias", "mlp_bias") if c.get(k))
        raise UserError(f"init_from_hf: the checkpoint uses {which}, which fsdpkit's model has no place for; its "
                        "biases would be dropped (pick a checkpoint without biases)")
    if family in QWEN and c.get("use_sliding_window"):
        raise UserError("init_from_hf: the checkpoint turns on use_sliding_window (a window on some layers only), "
                        "which fsdpkit's model does not support; every published Qwen checkpoint has it off")
    rope = c.get("rope_scaling") or c.get("rope_parameters") or {}
    kind = rope.get("rope_type", rope.get("type")) or "default"
    if kind not in ROPE_TYPES:
        raise UserError(f"init_from_hf: rope scaling {kind!r} is not supported (supported: {', '.join(ROPE_TYPES)}); "
                        "positions would be encoded differently from the checkpoint's")
    arch = [a for a in c.get("architectures") or [] if a != ARCHITECTURES[family]]
    if arch:
        raise UserError(f"init_from_hf: architecture {arch[0]} is not supported (supported: "
                        f"{', '.join(ARCHITECTURES.values())})")
    if family == "qwen3_moe" and (c.get("norm_topk_prob") is False or c.get("decoder_sparse_step", 1) != 1
                                  or c.get("mlp_only_layers")):
        raise UserError("init_from_hf: the checkpoint has dense layers among its expert layers (decoder_sparse_step, "
                        "mlp_only_layers) or leaves the top-k routing weights unnormalised (norm_topk_prob false), "
                        "which fsdpkit's MoE does not; every published Qwen3-MoE checkpoint has neither")
    if c.get("hidden_act", "silu") != "silu":
        raise UserError(f"init_from_hf: hidden_act {c['hidden_act']!r} is not supported (fsdpkit's MLP is "
                        "SwiGLU: silu)")


_REQUIRED: Any = object()
_ROPE = "config.json's rope_scaling"


def _number(c: dict[str, Any], key: str, kind: type[int] | type[float], default: Any = _REQUIRED, low: float = 1,
            at: str = "config.json") -> Any:
    """A number config.json gives: of its kind and at least `low`, else a one-line error naming the
    field (a string where a size belongs would fail deep inside the model as a traceback)."""
    value = c.get(key) if isinstance(c, dict) else None
    if value is None:
        if default is _REQUIRED:
            raise UserError(f"init_from_hf: {at} has no {key}; a Hugging Face config of this family gives one")
        return default
    ok = isinstance(value, int | float) and not isinstance(value, bool) and (kind is float or isinstance(value, int))
    if not ok or not value >= low:
        what = "an integer" if kind is int else "a number"
        raise UserError(f"init_from_hf: {at}'s {key} is {value!r}; expected {what} >= {low:g}")
    return kind(value)


def read_config(path: Path) -> dict[str, Any]:
    """A Hugging Face model directory's config.json, as a mapping."""
    cfg_file = path / "config.json"
    if not cfg_file.is_file():
        raise UserError(f"init_from_hf: no config.json in {path}")
    with reading(cfg_file, "init_from_hf"):
        c = json.loads(cfg_file.read_text())
    if not isinstance(c, dict):
        raise UserError(f"init_from_hf: {cfg_file} holds no mapping; point at a Hugging Face model directory")
    return c


def model_config_from_hf(path: Path) -> ModelConfig:
    """Our ModelConfig from a Hugging Face config.json (Llama, Mistral, Mixtral, Qwen 2 / 2.5, Qwen 3, Qwen3-MoE)."""
    return shape_of_config(read_config(path))


def shape_of_config(c: dict[str, Any]) -> ModelConfig:
    """Our ModelConfig from a config.json's mapping."""
    family = c.get("model_type")
    if family not in ARCHITECTURES:
        raise UserError(f"init_from_hf: model_type {family!r} is not one of {', '.join(ARCHITECTURES)}")
    refuse_unrepresentable(c, family)
    rope = c.get("rope_scaling") or c.get("rope_parameters") or {}
    theta = _number(c, "rope_theta", float, None, low=0) or _number(rope, "rope_theta", float, 10000.0, low=0, at=_ROPE)
    scaling = None
    kind = rope.get("rope_type", rope.get("type")) or "default"
    if kind == "llama3":
        low, high = (_number(rope, k, float, low=0, at=_ROPE) for k in ("low_freq_factor", "high_freq_factor"))
        scaling = RopeScaling(_number(rope, "factor", float, at=_ROPE), low, high,
                              _number(rope, "original_max_position_embeddings", int, at=_ROPE))
    elif kind == "linear":
        scaling = RopeScaling(_number(rope, "factor", float, at=_ROPE), rope_type="linear")
    heads = _number(c, "num_attention_heads", int)
    hidden = _number(c, "hidden_size", int)
    head_dim = _number(c, "head_dim", int, None)
    n_experts = 0
    if family == "mixtral":
        n_experts = _number(c, "num_local_experts", int, 0, low=0)
    elif family == "qwen3_moe":   # the hub's configs say num_experts; transformers 5 writes num_local_experts
        n_experts = _number(c, "num_experts" if "num_experts" in c else "num_local_experts", int)
    window = _number(c, "sliding_window", int, None) if family in ("mistral", "mixtral") else None
    vocab = _number(c, "vocab_size", int)
    pad = _number(c, "pad_token_id", int, None, low=-vocab)   # negative: from the end, as nn.Embedding has it
    if pad is not None and pad >= vocab:
        raise UserError(f"init_from_hf: config.json's pad_token_id is {pad}; expected a token id below its "
                        f"vocab_size ({vocab})")
    return ModelConfig(
        vocab_size=vocab, dim=hidden, n_layers=_number(c, "num_hidden_layers", int),
        n_heads=heads, n_kv_heads=_number(c, "num_key_value_heads", int, heads),
        ffn_dim=_number(c, "moe_intermediate_size" if family == "qwen3_moe" else "intermediate_size", int),
        max_seq_len=_number(c, "max_position_embeddings", int, 4096),
        rope_theta=float(theta), rope_scaling=scaling, norm_eps=_number(c, "rms_norm_eps", float, 1e-5, low=0),
        tie_embeddings=bool(c.get("tie_word_embeddings", False)), sliding_window=window, n_experts=n_experts,
        experts_per_token=_number(c, "num_experts_per_tok", int, 2),
        router_aux_loss_coef=_number(c, "router_aux_loss_coef", float, 0.001 if family == "qwen3_moe" else 0.02,
                                     low=0),
        init_std=_number(c, "initializer_range", float, 0.02, low=0), family=family,
        head_dim=head_dim if head_dim not in (None, hidden // heads) else None,
        **family_attention(family), pad_token_id=pad,
    )
