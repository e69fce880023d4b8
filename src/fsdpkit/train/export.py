"""Export a checkpoint as Hugging Face safetensors + config.json (`fsdpkit export`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
import yaml
from torch.distributed.checkpoint.api import CheckpointException

from fsdpkit.errors import UserError
from fsdpkit.train import checkpoint
from fsdpkit.train.hf import save_hf
from fsdpkit.train.model import Transformer
from fsdpkit.train.model_config import ModelConfig, RopeScaling


def find_checkpoint(src: Path) -> checkpoint.CheckpointInfo:
    """A checkpoint, the newest complete one in a checkpoint directory, or the one of a run directory."""
    found = checkpoint.resolve(str(src))
    if found is None and (src / "config.yaml").is_file():
        ckpt_dir = (yaml.safe_load((src / "config.yaml").read_text()).get("checkpoint") or {}).get("checkpoint_dir")
        if ckpt_dir:
            found = checkpoint.resolve(ckpt_dir)
    if found is None:
        raise UserError(f"export: no complete checkpoint at {src}")
    return found


def model_config_of(info: checkpoint.CheckpointInfo) -> ModelConfig:
    m = dict(info.meta["model"])
    if m.get("rope_scaling"):
        m["rope_scaling"] = RopeScaling(**m["rope_scaling"])
    return ModelConfig(**m)


def load_full_model(info: checkpoint.CheckpointInfo) -> Transformer:
    """The whole model in CPU memory, from a checkpoint written by any number of ranks."""
    cfg = model_config_of(info)
    with torch.device("meta"):
        model = Transformer(cfg, rope_len=min(cfg.max_seq_len, 2048))
    model.to_empty(device="cpu")
    model.init_buffers()
    state = {"model": model.state_dict()}
    try:
        dcp.load(state, checkpoint_id=str(info.path))
    except (Exception, CheckpointException) as e:  # DCP's own error is a BaseException
        raise UserError(f"export: cannot read checkpoint {info.path}: {checkpoint.describe_error(e)}") from None
    return model


def export_hf(src: Path, out: Path, dtype: str = "fp32") -> dict[str, Any]:
    info = find_checkpoint(src)
    model = load_full_model(info)
    files = save_hf(model.state_dict(), model.cfg, out, {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype])
    return {"checkpoint": str(info.path), "step": info.step, "out": str(out), "files": [str(f) for f in files],
            "dtype": dtype, "architecture": model.cfg.family}
