"""Hugging Face interop: safetensors export and sharded import (config.json: fsdpkit.train.model.hf_config).

Parameter names already match `transformers` (v5) in memory; on disk, MoE experts use the hub's
per-expert layout (below). Config keys are the long-standing ones (`rope_scaling`, `rope_theta`),
which transformers v4 reads as is and v5 converts on load.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from fsdpkit.errors import UserError
from fsdpkit.readers import reading
from fsdpkit.train.model import nf4
from fsdpkit.train.model.config import ModelConfig
from fsdpkit.train.model.hf_config import exported_config
from fsdpkit.train.model.lora import is_adapter

# --- weights on disk (the hub's safetensors layout) ------------------------------------------------
# Dense parameters keep their names. MoE layers are stored per expert, as every Mixtral and
# Qwen3-MoE checkpoint on the hub is (and as transformers v5 writes them back):
#   model.layers.N.block_sparse_moe.gate.weight            <- model.layers.N.mlp.gate.weight
#   model.layers.N.block_sparse_moe.experts.E.w1.weight    <- gate_up_proj[E, :F]   (gate)
#   model.layers.N.block_sparse_moe.experts.E.w3.weight    <- gate_up_proj[E, F:]   (up)
#   model.layers.N.block_sparse_moe.experts.E.w2.weight    <- down_proj[E]          (down)
# Qwen3-MoE keeps `mlp` and names them gate_proj, up_proj and down_proj.

_MOE = re.compile(r"^model\.layers\.(\d+)\.mlp\.(gate\.weight|experts\.gate_up_proj|experts\.down_proj)$")
SHARD_BYTES = 5 * 2**30  # the hub's customary shard size
# family -> (the layer's MoE module, its experts' gate, up and down projections), on disk.
_HUB_MOE = {"mixtral": ("block_sparse_moe", ("w1", "w3"), "w2"),
            "qwen3_moe": ("mlp", ("gate_proj", "up_proj"), "down_proj")}


def _hub_moe(cfg: ModelConfig, layer: str) -> tuple[str, tuple[str, str], str]:
    """A MoE layer's prefix on disk and its experts' projection names (Mixtral's for any other family)."""
    module, gate_up, down = _HUB_MOE.get(cfg.family, _HUB_MOE["mixtral"])
    return f"model.layers.{layer}.{module}", gate_up, down


def to_hub_tensors(name: str, t: torch.Tensor, cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """One of our parameters as the hub tensors it is stored as."""
    m = _MOE.match(name)
    if not m:
        return {name: t}
    layer, what = m.groups()
    prefix, (gate, up), down = _hub_moe(cfg, layer)
    if what == "gate.weight":
        return {f"{prefix}.gate.weight": t}
    if what == "experts.down_proj":
        return {f"{prefix}.experts.{e}.{down}.weight": t[e] for e in range(t.shape[0])}
    f = cfg.ffn_dim
    out = {}
    for e in range(t.shape[0]):
        out[f"{prefix}.experts.{e}.{gate}.weight"] = t[e, :f]
        out[f"{prefix}.experts.{e}.{up}.weight"] = t[e, f:]
    return out


def _as_umask_allows(directory: Path) -> None:
    """safetensors writes its files owner-only (0600); an export is meant to be shared like any other
    file the user writes: the modes the umask allows."""
    mask = os.umask(0)
    os.umask(mask)
    directory.chmod(0o777 & ~mask)
    for f in directory.iterdir():
        f.chmod(0o666 & ~mask)


def check_out_dir(out_dir: Path) -> None:
    """An export can go to `out_dir`: a new or empty directory this process may create and write."""
    if out_dir.exists() and not out_dir.is_dir():
        raise UserError(f"export: {out_dir} is a file; choose a new directory")
    if out_dir.exists() and any(out_dir.iterdir()):
        raise UserError(f"export: {out_dir} exists and is not empty; choose a new directory")
    probe = out_dir.resolve()
    while not probe.exists():
        probe = probe.parent
    if not probe.is_dir() or not os.access(probe, os.W_OK | os.X_OK):
        raise UserError(f"export: cannot write to {probe} (read-only, or no permission); choose another directory")


@contextlib.contextmanager
def staged_dir(out_dir: Path) -> Iterator[Path]:
    """A temporary sibling of `out_dir` to write into, renamed to `out_dir` when the block ends
    well (and removed when it does not), so `out_dir` never holds a half export."""
    check_out_dir(out_dir)
    tmp = out_dir.with_name(f".{out_dir.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    _as_umask_allows(tmp)
    if out_dir.exists():
        out_dir.rmdir()
    tmp.rename(out_dir)


def save_hf(state: dict[str, torch.Tensor], cfg: ModelConfig, out_dir: Path, dtype: torch.dtype,
            config_extra: dict[str, Any] | None = None, files_extra: dict[str, bytes] | None = None,
            source: dict[str, Any] | None = None) -> list[Path]:
    """Write config.json (the imported `source` with what training changed, plus `config_extra`:
    token ids), safetensors (sharded with an index past SHARD_BYTES) and `files_extra` (the
    tokenizer's files), through `staged_dir`."""
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
    names = ["model.safetensors"] if len(shards) == 1 else [
        f"model-{i:05d}-of-{len(shards):05d}.safetensors" for i in range(1, len(shards) + 1)]
    with staged_dir(out_dir) as tmp:
        for fname, shard in zip(names, shards, strict=True):
            save_file(shard, str(tmp / fname), metadata={"format": "pt"})
        if len(shards) > 1:
            weight_map = {key: fname for fname, shard in zip(names, shards, strict=True) for key in shard}
            total = sum(t.numel() * t.element_size() for t in tensors.values())
            index = {"metadata": {"total_size": total}, "weight_map": weight_map}
            (tmp / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
        config = exported_config(cfg, source)
        # transformers 5 writes `dtype`, earlier releases `torch_dtype`: the imported config's spelling.
        config["dtype" if "dtype" in config else "torch_dtype"] = {torch.bfloat16: "bfloat16",
                                                                   torch.float32: "float32"}[dtype]
        config.update(config_extra or {})
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        for name, data in (files_extra or {}).items():
            (tmp / name).write_bytes(data)
    return [out_dir / f for f in names]


def save_peft(adapters: dict[str, torch.Tensor], adapter_config: dict[str, Any], out_dir: Path, dtype: torch.dtype,
              files_extra: dict[str, bytes] | None = None) -> list[Path]:
    """A PEFT adapter directory: adapter_model.safetensors (PEFT's tensor names) and
    adapter_config.json, as `peft.PeftModel.from_pretrained` reads them, through `staged_dir`."""
    with staged_dir(out_dir) as tmp:
        save_file({k: v.detach().to("cpu", dtype).contiguous() for k, v in adapters.items()},
                  str(tmp / "adapter_model.safetensors"), metadata={"format": "pt"})
        (tmp / "adapter_config.json").write_text(json.dumps(adapter_config, indent=2) + "\n")
        for name, data in (files_extra or {}).items():
            (tmp / name).write_bytes(data)
    return [out_dir / "adapter_model.safetensors"]


class _HubFiles:
    """Lazy access to the tensors of a safetensors checkpoint (one file or an index of shards)."""

    def __init__(self, path: Path):
        index = path / "model.safetensors.index.json"
        if index.is_file():
            with reading(index, "init_from_hf"):
                self.where = {k: path / f for k, f in json.loads(index.read_text())["weight_map"].items()}
        elif (path / "model.safetensors").is_file():
            with reading(path / "model.safetensors", "init_from_hf"), \
                    safe_open(str(path / "model.safetensors"), framework="pt") as f:
                self.where = dict.fromkeys(f.keys(), path / "model.safetensors")
        else:
            raise UserError(f"init_from_hf: no model.safetensors or index in {path}")
        self._open: dict[Path, Any] = {}
        for file in sorted(set(self.where.values())):  # every shard's header, before any weight is read
            with reading(file, "init_from_hf"):
                self._open[file] = safe_open(str(file), framework="pt")

    def slice(self, key: str, rows: slice) -> torch.Tensor:
        """Rows `rows` (dim 0) of a tensor, reading only those bytes from disk."""
        if key not in self.where:
            raise UserError(f"init_from_hf: tensor {key} is missing from the checkpoint")
        file = self.where[key]
        with reading(file, "init_from_hf"):
            return self._open[file].get_slice(key)[rows]


def check_weights(path: Path) -> None:
    """Every safetensors file of `path` opens (index and headers), before any process loads them."""
    _HubFiles(path)


def local_rows(p: torch.Tensor) -> tuple[slice, torch.Tensor]:
    """The dim-0 rows of the full parameter this rank holds, and the local tensor to fill."""
    if not isinstance(p, DTensor):
        return slice(0, p.shape[0]), p
    local_shape, offset = compute_local_shape_and_global_offset(p.shape, p.device_mesh, p.placements)
    if any(o for o in offset[1:]) or tuple(local_shape[1:]) != tuple(p.shape[1:]):
        raise RuntimeError("only dim-0 sharding is supported when loading Hugging Face weights")
    return slice(offset[0], offset[0] + local_shape[0]), p.to_local()


# Checkpoint tensors that are no weights: RoPE's frequency table, which older checkpoints saved.
_NOT_WEIGHTS = re.compile(r"\.rotary_emb\.inv_freq$")


def _checkpoint_keys(name: str, cfg: ModelConfig, experts: range | None = None) -> list[tuple[str, ...]]:
    """The checkpoint tensors a parameter of the model is filled from: one tensor, whose rows it
    takes; or for a MoE layer's experts one group per expert (`experts`, default all), its tensors
    concatenated (gate and up into gate_up_proj, down alone into down_proj)."""
    m = _MOE.match(name)
    if not m:
        return [("model.embed_tokens.weight" if name == "lm_head.weight" and cfg.tie_embeddings else name,)]
    layer, what = m.groups()
    prefix, gate_up, down = _hub_moe(cfg, layer)
    if what == "gate.weight":
        return [(f"{prefix}.gate.weight",)]
    parts = (down,) if what == "experts.down_proj" else gate_up
    return [tuple(f"{prefix}.experts.{e}.{w}.weight" for w in parts)
            for e in (experts if experts is not None else range(cfg.n_experts))]


def _refuse_unplaced(model: torch.nn.Module, files: _HubFiles, path: Path, cfg: ModelConfig) -> None:
    """Loading is strict both ways: a tensor the model has no place for (Qwen 2's q/k/v biases under a
    Llama config.json) would be dropped while the run trains on, so it is refused in one line."""
    placed = {k for name, _ in model.named_parameters() if not is_adapter(name)
              for group in _checkpoint_keys(name, cfg) for k in group}
    if cfg.tie_embeddings:
        placed.add("lm_head.weight")  # a tied checkpoint may still carry the head: it is the embedding
    unplaced = sorted(k for k in files.where if k not in placed and not _NOT_WEIGHTS.search(k))
    if unplaced:
        shown = ", ".join(unplaced[:3]) + (f" and {len(unplaced) - 3} more" if len(unplaced) > 3 else "")
        raise UserError(f"init_from_hf: {path} holds {len(unplaced)} tensor(s) the model has no place for ({shown}); "
                        "its config.json describes another model than its weights: use the config.json they were "
                        "saved with")


@torch.no_grad()
def load_hf_into(model: torch.nn.Module, path: Path, cfg: ModelConfig) -> None:
    """Copy Hugging Face weights into a (possibly FSDP-sharded) model; each rank reads only its rows,
    so no rank ever holds the full model."""
    files = _HubFiles(path)
    _refuse_unplaced(model, files, path, cfg)
    for name, p in model.named_parameters():
        if is_adapter(name):
            continue  # LoRA adapters: not part of the base model
        rows, local = local_rows(p)
        if rows.start >= rows.stop:
            continue
        m = _MOE.match(name)
        if m is None or m.group(2) == "gate.weight":
            ((key,),) = _checkpoint_keys(name, cfg)
            value = files.slice(key, rows)
        else:  # this rank's experts (dim 0), each whole
            groups = _checkpoint_keys(name, cfg, range(rows.start, rows.stop))
            value = torch.stack([torch.cat([files.slice(k, slice(None)) for k in group]) for group in groups])
        if tuple(value.shape) != tuple(local.shape):
            raise UserError(f"init_from_hf: {name} has shape {tuple(value.shape)} in {path}, "
                            f"the model expects {tuple(local.shape)}")
        if nf4.is_nf4(p):
            nf4.store(p, value)
        else:
            local.copy_(value.to(local.dtype))
