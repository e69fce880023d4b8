"""Typed training configuration: the one place defaults live.

Values come from the dataclass defaults (which are the embedded default run of `make run`), then a
YAML file, then `--key value` flags. Every field is a flag under its own name; the reference FSDP
example's flag names are accepted as aliases so existing job manifests keep working. Each field
carries its allowed range, and `validate` rejects a bad value up front with the field's name.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fsdpkit.errors import UserError
from fsdpkit.train.model_config import ModelConfig
from fsdpkit.train.presets import get_preset
from fsdpkit.yamlfile import load_mapping


def opt(default: Any, help: str, *, min: float | None = None, max: float | None = None,
        choices: tuple[str, ...] | None = None, aliases: tuple[str, ...] = (),
        alias_values: dict[str, Any] | None = None) -> Any:
    """A config field with its help text, allowed range and reference flag aliases."""
    meta = {"help": help, "min": min, "max": max, "choices": choices, "aliases": aliases,
            "alias_values": alias_values or {}}
    return field(default=default, metadata=meta)


@dataclass
class ModelOverrides:
    """Changes to the preset's model shape; None keeps the preset's value."""

    vocab_size: int | None = opt(None, "vocabulary size", min=1)
    dim: int | None = opt(None, "hidden size", min=1, aliases=("hidden_width",))
    n_layers: int | None = opt(None, "number of decoder layers", min=1, aliases=("num_layers",))
    n_heads: int | None = opt(None, "attention heads", min=1, aliases=("num_heads",))
    n_kv_heads: int | None = opt(None, "key/value heads (GQA)", min=1, aliases=("num_key_value_heads",))
    ffn_dim: int | None = opt(None, "MLP intermediate size", min=1, aliases=("intermediate_size",))
    rope_theta: float | None = opt(None, "RoPE base", min=1, aliases=("rotary_emb_base",))
    sliding_window: int | None = opt(None, "Mistral sliding attention window (0: none)", min=0)
    n_experts: int | None = opt(None, "MoE experts per layer (0: dense MLP)", min=0,
                                aliases=("num_local_experts",))
    experts_per_token: int | None = opt(None, "experts each token is routed to", min=1,
                                        aliases=("num_experts_per_tok",))
    init_std: float | None = opt(None, "std of the weight initialisation", min=0,
                                 aliases=("initializer_range",))
    family: str | None = opt(None, "Hugging Face class the weights map to",
                             choices=("llama", "mistral", "mixtral"), aliases=("model_type",),
                             alias_values={"llama_v2": "llama", "llama_v3": "llama"})


@dataclass
class DataConfig:
    dataset: str = opt("embedded", "'embedded' (the Python standard library's source), a local file or folder "
                       "(jsonl/json/parquet/txt, .gz/.zst; or token shards from `fsdpkit data prepare`), "
                       "or a Hugging Face hub dataset (hf:NAME forces the hub)")
    dataset_config_name: str | None = opt(None, "dataset configuration (hub datasets)")
    train_split: str = opt("train", "split to train on")
    val_split: str = opt("validation", "split to validate on")
    text_field: str = opt("text", "field (or parquet column) holding the text of a record")
    on_bad_record: str = opt("skip", "a record that is not JSON or lacks the text field: skip it (counted) or fail",
                             choices=("skip", "fail"))
    prefetch: int = opt(4, "batches prepared ahead in a background thread (0: none)", min=0)
    document_masking: bool = opt(False, "attend only within each document of a packed sequence "
                                 "(an explicit attention mask: slower than plain causal attention)")
    tokenizer: str = opt("bytes", "'bytes' (embedded), or a Hugging Face tokenizer: local dir/file or hub name")
    seq_len: int | None = opt(None, "training sequence length (default: min(context, 2048))", min=2,
                              aliases=("max_context_width",))
    train_batch_size: int = opt(16, "sequences per rank per micro-step", min=1)
    val_batch_size: int = opt(16, "sequences per rank per validation batch", min=1)
    grad_accum_steps: int = opt(1, "micro-steps per optimizer step", min=1)
    epochs: int | None = opt(None, "passes over the data at most (training stops at max_steps first)",
                             min=1)


@dataclass
class OptimConfig:
    max_steps: int = opt(300, "optimizer steps to train (exact)", min=1, aliases=("max_training_steps",))
    lr: float = opt(3e-3, "peak learning rate", min=0)
    min_lr: float | None = opt(None, "learning-rate floor the schedule decays to (default: lr / 10)", min=0)
    lr_decay_style: str = opt("cosine", "schedule after warm-up", choices=("cosine", "linear", "constant"))
    lr_decay_iters: int | None = opt(None, "steps to decay over (default: max_steps)", min=1)
    warmup_steps: int | None = opt(None, "linear warm-up steps (default: warmup x max_steps)", min=0)
    warmup: float = opt(0.05, "warm-up as a fraction of max_steps", min=0, max=1)
    weight_decay: float = opt(0.1, "AdamW weight decay (not applied to norms and embeddings)", min=0)
    beta1: float = opt(0.9, "AdamW beta1", min=0, max=1)
    beta2: float = opt(0.95, "AdamW beta2", min=0, max=1)
    eps: float = opt(1e-8, "AdamW epsilon", min=0)
    grad_clip: float = opt(1.0, "clip the global gradient norm to this (0: off)", min=0)
    fused_optimizer: bool = opt(True, "fused AdamW kernel (one kernel for all parameters; CPU and CUDA)")


@dataclass
class ParallelConfig:
    nproc: int = opt(1, "processes on this machine (launches torchrun when > 1)", min=1)
    device: str = opt("auto", "where to train", choices=("auto", "cpu", "cuda"))
    sharding_strategy: str = opt("full", "FSDP2 sharding: full, or hybrid (HSDP on a 2-D mesh)",
                                 choices=("full", "hybrid"))
    dp_replicate: int | None = opt(None, "hybrid: replica groups (default: number of nodes)", min=1)
    mixed_precision: str = opt("auto", "parameter dtype in compute (auto: bf16 on GPU, fp32 on CPU)",
                               choices=("auto", "bf16", "fp32"), aliases=("bf16",),
                               alias_values={"1": "bf16", "0": "fp32", "true": "bf16", "false": "fp32"})
    reduce_dtype: str = opt("fp32", "dtype of gradient reduction", choices=("fp32", "bf16"))
    reshard_after_forward: bool = opt(True, "free gathered parameters after forward (saves memory)")
    cpu_offload: bool = opt(False, "keep sharded parameters and optimizer state on the CPU")
    activation_checkpointing: str = opt(
        "none", "recompute activations in backward: none, full (every block) or selective",
        choices=("none", "full", "selective"),
        alias_values={"1": "full", "0": "none", "true": "full", "false": "none"})
    ac_every: int = opt(2, "selective activation checkpointing: every Nth block", min=1)
    compile: bool = opt(False, "torch.compile each decoder block")
    attention: str = opt("auto", "causal attention kernel: auto (on the CPU fsdpkit's own tiled kernel, built at "
                         "first use, else 256-token SDPA blocks; SDPA elsewhere), blocks (the SDPA blocks on the "
                         "CPU) or sdpa", choices=("auto", "blocks", "sdpa"))
    compile_cache_dir: str | None = opt(None, "keep torch.compile's caches here (e.g. on shared storage) so a "
                                        "restarted or resubmitted job starts warm")
    loss_chunk_tokens: int | None = opt(None, "tokens per cross-entropy chunk, so full fp32 logits never exist "
                                        "(default: chunks of at most 256 MiB of logits; 0: off)", min=0)
    fsdp_prefetch: int = opt(1, "decoder blocks whose parameters FSDP gathers ahead, forward and backward", min=0,
                             max=4)
    float8: bool = opt(False, "float8 linear layers (torchao; Hopper or newer GPUs)")
    keep_host_memory: bool = opt(True, "reuse freed host memory instead of returning it to the OS each step "
                                 "(glibc mallopt: fewer page faults per step)")
    max_restarts: int = opt(0, "with --nproc: torchrun restarts the workers this often after a failure", min=0)


@dataclass
class LogConfig:
    logging_freq: int = opt(10, "steps between metric lines", min=1)
    validation_freq: int = opt(100, "steps between validation passes (0: only at the end)", min=0)
    validation_batches: int = opt(8, "batches per rank per validation pass", min=1)
    tensorboard: bool = opt(True, "write TensorBoard events to RUN_DIR/tensorboard")
    tensorboard_dir: str | None = opt(None, "TensorBoard directory (default: RUN_DIR/tensorboard)")
    progress: str = opt("auto", "progress bar (auto: when attached to a terminal)",
                        choices=("auto", "on", "off"))
    log_samples: bool = opt(False, "record the global index of every sample each rank trains on "
                            "(RUN_DIR/samples-rank*.jsonl), to audit data order")


@dataclass
class CheckpointConfig:
    checkpoint_dir: str | None = opt(None, "where sharded checkpoints go")
    checkpoint_freq: int = opt(0, "steps between checkpoints (0: none)", min=0)
    resume_from_checkpoint: str | None = opt(
        None, "a checkpoint, a directory whose newest complete checkpoint to resume from, or 'auto' "
        "(the newest in checkpoint_dir; also what a run restarted by torchrun does)", aliases=("resume",))
    keep_last: int = opt(3, "complete checkpoints to keep (0: all)", min=0)
    async_checkpoint: bool = opt(False, "write checkpoints in the background while training continues")
    init_from_hf: str | None = opt(None, "start from Hugging Face weights: a local directory with config.json "
                                   "and safetensors (its config replaces the preset)")


@dataclass
class TrainConfig:
    preset: str = opt("tiny", "model preset (see `fsdpkit presets`)")
    run_dir: str | None = opt(None, "directory for metrics, config and events (default: runs/<time>-<preset>)")
    seed: int = opt(1234, "seed for initialisation and data order", min=0)
    model: ModelOverrides = field(default_factory=ModelOverrides)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    log: LogConfig = field(default_factory=LogConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)

    # -- derived values (one rule each) -----------------------------------------------------------
    def model_config(self) -> ModelConfig:
        if self.checkpoint.init_from_hf:
            from fsdpkit.train.hf import model_config_from_hf

            base = model_config_from_hf(Path(self.checkpoint.init_from_hf))
        else:
            base = get_preset(self.preset)
        changes = {k: v for k, v in dataclasses.asdict(self.model).items() if v is not None}
        if changes.get("sliding_window") == 0:
            changes["sliding_window"] = None
        return dataclasses.replace(base, **changes)

    def seq_len(self) -> int:
        if self.data.seq_len is not None:
            return self.data.seq_len
        return min(self.model_config().max_seq_len, 2048)

    def warmup_steps(self) -> int:
        if self.optim.warmup_steps is not None:
            return self.optim.warmup_steps
        return round(self.optim.warmup * self.optim.max_steps)

    def min_lr(self) -> float:
        return self.optim.lr / 10 if self.optim.min_lr is None else self.optim.min_lr

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


SECTIONS = ("model", "data", "optim", "parallel", "log", "checkpoint")

# Reference flags that have no counterpart here: accepted so old manifests run, with a notice.
IGNORED_REFERENCE_FLAGS = {
    "resid_pdrop": "the model uses no dropout",
    "embd_pdrop": "the model uses no dropout",
    "attn_pdrop": "the model uses no dropout",
    "summary_first_pdrop": "the model uses no dropout",
    "rotary_pct": "RoPE covers the whole head (Llama family)",
    "offload_activations": "use --activation_checkpointing instead",
    "activation_loading_horizon": "FSDP1 option without an FSDP2 counterpart",
    "limit_all_gathers": "FSDP1 option; FSDP2 bounds all-gathers itself",
    "same_seed": "every rank shares the seed; data order is derived per rank",
    "plateau": "plateau schedules are not supported",
    "output_attentions": "not used in training",
    "output_hidden_states": "not used in training",
    "use_cache": "not used in training",
}


def _fields(section_cls: type) -> list[tuple[dataclasses.Field, type]]:
    hints = typing.get_type_hints(section_cls)
    return [(f, hints[f.name]) for f in dataclasses.fields(section_cls) if f.metadata]


def _section_classes() -> dict[str | None, type]:
    hints = typing.get_type_hints(TrainConfig)
    return {None: TrainConfig, **{s: hints[s] for s in SECTIONS}}


def field_index() -> dict[str, tuple[str | None, dataclasses.Field, type]]:
    """Every flag name and alias -> (section, field, type)."""
    index: dict[str, tuple[str | None, dataclasses.Field, type]] = {}
    for section, cls in _section_classes().items():
        for f, tp in _fields(cls):
            for name in (f.name, *f.metadata["aliases"]):
                index[name] = (section, f, tp)
    return index


def _base_type(tp: Any) -> tuple[type, bool]:
    """(scalar type, optional?) of an annotation such as `int | None`."""
    args = typing.get_args(tp)
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        inner = [a for a in args if a is not type(None)]
        return inner[0], True
    return tp, False


def convert(name: str, raw: Any, f: dataclasses.Field, tp: Any) -> Any:
    """Turn a YAML or command-line value into the field's type, or raise a UserError naming it."""
    base, optional = _base_type(tp)
    key = str(raw).strip().lower() if isinstance(raw, (str, bool, int)) else None
    if key is not None and key in f.metadata["alias_values"]:
        return f.metadata["alias_values"][key]
    if raw is None or (optional and key in ("none", "null", "")):
        if optional:
            return None
        raise UserError(f"{name}: a value is required")
    try:
        if base is bool:
            if isinstance(raw, bool):
                return raw
            if key in ("1", "true", "yes", "on"):
                return True
            if key in ("0", "false", "no", "off"):
                return False
            raise ValueError
        if base is int:
            if isinstance(raw, float) and not raw.is_integer():
                raise ValueError
            return int(raw) if not isinstance(raw, str) else int(raw.strip())
        if base is float:
            return float(raw)
        return str(raw)
    except (TypeError, ValueError):
        kind = {bool: "true or false", int: "an integer", float: "a number"}.get(base, "a string")
        raise UserError(f"{name}: expected {kind}, got {raw!r}") from None


