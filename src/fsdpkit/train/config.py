"""Typed training configuration: the one place defaults live.

Values come from the dataclass defaults (which are the embedded default run of `make run`), then
the preset's recipe (fsdpkit.train.presets), then a YAML file or a job spec's `train:`, then
`--key value` flags; `build` then resolves what no layer gave (sequence length, warm-up, the
learning-rate floor, validation's size) into plain values, so a run's config.yaml says exactly what
ran. Every field is a flag under its own name; the reference FSDP example's flag names are accepted
as aliases so existing job manifests keep working. Each field carries its allowed range, and
`validate` rejects a bad value up front with the field's name.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import math
import os
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fsdpkit.errors import UserError
from fsdpkit.train.model_config import ModelConfig
from fsdpkit.train.presets import get_preset, get_recipe, match_preset
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
    rope_theta: float | None = opt(None, "RoPE base", min=1)
    sliding_window: int | None = opt(None, "Mistral sliding attention window (0: none)", min=0)
    n_experts: int | None = opt(None, "MoE experts per layer (0: dense MLP; model_type mixtral without it: 8)",
                                min=0, aliases=("num_local_experts",))
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
    seq_len: int | None = opt(None, "training sequence length (default: the preset's recipe, else "
                              "min(context, 2048))", min=2, aliases=("max_context_width",))
    train_batch_size: int = opt(16, "sequences per rank per micro-step", min=1)
    val_batch_size: int | None = opt(None, "sequences per rank per validation batch (default: train_batch_size)",
                                     min=1)
    grad_accum_steps: int = opt(1, "micro-steps per optimizer step", min=1)
    epochs: int | None = opt(None, "passes over the data at most (training stops at max_steps first)",
                             min=1)


@dataclass
class OptimConfig:
    max_steps: int = opt(300, "optimizer steps to train (exact)", min=1, aliases=("max_training_steps",))
    lr: float = opt(3e-3, "peak learning rate", min=0)
    min_lr: float | None = opt(None, "learning-rate floor the schedule decays to (default: lr x min_lr_ratio)",
                               min=0)
    min_lr_ratio: float = opt(0.1, "the floor as a fraction of lr, where min_lr is not given", min=0, max=1)
    lr_decay_style: str = opt("cosine", "schedule after warm-up", choices=("cosine", "linear", "constant"))
    lr_decay_iters: int | None = opt(None, "steps to decay over (default: max_steps)", min=1)
    warmup_steps: int | None = opt(None, "linear warm-up steps (default: the preset recipe's, at most a fifth of "
                                   "max_steps; else warmup x max_steps)", min=0)
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
    require_efa: str = opt("auto", "before the first step, read which network NCCL chose and stop if it fell back to "
                           "TCP sockets where EFA was expected (auto: on for multi-node runs on EFA nodes)",
                           choices=("auto", "on", "off"))


# Validation's default size keeps its forward passes within this share of the training FLOPs.
VALIDATION_SHARE = 0.02
# A recipe's warm-up (written for its published run) takes at most this share of a shorter run.
RECIPE_WARMUP_SHARE = 0.2


@dataclass
class LogConfig:
    logging_freq: int = opt(10, "steps between metric lines", min=1)
    validation_freq: int = opt(100, "steps between validation passes (0: only at the end)", min=0)
    validation_batches: int | None = opt(
        None, f"batches per rank per validation pass (default: as many as keep validation within "
        f"{VALIDATION_SHARE:.0%} of training compute, 1 to 8)", min=1)
    tensorboard: bool = opt(True, "write TensorBoard events to RUN_DIR/tensorboard")
    tensorboard_dir: str | None = opt(None, "TensorBoard directory (default: RUN_DIR/tensorboard)")
    progress: str = opt("auto", "progress bar (auto: when attached to a terminal)",
                        choices=("auto", "on", "off"))
    peak_tflops: float | None = opt(None, "the MFU denominator, TFLOP/s per device (default: the GPU's datasheet "
                                    "figure, or this CPU's matmul rate measured at start-up)", min=1e-9)
    log_samples: bool = opt(False, "record the global index of every sample each rank trains on "
                            "(RUN_DIR/samples-rank*.jsonl), to audit data order")


@dataclass
class CheckpointConfig:
    checkpoint_dir: str | None = opt(None, "where sharded checkpoints go")
    checkpoint_freq: int = opt(0, "steps between checkpoints (0: only the last step, with a checkpoint_dir)", min=0)
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

    # -- derived values (one rule each; `build` writes them into the fields) ----------------------
    def model_config(self) -> ModelConfig:
        if self.checkpoint.init_from_hf:
            from fsdpkit.train.hf import model_config_from_hf

            base = model_config_from_hf(Path(self.checkpoint.init_from_hf))
        else:
            base = get_preset(self.preset)
        changes = {k: v for k, v in dataclasses.asdict(self.model).items() if v is not None}
        if changes.get("sliding_window") == 0:
            changes["sliding_window"] = None
        if changes.get("family") == "mixtral" and "n_experts" not in changes and not base.is_moe:
            # The reference's `--model_type=mixtral` builds Mixtral's 8 experts, top-2.
            changes.update(n_experts=8, experts_per_token=changes.get("experts_per_token", 2))
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
        if self.optim.min_lr is not None:
            return self.optim.min_lr
        return float(f"{self.optim.lr * self.optim.min_lr_ratio:.12g}")  # 3e-5, not 2.9999999999999997e-05

    def val_batch_size(self) -> int:
        return self.data.val_batch_size or self.data.train_batch_size

    def validation_passes(self) -> int:
        """Validation passes in a whole run: every validation_freq steps, and once at the end."""
        n, freq = self.optim.max_steps, self.log.validation_freq
        return n // freq + (1 if n % freq else 0) if freq else 1

    def validation_share(self, batches: int | None = None) -> float:
        """Validation's FLOPs as a share of training's: a forward is a third of a training step's
        work per token (2 of 6 FLOPs per parameter)."""
        batches = batches or self.log.validation_batches or 1
        val = self.validation_passes() * batches * self.val_batch_size()
        train = 3 * self.optim.max_steps * self.data.train_batch_size * self.data.grad_accum_steps
        return val / train

    def validation_batches(self) -> int:
        if self.log.validation_batches is not None:
            return self.log.validation_batches
        per_batch = self.validation_share(1)
        return max(1, min(8, math.floor(VALIDATION_SHARE / per_batch + 1e-9)))

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def record(self, run_dir: Path) -> dict[str, Any]:
        """Every value the run uses, the model's shape and run directory included: what config.yaml
        holds, so `fsdpkit train --config RUN_DIR/config.yaml` runs the same again."""
        out = self.to_dict()
        out["run_dir"] = str(run_dir)
        m = self.model_config()
        out["model"] = {k: getattr(m, k) for k in out["model"]}
        out["model"]["sliding_window"] = m.sliding_window or 0
        return out


SECTIONS = ("model", "data", "optim", "parallel", "log", "checkpoint")

# Reference flags that have no counterpart here: accepted so old manifests run, with a notice.
IGNORED_REFERENCE_FLAGS = {
    # fsdpkit's own earlier option (config.yaml files of older runs carry it): attention is SDPA everywhere.
    "attention": "attention is PyTorch's scaled_dot_product_attention on every device",
    "resid_pdrop": "the model uses no dropout",
    "embd_pdrop": "the model uses no dropout",
    "attn_pdrop": "the model uses no dropout",
    "summary_first_pdrop": "the model uses no dropout",
    "rotary_pct": "RoPE covers the whole head (Llama family)",
    "rotary_emb_base": "the reference passes it only to GPT-NeoX; Llama, Mistral and Mixtral keep their published "
                       "RoPE base (change it with --rope_theta)",
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
        if base in (int, float) and isinstance(raw, bool):
            raise ValueError  # YAML's `true` is not the number 1
        if base is int:
            if isinstance(raw, float) and not raw.is_integer():
                raise ValueError
            return int(raw) if not isinstance(raw, str) else int(raw.strip())
        if base is float:
            value = float(raw)
            if not math.isfinite(value):
                raise UserError(f"{name}: expected a finite number, got {raw!r}")
            return value
        return str(raw)
    except (TypeError, ValueError):
        kind = {bool: "true or false", int: "an integer", float: "a number"}.get(base, "a string")
        raise UserError(f"{name}: expected {kind}, got {raw!r}") from None


def _did_you_mean(name: str) -> str:
    """`; did you mean --max_steps?` for a near miss of an option name, else nothing."""
    bare = name.split("=", 1)[0].lstrip("-").replace("-", "_")
    close = difflib.get_close_matches(bare, [*field_index(), *IGNORED_REFERENCE_FLAGS, "config"], n=1, cutoff=0.75)
    return f"; did you mean --{close[0]}?" if close else ""


def _set(cfg: TrainConfig, name: str, raw: Any, index: dict) -> str:
    """Set one option; returns its field's name."""
    if name not in index:
        raise UserError(f"unknown option {name!r}{_did_you_mean(name)} (see `fsdpkit train --help`)")
    section, f, tp = index[name]
    target = cfg if section is None else getattr(cfg, section)
    setattr(target, f.name, convert(name, raw, f, tp))
    return f.name


