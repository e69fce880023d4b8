"""Export a checkpoint as Hugging Face safetensors + config.json, or a LoRA run's adapters as a PEFT
adapter (`fsdpkit export`)."""

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
from fsdpkit.train.checkpoint.one_process import one_process
from fsdpkit.train.data.tokenizers import HFTokenizer, get_tokenizer
from fsdpkit.train.evaluate import PROVENANCE
from fsdpkit.train.model.config import LoraShape, ModelConfig, RopeScaling, count_params, params_text
from fsdpkit.train.model.hf import check_out_dir, load_hf_into, save_hf, save_peft
from fsdpkit.train.model.lora import adapter_tensors, add_adapters, is_adapter, merge_adapters
from fsdpkit.train.model.transformer import Transformer

log = logging.getLogger(__name__)


def find_checkpoint(src: Path) -> tuple[catalog.CheckpointInfo, list[dict[str, str]]]:
    """A checkpoint, the newest whole one in a checkpoint directory, or the one of a run directory;
    and the newer ones passed over as damaged (each said: the export is then not of the run's end)."""
    root, found = src, catalog.resolve(str(src), "export", "export")
    if found is None and (src / "config.yaml").is_file():
        run_config = yamlfile.load_mapping(src / "config.yaml", "export", "a run's configuration")
        if ckpt_dir := (run_config.get("checkpoint") or {}).get("checkpoint_dir"):
            root, found = Path(ckpt_dir), catalog.resolve(ckpt_dir, "export", "export")
    if found is None:
        raise UserError(f"export: no complete checkpoint at {src}")
    if found.path == root:   # named directly: it loads or fails
        return found, []
    skipped: list[dict[str, str]] = []
    for info in reversed(catalog.list_checkpoints(root, damaged=True)):
        problem = info.problem or checkpointer.verify(info.path)
        if problem is None:
            for s in skipped:   # said once an older one is found: with none, the error alone says it
                log.warning(f"export: {s['checkpoint']} is damaged ({s['problem']}); exporting an older checkpoint")
            return info, skipped
        skipped.append({"checkpoint": str(info.path), "problem": problem})
    raise UserError(f"export: every checkpoint in {root} is damaged ({skipped[0]['problem']} in the newest)")


def model_config_of(info: catalog.CheckpointInfo) -> ModelConfig:
    m = dict(info.meta["model"])
    m.pop("lora", None)
    if m.get("rope_scaling"):
        m["rope_scaling"] = RopeScaling(**m["rope_scaling"])
    return ModelConfig(**m)


def adapters_of(info: catalog.CheckpointInfo) -> LoraShape | None:
    """The LoRA adapters a checkpoint holds (only they: its base is the run's --init-from-hf), or None."""
    lora = info.meta["model"].get("lora")
    return LoraShape(**{**lora, "targets": tuple(lora["targets"])}) if lora else None


def base_of(info: catalog.CheckpointInfo) -> Path:
    """The Hugging Face directory a LoRA run adapted, which must still be where the run read it;
    absolute, as a PEFT adapter names it (a relative path would mean another folder wherever the
    adapter is loaded from)."""
    base = ((info.meta.get("config") or {}).get("checkpoint") or {}).get("init_from_hf")
    if not base or not Path(base).is_dir():
        raise UserError(f"export: {info.path} holds LoRA adapters only; their base model "
                        f"{base or '(not recorded)'} is not a directory here; run export where the base is")
    return Path(base).resolve()


def load_full_model(info: catalog.CheckpointInfo) -> Transformer:
    """The whole model in CPU memory, from a checkpoint written by any number of ranks; a LoRA
    checkpoint's adapters on its base model's weights."""
    cfg, lora = model_config_of(info), adapters_of(info)
    with torch.device("meta"):
        model = Transformer(cfg, rope_len=min(cfg.max_seq_len, 2048))
        if lora is not None:
            add_adapters(model, lora)
    model.to_empty(device="cpu")
    model.init_buffers()
    if lora is not None:
        load_hf_into(model, base_of(info), cfg)
    saved = model.state_dict()
    state = {"model": {k: v for k, v in saved.items() if lora is None or is_adapter(k)}}
    try:
        with one_process():
            dcp.load(state, checkpoint_id=str(info.path))
    except (Exception, CheckpointException) as e:  # DCP's own error is a BaseException
        raise UserError(f"export: cannot read checkpoint {info.path}: {checkpointer.describe_error(e)}") from None
    return model


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")


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


def peft_config(lora: LoraShape, state: dict[str, torch.Tensor], base: Path) -> dict[str, Any]:
    """adapter_config.json: what PEFT's LoraConfig needs to rebuild these adapters on `base`."""
    targets = sorted({k.split(".lora_A.")[0].rsplit(".", 1)[-1] for k in state if ".lora_A." in k})
    return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": str(base),
            "r": lora.rank, "lora_alpha": lora.alpha, "lora_dropout": lora.dropout, "target_modules": targets,
            "bias": "none", "fan_in_fan_out": False, "inference_mode": True, "use_rslora": False,
            "use_dora": False, "modules_to_save": None, "init_lora_weights": True}


def export_hf(src: Path, out: Path, dtype: str = "fp32", to: str = "hf") -> dict[str, Any]:
    """`to` "hf": the whole model (a LoRA run's adapters merged into its base); "peft": a LoRA
    run's adapters alone, as a PEFT adapter."""
    check_out_dir(out)  # before a model is loaded: minutes for a large one
    info, skipped = find_checkpoint(src)
    lora = adapters_of(info)
    if to == "peft" and lora is None:
        raise UserError(f"export: {info.path} trained the whole model, not LoRA adapters; export it --to hf")
    try:
        tokenizer, ids, tok_files = tokenizer_of(info)
    except UserError as e:
        # The weights are still worth having (say, offline and the hub tokenizer not cached): export
        # them and say loudly what is missing.
        tokenizer, ids, tok_files = f"not written ({e})", {}, {}
        log.warning(f"export: the run's tokenizer is not in the export: {e}")
    run_dir = (info.meta.get("config") or {}).get("run_dir")
    tok_files = {**tok_files, PROVENANCE: json.dumps({"run_dir": run_dir, "checkpoint": str(info.path),
                                                      "step": info.step}, indent=2).encode()}
    # Minutes for a large model: each stage said as it starts (stderr; --json's stdout stays the envelope).
    log.info(f"export: reading step {info.step} of {info.path} ({params_text(count_params(model_config_of(info)))} "
             "parameters) into CPU memory")
    model = load_full_model(info)
    torch_dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype]
    state = model.state_dict()
    log.info(f"export: writing {out} ({dtype}{', adapters merged' if lora is not None and to == 'hf' else ''})")
    if lora is not None and to == "peft":
        files = save_peft(adapter_tensors(state), peft_config(lora, state, base_of(info)), out, torch_dtype,
                          tok_files)
    else:
        files = save_hf(merge_adapters(state, lora) if lora is not None else state, model.cfg, out, torch_dtype,
                        ids, tok_files, info.meta.get("hf_config"))
    return {"checkpoint": str(info.path), "step": info.step, "out": str(out), "files": [str(f) for f in files],
            "format": to, "lora": lora is not None,
            "tokenizer": tokenizer, "tokenizer_files": sorted(f for f in tok_files if f != PROVENANCE), **ids,
            "dtype": dtype, "architecture": model.cfg.family, "skipped": skipped}