def _set(cfg: TrainConfig, name: str, raw: Any, index: dict, notices: list[str]) -> None:
    if name in IGNORED_REFERENCE_FLAGS:
        notices.append(f"note: --{name} is accepted and ignored: {IGNORED_REFERENCE_FLAGS[name]}")
        return
    if name not in index:
        raise UserError(f"unknown option {name!r} (see `fsdpkit train --help`)")
    section, f, tp = index[name]
    target = cfg if section is None else getattr(cfg, section)
    setattr(target, f.name, convert(name, raw, f, tp))


def load_yaml(path: str | os.PathLike, cfg: TrainConfig, notices: list[str]) -> None:
    """Apply a YAML file: flat `key: value` pairs or `section: {key: value}` blocks."""
    apply_mapping(load_mapping(path, "config", "option names to values"), cfg, notices)


def apply_mapping(doc: dict[str, Any], cfg: TrainConfig, notices: list[str]) -> None:
    """Apply `key: value` pairs or `section: {key: value}` blocks (a YAML file, a job spec's `train:`)."""
    index = field_index()
    for key, value in doc.items():
        if key in SECTIONS and isinstance(value, dict):
            for sub, v in value.items():
                _set(cfg, str(sub), v, index, notices)
        else:
            _set(cfg, str(key), value, index, notices)


