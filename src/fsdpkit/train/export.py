"""Export a checkpoint as Hugging Face safetensors + config.json (`fsdpkit export`)."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from fsdpkit import yamlfile
from fsdpkit.errors import UserError
from fsdpkit.train.checkpoint import catalog, checkpointer
from fsdpkit.train.data.tokenizers import HFTokenizer, get_tokenizer
from fsdpkit.train.model.config import ModelConfig, RopeScaling
from fsdpkit.train.model.hf import check_out_dir, save_hf
from fsdpkit.train.model.transformer import Transformer

log = logging.getLogger(__name__)


def find_checkpoint(src: Path) -> catalog.CheckpointInfo:
    """A checkpoint, the newest complete one in a checkpoint directory, or the one of a run directory."""
    found = catalog.resolve(str(src))
    if found is None and (src / "config.yaml").is_file():
        run_config = yamlfile.load_mapping(src / "config.yaml", "export", "a run's configuration")
        ckpt_dir = (run_config.get("checkpoint") or {}).get("checkpoint_dir")
        if ckpt_dir:
            found = catalog.resolve(ckpt_dir)
    if found is None:
        raise UserError(f"export: no complete checkpoint at {src}")
    return found


def model_config_of(info: catalog.CheckpointInfo) -> ModelConfig:
    m = dict(info.meta["model"])
    if m.get("rope_scaling"):
        m["rope_scaling"] = RopeScaling(**m["rope_scaling"])
    return ModelConfig(**m)


def load_full_model(info: catalog.CheckpointInfo) -> Transformer:
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
        raise UserError(f"export: cannot read checkpoint {info.path}: {checkpointer.describe_error(e)}") from None
    return model


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def tokenizer_of(info: catalog.CheckpointInfo) -> tuple[str, dict[str, int], dict[str, bytes]]:
    """The run's tokenizer as an export carries it: (its name, config.json's token ids, its files).
    The embedded byte tokenizer has ids but no files; a Hugging Face one is written as tokenizer.json
    with its configuration, so the export loads with AutoTokenizer."""
    name = ((info.meta.get("config") or {}).get("data") or {}).get("tokenizer", "bytes")
    tok = get_tokenizer(name)  # a hub tokenizer comes from the local cache when this machine trained
    ids = {"eos_token_id": int(tok.eos_id)}
    if (bos := getattr(tok, "bos_id", None)) is not None:
        ids["bos_token_id"] = int(bos)
    if not isinstance(tok, HFTokenizer):
        return name, ids, {}
    files = {"tokenizer.json": tok.tok.to_str().encode()}
    folder = Path(name)
    for extra in TOKENIZER_FILES[1:]:
        if folder.is_dir() and (folder / extra).is_file():
            files[extra] = (folder / extra).read_bytes()
    if "tokenizer_config.json" not in files:
        eos = tok.tok.id_to_token(tok.eos_id)
        files["tokenizer_config.json"] = json.dumps({"eos_token": eos, "tokenizer_class": "PreTrainedTokenizerFast"},
                                                    indent=2).encode()
    return name, ids, files


def export_hf(src: Path, out: Path, dtype: str = "fp32") -> dict[str, Any]:
    check_out_dir(out)  # before a model is loaded: minutes for a large one
    info = find_checkpoint(src)
    try:
        tokenizer, ids, tok_files = tokenizer_of(info)
    except UserError as e:
        # The weights are still worth having (say, offline and the hub tokenizer not cached): export
        # them and say loudly what is missing.
        tokenizer, ids, tok_files = f"not written ({e})", {}, {}
        log.warning(f"export: the run's tokenizer is not in the export: {e}")
    model = load_full_model(info)
    files = save_hf(model.state_dict(), model.cfg, out, {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype],
                    ids, tok_files)
    return {"checkpoint": str(info.path), "step": info.step, "out": str(out), "files": [str(f) for f in files],
            "tokenizer": tokenizer, "tokenizer_files": sorted(tok_files), **ids,
            "dtype": dtype, "architecture": model.cfg.family}