def _items(doc: dict[str, Any]) -> list[tuple[str, Any]]:
    """`key: value` pairs of a mapping whose `section: {key: value}` blocks are flattened."""
    out: list[tuple[str, Any]] = []
    for key, value in doc.items():
        if key in SECTIONS and isinstance(value, dict):
            out += [(str(k), v) for k, v in value.items()]
        else:
            out.append((str(key), value))
    return out


def build(layers: list[dict[str, Any]], notices: list[str] | None = None) -> TrainConfig:
    """The one way a TrainConfig is made from settings. Layers (a YAML file, a job spec's `train:`,
    flags) apply in order over the preset's recipe, which lies over the field defaults. The preset is
    the one a layer names; with none, a reference-style `--model_type` plus dimensions names the
    preset of that shape (the reference example has no presets). Then `resolve` fills in what no
    layer gave and `validate` checks the whole."""
    notices = [] if notices is None else notices
    index = field_index()
    items = []
    for key, value in (kv for layer in layers for kv in _items(layer)):
        if key in IGNORED_REFERENCE_FLAGS:
            notices.append(f"note: --{key} is accepted and ignored: {IGNORED_REFERENCE_FLAGS[key]}")
        else:
            items.append((key, value))
    cfg = TrainConfig()
    given = {_set(cfg, k, v, index) for k, v in items}
    model_type = next((v for k, v in reversed(items) if k in ("model_type", "family")), None)
    if "preset" not in given and model_type is not None:
        shape = {k: getattr(cfg.model, k) for k in ("dim", "n_layers", "n_heads", "ffn_dim")}
        cfg.preset = match_preset(str(model_type).strip().lower(), shape) or cfg.preset
    preset = cfg.preset
    cfg = TrainConfig(preset=preset)
    for key, value in get_recipe(preset).options.items():
        _set(cfg, key, value, index)
    for key, value in items:
        _set(cfg, key, value, index)
    check_ranges(cfg)  # before resolving: the derived values divide by some of these
    resolve(cfg, given)
    validate(cfg)
    return cfg