def to_flags(doc: dict[str, Any]) -> list[str]:
    """The same mapping as `--key value` flags, sections flattened (every field name is unique)."""
    flags: list[str] = []
    for key, value in doc.items():
        items = value.items() if key in SECTIONS and isinstance(value, dict) else [(key, value)]
        for k, v in items:
            flags += [f"--{k}", "none" if v is None else str(v).lower() if isinstance(v, bool) else str(v)]
    return flags


class _Parser(argparse.ArgumentParser):
    """argparse that reports a mistake as a UserError (one line, exit 2) instead of a usage dump."""

    def error(self, message: str) -> typing.NoReturn:
        raise UserError(f"{message} (see `{self.prog} --help`)")


def build_parser(prog: str = "fsdpkit train") -> argparse.ArgumentParser:
    """The training flags, generated from the dataclasses (so help and defaults cannot drift)."""
    parser = _Parser(
        prog=prog, allow_abbrev=False,
        description="Train a Llama-family model with FSDP2. With no flags: the embedded default run.",
    )
    parser.add_argument("--config", help="YAML file with option values (flags override it)")
    # Read by fsdpkit.train.launch (how to report), not a training option.
    parser.add_argument("--json", action="store_true", default=argparse.SUPPRESS,
                        help="print one JSON envelope with the run's summary on stdout; progress goes to stderr")
    for section, cls in _section_classes().items():
        group = parser.add_argument_group(section or "run")
        for f, _tp in _fields(cls):
            names = [f"--{f.name}"]
            if "_" in f.name:
                names.append(f"--{f.name.replace('_', '-')}")
            names += [f"--{a}" for a in f.metadata["aliases"]]
            meta = f.metadata
            extra = f" [{'|'.join(meta['choices'])}]" if meta["choices"] else ""
            default = f.default if f.default is not dataclasses.MISSING else None
            group.add_argument(*names, dest=f.name, default=argparse.SUPPRESS, metavar="V",
                               help=f"{meta['help']}{extra} (default: {default})")
    ignored = parser.add_argument_group("accepted for compatibility with the reference, ignored")
    for name in IGNORED_REFERENCE_FLAGS:
        ignored.add_argument(f"--{name}", dest=f"ignored__{name}", default=argparse.SUPPRESS,
                             metavar="V", help=argparse.SUPPRESS)
    return parser


