"""Hugging Face interop: config.json both ways, safetensors export and sharded import.

Parameter names already match `transformers` (v5) in memory; on disk, MoE experts use the hub's
per-expert layout (below). Config keys are the long-standing ones (`rope_scaling`, `rope_theta`),
which transformers v4 reads as is and v5 converts on load.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from fsdpkit.errors import UserError
from fsdpkit.train.model_config import ModelConfig, RopeScaling

ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "mixtral": "MixtralForCausalLM"}


def hf_config_dict(cfg: ModelConfig) -> dict[str, Any]:
    if cfg.family == "mixtral" and not cfg.is_moe:
        # transformers would load such a config with freshly initialised experts, warning only.
        raise UserError("export: the model is of the mixtral family but has no experts (n_experts 0): a "
                        "MixtralForCausalLM needs them; train with --n_experts, or as --model_type llama")
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
        out["rope_scaling"] = {"rope_type": s.rope_type, "factor": s.factor}
        if s.rope_type == "llama3":
            out["rope_scaling"].update(low_freq_factor=s.low_freq_factor, high_freq_factor=s.high_freq_factor,
                                       original_max_position_embeddings=s.original_max_position_embeddings)
    if family in ("mistral", "mixtral"):
        out["sliding_window"] = cfg.sliding_window
    if family == "mixtral":
        out.update(num_local_experts=cfg.n_experts, num_experts_per_tok=cfg.experts_per_token,
                   router_aux_loss_coef=cfg.router_aux_loss_coef)
    return out


# --- weights on disk (the hub's safetensors layout) ------------------------------------------------
# Dense parameters keep their names. MoE layers are stored per expert, as every Mixtral checkpoint
# on the hub is (and as transformers v5 writes them back):
#   model.layers.N.block_sparse_moe.gate.weight            <- model.layers.N.mlp.gate.weight
#   model.layers.N.block_sparse_moe.experts.E.w1.weight    <- gate_up_proj[E, :F]   (gate)
#   model.layers.N.block_sparse_moe.experts.E.w3.weight    <- gate_up_proj[E, F:]   (up)
#   model.layers.N.block_sparse_moe.experts.E.w2.weight    <- down_proj[E]          (down)

_MOE = re.compile(r"^model\.layers\.(\d+)\.mlp\.(gate\.weight|experts\.gate_up_proj|experts\.down_proj)$")
SHARD_BYTES = 5 * 2**30  # the hub's customary shard size


def to_hub_tensors(name: str, t: torch.Tensor, cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """One of our parameters as the hub tensors it is stored as."""
    m = _MOE.match(name)
    if not m:
        return {name: t}
    layer, what = m.groups()
    prefix = f"model.layers.{layer}.block_sparse_moe"
    if what == "gate.weight":
        return {f"{prefix}.gate.weight": t}
    if what == "experts.down_proj":
        return {f"{prefix}.experts.{e}.w2.weight": t[e] for e in range(t.shape[0])}
    f = cfg.ffn_dim
    out = {}
    for e in range(t.shape[0]):
        out[f"{prefix}.experts.{e}.w1.weight"] = t[e, :f]
        out[f"{prefix}.experts.{e}.w3.weight"] = t[e, f:]
    return out


def _as_umask_allows(directory: Path) -> None:
    """safetensors writes its files owner-only (0600); an export is meant to be shared like any other
    file the user writes: the modes the umask allows."""
    mask = os.umask(0)
    os.umask(mask)
    directory.chmod(0o777 & ~mask)
    for f in directory.iterdir():
        f.chmod(0o666 & ~mask)


def save_hf(state: dict[str, torch.Tensor], cfg: ModelConfig, out_dir: Path, dtype: torch.dtype,
            config_extra: dict[str, Any] | None = None, files_extra: dict[str, bytes] | None = None) -> list[Path]:
    """Write config.json (plus `config_extra`: token ids), safetensors (sharded with an index past
    SHARD_BYTES) and `files_extra` (the tokenizer's files). Written to a temporary directory first
    and renamed, so `out_dir` never holds a half export."""
    if out_dir.exists() and any(out_dir.iterdir()):
        raise UserError(f"export: {out_dir} exists and is not empty; choose a new directory")
    tmp = out_dir.with_name(f".{out_dir.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    tensors: dict[str, torch.Tensor] = {}
    for name, t in state.items():
        if cfg.tie_embeddings and name == "lm_head.weight":
            continue  # tied: the hub convention stores the embedding only
        for key, value in to_hub_tensors(name, t, cfg).items():
            tensors[key] = value.detach().to("cpu", dtype).contiguous()
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for key in sorted(tensors):
        n = tensors[key].numel() * tensors[key].element_size()
        if shards[-1] and size + n > SHARD_BYTES:
            shards.append({})
            size = 0
        shards[-1][key] = tensors[key]
        size += n
    files = []
    if len(shards) == 1:
        files.append(tmp / "model.safetensors")
        save_file(shards[0], str(files[0]), metadata={"format": "pt"})
    else:
        weight_map = {}
        for i, shard in enumerate(shards, 1):
            fname = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
            save_file(shard, str(tmp / fname), metadata={"format": "pt"})
            files.append(tmp / fname)
            weight_map.update(dict.fromkeys(shard, fname))
        total = sum(t.numel() * t.element_size() for t in tensors.values())
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (tmp / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    config = hf_config_dict(cfg)
    config["torch_dtype"] = {torch.bfloat16: "bfloat16", torch.float32: "float32"}[dtype]
    config.update(config_extra or {})
    (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    for name, data in (files_extra or {}).items():
        (tmp / name).write_bytes(data)
    _as_umask_allows(tmp)
    if out_dir.exists():
        out_dir.rmdir()
    tmp.rename(out_dir)
    return [out_dir / f.name for f in files]


ROPE_TYPES = ("default", "llama3", "linear")


def refuse_unrepresentable(c: dict[str, Any], family: str) -> None:
    """A config field our model would silently drop is an error: training would start from
    different weights or a different function than the checkpoint's, with nothing said."""
    if c.get("attention_bias") or c.get("mlp_bias"):
        which = " and ".join(k for k in ("attention_bias", "mlp_bias") if c.get(k))
        raise UserError(f"init_from_hf: the checkpoint uses {which}, which fsdpkit's model has no place for; its "
                        "biases would be dropped (pick a checkpoint without biases)")
    rope = c.get("rope_scaling") or c.get("rope_parameters") or {}
    kind = rope.get("rope_type", rope.get("type")) or "default"
    if kind not in ROPE_TYPES:
        raise UserError(f"init_from_hf: rope scaling {kind!r} is not supported (supported: {', '.join(ROPE_TYPES)}); "
                        "positions would be encoded differently from the checkpoint's")
    arch = [a for a in c.get("architectures") or [] if a != ARCHITECTURES[family]]
    if arch:
        raise UserError(f"init_from_hf: architecture {arch[0]} is not supported (supported: "
                        f"{', '.join(ARCHITECTURES.values())})")
    if c.get("hidden_act", "silu") != "silu":
        raise UserError(f"init_from_hf: hidden_act {c['hidden_act']!r} is not supported (fsdpkit's MLP is "
                        "SwiGLU: silu)")


def model_config_from_hf(path: Path) -> ModelConfig:
    """Our ModelConfig from a Hugging Face config.json (Llama, Mistral, Mixtral)."""
    cfg_file = path / "config.json"
    if not cfg_file.is_file():
        raise UserError(f"init_from_hf: no config.json in {path}")
    c = json.loads(cfg_file.read_text())
    family = c.get("model_type")
    if family not in ARCHITECTURES:
        raise UserError(f"init_from_hf: model_type {family!r} is not one of {', '.join(ARCHITECTURES)}")
    refuse_unrepresentable(c, family)
    rope = c.get("rope_scaling") or c.get("rope_parameters") or {}
    theta = c.get("rope_theta") or rope.get("rope_theta") or 10000.0
    scaling = None
    kind = rope.get("rope_type", rope.get("type")) or "default"
    if kind == "llama3":
        scaling = RopeScaling(rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"],
                              rope["original_max_position_embeddings"])
    elif kind == "linear":
        scaling = RopeScaling(float(rope["factor"]), rope_type="linear")
    heads = c["num_attention_heads"]
    if c.get("head_dim") not in (None, c["hidden_size"] // heads):
        raise UserError(f"init_from_hf: head_dim {c['head_dim']} != hidden_size / heads is not supported")
    return ModelConfig(
        vocab_size=c["vocab_size"], dim=c["hidden_size"], n_layers=c["num_hidden_layers"], n_heads=heads,
        n_kv_heads=c.get("num_key_value_heads") or heads, ffn_dim=c["intermediate_size"],
        max_seq_len=c.get("max_position_embeddings", 4096), rope_theta=float(theta), rope_scaling=scaling,
        norm_eps=c.get("rms_norm_eps", 1e-5), tie_embeddings=bool(c.get("tie_word_embeddings", False)),
        sliding_window=c.get("sliding_window") if family != "llama" else None,
        n_experts=c.get("num_local_experts", 0) if family == "mixtral" else 0,
        experts_per_token=c.get("num_experts_per_tok", 2),
        router_aux_loss_coef=c.get("router_aux_loss_coef", 0.02),
        init_std=c.get("initializer_range", 0.02), family=family,
    )


class _HubFiles:
    """Lazy access to the tensors of a safetensors checkpoint (one file or an index of shards)."""

    def __init__(self, path: Path):
        index = path / "model.safetensors.index.json"
        if index.is_file():
            self.where = {k: path / f for k, f in json.loads(index.read_text())["weight_map"].items()}
        elif (path / "model.safetensors").is_file():
            with safe_open(str(path / "model.safetensors"), framework="pt") as f:
                self.where = dict.fromkeys(f.keys(), path / "model.safetensors")
        else:
            raise UserError(f"init_from_hf: no model.safetensors or index in {path}")
        self._open: dict[Path, Any] = {}

    def slice(self, key: str, rows: slice) -> torch.Tensor:
        """Rows `rows` (dim 0) of a tensor, reading only those bytes from disk."""
        if key not in self.where:
            raise UserError(f"init_from_hf: tensor {key} is missing from the checkpoint")
        file = self.where[key]
        if file not in self._open:
            self._open[file] = safe_open(str(file), framework="pt")
        return self._open[file].get_slice(key)[rows]


def _local_rows(p: torch.Tensor) -> tuple[slice, torch.Tensor]:
    """The dim-0 rows of the full parameter this rank holds, and the local tensor to fill."""
    if not isinstance(p, DTensor):
        return slice(0, p.shape[0]), p
    local_shape, offset = compute_local_shape_and_global_offset(p.shape, p.device_mesh, p.placements)
    if any(o for o in offset[1:]) or tuple(local_shape[1:]) != tuple(p.shape[1:]):
        raise RuntimeError("only dim-0 sharding is supported when loading Hugging Face weights")
    return slice(offset[0], offset[0] + local_shape[0]), p.to_local()


@torch.no_grad()
def load_hf_into(model: torch.nn.Module, path: Path, cfg: ModelConfig) -> None:
    """Copy Hugging Face weights into a (possibly FSDP-sharded) model; each rank reads only its rows,
    so no rank ever holds the full model."""
    files = _HubFiles(path)
    for name, p in model.named_parameters():
        rows, local = _local_rows(p)
        if rows.start >= rows.stop:
            continue
        m = _MOE.match(name)
        if not m:
            key = "model.embed_tokens.weight" if name == "lm_head.weight" and cfg.tie_embeddings else name
            value = files.slice(key, rows)
        else:
            layer, what = m.groups()
            prefix = f"model.layers.{layer}.block_sparse_moe"
            if what == "gate.weight":
                value = files.slice(f"{prefix}.gate.weight", rows)
            else:
                experts = range(rows.start, rows.stop)
                full = slice(None)
                if what == "experts.down_proj":
                    parts = [files.slice(f"{prefix}.experts.{e}.w2.weight", full) for e in experts]
                else:
                    parts = [torch.cat([files.slice(f"{prefix}.experts.{e}.w1.weight", full),
                                        files.slice(f"{prefix}.experts.{e}.w3.weight", full)]) for e in experts]
                value = torch.stack(parts)
        if tuple(value.shape) != tuple(local.shape):
            raise UserError(f"init_from_hf: {name} has shape {tuple(value.shape)} in {path}, "
                            f"the model expects {tuple(local.shape)}")
        local.copy_(value.to(local.dtype))