def resolve(cfg: TrainConfig, given: set[str] = frozenset()) -> TrainConfig:
    """Write every derived value into its field (sequence length, warm-up, learning-rate floor,
    validation batch size and count), so the config holds what the run does. `given` names the
    fields a layer set: a recipe's warm-up, not given, is capped for a short run."""
    o = cfg.optim
    if "warmup_steps" not in given and o.warmup_steps is not None:   # the recipe's
        if "warmup" in given:
            o.warmup_steps = None   # the user's fraction, not the recipe's steps
        else:
            o.warmup_steps = min(o.warmup_steps, round(RECIPE_WARMUP_SHARE * o.max_steps))
    cfg.data.seq_len = cfg.seq_len()
    o.warmup_steps = cfg.warmup_steps()
    o.min_lr = cfg.min_lr()
    cfg.data.val_batch_size = cfg.val_batch_size()
    cfg.log.validation_batches = cfg.validation_batches()
    return cfg


def recipe_values(cfg: TrainConfig) -> dict[str, Any]:
    """The options the preset's recipe sets, with the values this config resolved them to."""
    index = field_index()
    out = {}
    for name in get_recipe(cfg.preset).options:
        section, f, _ = index[name]
        out[name] = getattr(cfg if section is None else getattr(cfg, section), f.name)
    return out


def load_yaml(path: str | os.PathLike) -> dict[str, Any]:
    """A YAML file of `key: value` pairs or `section: {key: value}` blocks."""
    return load_mapping(path, "config", "option names to values")


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


def _metavar(f: dataclasses.Field, tp: Any) -> str:
    """What a flag takes, by type: {a,b} for choices, INT, FLOAT, BOOL, DIR, or STR."""
    if f.metadata["choices"]:
        return "{" + ",".join(f.metadata["choices"]) + "}"
    base, _ = _base_type(tp)
    if base is str and (f.name.endswith("_dir") or f.name in ("init_from_hf", "resume_from_checkpoint")):
        return "DIR"
    return {int: "INT", float: "FLOAT", bool: "BOOL"}.get(base, "STR")


def _help(f: dataclasses.Field) -> str:
    """The field's help with its default once: stated in the text where the default is a rule."""
    text = f.metadata["help"]
    if "default:" in text or f.default is None:
        return text
    return f"{text} (default: {str(f.default).lower() if isinstance(f.default, bool) else f.default})"


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
        for f, tp in _fields(cls):
            names = [f"--{f.name}"]
            if "_" in f.name:
                names.append(f"--{f.name.replace('_', '-')}")
            names += [f"--{a}" for a in f.metadata["aliases"]]
            group.add_argument(*names, dest=f.name, default=argparse.SUPPRESS, metavar=_metavar(f, tp),
                               help=_help(f).replace("%", "%%"))
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
        raise UserError(f"unknown option {unknown[0]!r}{_did_you_mean(unknown[0])} (see `{prog} --help`)")
    values = dict(vars(ns))
    values.pop("json", None)
    config_file = values.pop("config", None)
    layers = [load_yaml(config_file)] if config_file else []
    # The flag the user typed may be an alias; dest is the canonical field name.
    layers.append({dest.removeprefix("ignored__"): raw for dest, raw in values.items()})
    notices: list[str] = []
    return build(layers, notices), notices


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


def check_ranges(cfg: TrainConfig) -> None:
    """Every field within its allowed range and choices."""
    _check_ranges(cfg)
    for s in SECTIONS:
        _check_ranges(getattr(cfg, s))


def validate(cfg: TrainConfig) -> None:
    """Reject a bad configuration before anything is written or launched."""
    check_ranges(cfg)
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