def parse_args(argv: list[str] | None, prog: str = "fsdpkit train") -> tuple[TrainConfig, list[str]]:
    """Parse flags into a validated TrainConfig; returns it with notices for ignored flags."""
    parser = build_parser(prog)
    ns, unknown = parser.parse_known_args(argv)
    if unknown:
        raise UserError(f"unknown option {unknown[0]!r} (see `{prog} --help`)")
    values = dict(vars(ns))
    values.pop("json", None)
    cfg, notices = TrainConfig(), []
    config_file = values.pop("config", None)
    if config_file:
        load_yaml(config_file, cfg, notices)
    index = field_index()
    # The flag the user typed may be an alias; dest is the canonical field name.
    for dest, raw in values.items():
        name = dest.removeprefix("ignored__")
        _set(cfg, name, raw, index, notices)
    validate(cfg)
    return cfg, notices


def _check_ranges(obj: Any) -> None:
    for f, _tp in _fields(type(obj)):
        v, m = getattr(obj, f.name), f.metadata
        if v is None:
            continue
        if m["choices"] and v not in m["choices"]:
            raise UserError(f"{f.name}: {v!r} is not allowed; choose one of: {', '.join(m['choices'])}")
        if m["min"] is not None and v < m["min"]:
            raise UserError(f"{f.name}: {v} is out of range; it must be >= {m['min']}")
        if m["max"] is not None and v > m["max"]:
            raise UserError(f"{f.name}: {v} is out of range; it must be <= {m['max']}")


def validate(cfg: TrainConfig) -> None:
    """Reject a bad configuration before anything is written or launched."""
    _check_ranges(cfg)
    for s in SECTIONS:
        _check_ranges(getattr(cfg, s))
    m = cfg.model_config()
    if m.dim % m.n_heads:
        raise UserError(f"n_heads: {m.n_heads} must divide dim ({m.dim}); pick a divisor of {m.dim}")
    if m.n_heads % m.n_kv_heads:
        raise UserError(f"n_kv_heads: {m.n_kv_heads} must divide n_heads ({m.n_heads})")
    if m.head_dim % 2:
        raise UserError(f"dim/n_heads: head size {m.head_dim} must be even for rotary embeddings")
    if m.is_moe and m.experts_per_token > m.n_experts:
        raise UserError(f"experts_per_token: {m.experts_per_token} must be <= n_experts ({m.n_experts})")
    o = cfg.optim
    if o.min_lr is not None and o.min_lr > o.lr:
        raise UserError(f"min_lr: {o.min_lr} must be <= lr ({o.lr})")
    if cfg.warmup_steps() > o.max_steps:
        raise UserError(f"warmup_steps: {cfg.warmup_steps()} must be <= max_steps ({o.max_steps})")
    if cfg.checkpoint.resume_from_checkpoint == "auto" and not cfg.checkpoint.checkpoint_dir:
        raise UserError("resume_from_checkpoint: 'auto' needs --checkpoint_dir to know where to look")
    if cfg.parallel.float8 and cfg.parallel.device == "cpu":
        raise UserError("float8: needs an NVIDIA GPU (Ada, Hopper or newer); it cannot run with --device cpu")
    if cfg.checkpoint.checkpoint_freq and not cfg.checkpoint.checkpoint_dir:
        raise UserError("checkpoint_freq: needs --checkpoint_dir to know where checkpoints go")
