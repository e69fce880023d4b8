"""Typed training configuration: the one place defaults live.

Values come from the field defaults (which are the embedded default run of `make run`), then the
preset's recipe (fsdpkit.train.model.presets), then a YAML file or a job spec's `train:`, then
`--key value` flags. The sections are `fsdpkit.settings` models, so types, ranges and choices are
checked the same way as a job spec's. `build` then resolves once what no layer gave (sequence
length, warm-up, the learning-rate floor, validation's size, the model's whole shape) into the
fields of a frozen config, so a run's config.yaml says exactly what ran. Every field is a flag
under its own name; the reference FSDP example's flag names are accepted as aliases so existing
job manifests keep working.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import functools
import logging
import math
import os
from collections.abc import Set
from pathlib import Path
from typing import Any

from pydantic import PrivateAttr
from pydantic.fields import FieldInfo

from fsdpkit.envelope import Parser
from fsdpkit.errors import UserError
from fsdpkit.settings import (
    Int,
    Settings,
    Str,
    aliases,
    bound,
    choices,
    load,
    option,
    scalar_type,
    section_of,
)
from fsdpkit.train.checkpoint import catalog
from fsdpkit.train.model.config import (
    LoraShape,
    ModelConfig,
    check_context_layout,
    check_expert_layout,
    family_attention,
)
from fsdpkit.train.model.hf_config import model_config_from_hf
from fsdpkit.train.model.presets import get_preset, get_recipe, match_preset
from fsdpkit.train.sections import (
    VALIDATION_SHARE,
    CheckpointConfig,
    DataConfig,
    LogConfig,
    LoraConfig,
    LossConfig,
    ModelOverrides,
    OptimConfig,
    ParallelConfig,
    ResolvedData,
    ResolvedLog,
    ResolvedModel,
    ResolvedOptim,
)
from fsdpkit.train.token_meta import shards_tokenizer
from fsdpkit.yamlfile import load_mapping

log = logging.getLogger(__name__)

# A recipe's warm-up (written for its published run) takes at most this share of a shorter run.
RECIPE_WARMUP_SHARE = 0.2


class TrainOptions(Settings):
    """Every option of a run, as the layers give them: a field left None is derived by `resolve`.
    The flags, a YAML file's keys and a job spec's `train:` are these fields."""

    preset: Str = option("tiny", "model preset (see `fsdpkit presets`)")
    run_dir: Str | None = option(None, "directory for metrics, config and events (default: runs/<time>-<preset>)")
    seed: Int = option(1234, "seed for initialisation and data order", ge=0)
    model: ModelOverrides = option(default_factory=ModelOverrides)
    data: DataConfig = option(default_factory=DataConfig)
    optim: OptimConfig = option(default_factory=OptimConfig)
    parallel: ParallelConfig = option(default_factory=ParallelConfig)
    log: LogConfig = option(default_factory=LogConfig)
    checkpoint: CheckpointConfig = option(default_factory=CheckpointConfig)
    adapters: LoraConfig = option(default_factory=LoraConfig)
    loss: LossConfig = option(default_factory=LossConfig)
    _shape: ModelConfig | None = PrivateAttr(default=None)
    # The fields a layer (a YAML file, a job spec, a flag) set, by name: what config.yaml records as
    # given; what no layer set is derived again when the file is read.
    _given: frozenset[str] = PrivateAttr(default=frozenset())

    @property
    def shape(self) -> ModelConfig:
        """The model's whole shape: the preset's (or the Hugging Face config's) with `model`'s changes."""
        if self._shape is None:
            self._shape = _shape(self)
        return self._shape


class TrainConfig(TrainOptions):
    """A run's options with every derived value resolved into its field (`resolve`, through
    `build`): what the components are given, each its own section, and what a run records."""

    model: ResolvedModel
    data: ResolvedData
    optim: ResolvedOptim
    log: ResolvedLog

    @property
    def lora_shape(self) -> LoraShape | None:
        """The LoRA adapters the run trains, or None (the whole model trains)."""
        c = self.adapters
        return LoraShape(c.lora_rank, c.lora_alpha, c.lora_dropout, c.targets, c.base_dtype) if c.lora else None

    def validation_share(self, steps: int | None = None) -> float:
        """Validation's FLOPs as a share of training's, over `steps` (default: max_steps)."""
        return _validation_share(steps or self.optim.max_steps, self.log.validation_freq, self.log.validation_batches,
                                 self.data.val_batch_size, self.data.train_batch_size, self.data.grad_accum_steps,
                                 self.log.validate_at_start)

    def record(self, run_dir: Path) -> dict[str, Any]:
        """Every value the run uses, the model's shape and run directory included (a checkpoint's
        fsdpkit.json and the run's summary hold this)."""
        return {**self.model_dump(), "run_dir": str(run_dir)}

    def replay(self, run_dir: Path) -> dict[str, Any]:
        """What config.yaml holds: the options a layer gave (with the preset and run directory) at the
        top, and every value worked out from them (the preset's recipe and shape, the defaults, the
        rules of `resolve`) under `derived:`, which `load_yaml` does not read back. So `fsdpkit train
        --config RUN_DIR/config.yaml` runs the same again, and with `--lr 1e-3` the floor follows the
        new peak, as the warm-up follows a new --max-steps and the recipe another --preset."""
        doc = self.record(run_dir)
        derived: dict[str, Any] = {}
        kept = self._given | {"preset", "run_dir"}
        for section in (None, *SECTIONS):
            values = doc if section is None else doc[section]
            for name in [n for n in values if n not in SECTIONS and n not in kept]:
                (derived if section is None else derived.setdefault(section, {}))[name] = values.pop(name)
        given = {k: v for k, v in doc.items() if v != {} or k not in SECTIONS}
        return {**given, DERIVED_KEY: derived}


def _validation_share(steps: int, freq: int, batches: int, val_batch: int, train_batch: int, accum: int,
                      at_start: bool) -> float:
    """Validation's FLOPs as a share of training's: a pass every `freq` steps, once at the end and
    (`at_start`) once before the first step, where a forward is a third of a training step's work
    per token (2 of 6 FLOPs per parameter)."""
    passes = (steps // freq + (1 if steps % freq else 0) if freq else 1) + at_start
    return passes * batches * val_batch / (3 * steps * train_batch * accum)


def _shape(cfg: TrainOptions, on_nodes: bool = False) -> ModelConfig:
    """The preset's shape, or the Hugging Face config's. `on_nodes`: the config is a cluster job's,
    whose init_from_hf may be a path only its nodes have (shared storage); where it is not here,
    the job's preset stands for the model until the nodes read the real config."""
    hf = cfg.checkpoint.init_from_hf
    if hf and not (on_nodes and not Path(hf).exists()):
        base = model_config_from_hf(Path(hf))
    else:
        base = get_preset(cfg.preset)
    changes = {k: v for k, v in cfg.model.model_dump().items() if v is not None}
    if changes.get("sliding_window") == 0:
        changes["sliding_window"] = None
    family = changes.get("family")
    if family is not None:
        # The family's class fixes its attention (Qwen 3's q/k norms, Qwen 2's biases) whatever else
        # is given: an export names that class, and the weights must be the ones it holds.
        changes = {**family_attention(family), **changes}
    if family in _MOE_FAMILY_SHAPE and "n_experts" not in changes and not base.is_moe:
        changes = {**_MOE_FAMILY_SHAPE[family], **changes}
    return dataclasses.replace(base, **changes)


# What `--family` (the reference's `--model_type`) of a mixture of experts builds on a dense shape
# where the experts are not given: Mixtral's 8 experts, top-2; Qwen3-MoE's 128, top-8. Options given win.
_MOE_FAMILY_SHAPE: dict[str, dict[str, Any]] = {
    "mixtral": {"n_experts": 8, "experts_per_token": 2},
    "qwen3_moe": {"n_experts": 128, "experts_per_token": 8},
}


SECTIONS = ("model", "data", "optim", "parallel", "log", "checkpoint", "adapters", "loss")

# config.yaml's block of derived values: shown for the reader, skipped when the file is read again.
DERIVED_KEY = "derived"
REPLAY_HEAD = ("# `fsdpkit train --config THIS_FILE` runs this again; flags override it. Above `derived:`, the\n"
               "# options given; under it, what the preset, the defaults and the rules made of them: worked\n"
               "# out again when this file is read, so a new --lr moves min_lr with it.\n")

# Reference flags that have no counterpart here: accepted so old manifests run, with a notice.
IGNORED_REFERENCE_FLAGS = {
    "resid_pdrop": "the model uses no dropout",
    "embd_pdrop": "the model uses no dropout",
    "attn_pdrop": "the model uses no dropout",
    "summary_first_pdrop": "the model uses no dropout",
    "rotary_pct": "RoPE covers the whole head (Llama family)",
    "rotary_emb_base": "the reference passes it only to GPT-NeoX; Llama, Mistral and Mixtral keep their published "
                       "RoPE base (change it with --rope-theta)",
    "offload_activations": "use --activation-checkpointing instead",
    "activation_loading_horizon": "FSDP1 option without an FSDP2 counterpart",
    "limit_all_gathers": "FSDP1 option; FSDP2 bounds all-gathers itself",
    "same_seed": "every rank shares the seed; data order is derived per rank",
    "plateau": "plateau schedules are not supported",
    "output_attentions": "not used in training",
    "output_hidden_states": "not used in training",
    "use_cache": "not used in training",
}


def _section_classes() -> dict[str | None, type[Settings]]:
    return {None: TrainOptions, **{s: section_of(TrainOptions, s) for s in SECTIONS}}


def _fields(cls: type[Settings]) -> list[tuple[str, FieldInfo]]:
    """The options of one section (the top level's sections are not options)."""
    return [(name, f) for name, f in cls.model_fields.items() if name not in SECTIONS]


@functools.cache
def field_index() -> dict[str, tuple[str | None, str]]:
    """Every flag name and alias -> (section, field name)."""
    index: dict[str, tuple[str | None, str]] = {}
    for section, cls in _section_classes().items():
        for name, f in _fields(cls):
            for flag in (name, *aliases(f)):
                index[flag] = (section, name)
    return index


def _field_name(name: str) -> str:
    """The field a flag name or alias names (a name no field has: itself)."""
    return field_index().get(name, (None, name))[1]


def flag(name: str) -> str:
    """The flag of a field (or of an alias, the field's own): kebab case, `--max-steps`."""
    return "--" + _field_name(name).replace("_", "-")


def _did_you_mean(name: str, as_flag: bool = True) -> str:
    """`; did you mean --max-steps?` (a YAML key: `max_steps`) for a near miss of an option, else nothing."""
    bare = name.split("=", 1)[0].lstrip("-").replace("-", "_")
    close = difflib.get_close_matches(bare, [*field_index(), *IGNORED_REFERENCE_FLAGS, "config"], n=1, cutoff=0.75)
    if not close:
        return ""
    return f"; did you mean {flag(close[0]) if as_flag else _field_name(close[0])}?"


def _items(doc: dict[str, Any]) -> list[tuple[str, Any]]:
    """`key: value` pairs of a mapping whose `section: {key: value}` blocks are flattened."""
    out: list[tuple[str, Any]] = []
    for key, value in doc.items():
        if key in SECTIONS and isinstance(value, dict):
            out += [(str(k), v) for k, v in value.items()]
        else:
            out.append((str(key), value))
    return out


def _nest(items: list[tuple[str, Any]], index: dict[str, tuple[str | None, str]]) -> dict[str, Any]:
    """Flat options (names or aliases, later ones winning) as the sections' mapping."""
    doc: dict[str, Any] = {}
    for key, value in items:
        if key not in index:
            raise UserError(f"unknown option {key!r}{_did_you_mean(key, as_flag=False)} (see `fsdpkit train --help`)")
        section, name = index[key]
        (doc if section is None else doc.setdefault(section, {}))[name] = value
    return doc


def build(layers: list[dict[str, Any]], on_nodes: bool = False, ranks: int | None = None) -> TrainConfig:
    """The one way a TrainConfig is made from settings. Layers (a YAML file, a job spec's `train:`,
    flags) apply in order over the preset's recipe, which lies over the field defaults. The preset is
    the one a layer names; with none, a reference-style `--model_type` plus dimensions names the
    preset of that shape (the reference example has no presets). Then `resolve` fills in what no
    layer gave and `validate` checks the whole."""
    index = field_index()
    items = []
    for key, value in (kv for layer in layers for kv in _items(layer)):
        if key in IGNORED_REFERENCE_FLAGS:
            log.info(f"note: --{key} is accepted and ignored: {IGNORED_REFERENCE_FLAGS[key]}")
        else:
            items.append((key, value))
    given = _nest(items, index)
    first = load(TrainOptions, given, flat=True)   # types and ranges, before the preset is chosen
    preset = first.preset
    model_type = next((v for k, v in reversed(items) if index[k][1] == "family"), None)
    if "preset" not in given and model_type is not None:
        shape = {k: getattr(first.model, k) for k in ("dim", "n_layers", "n_heads", "ffn_dim")}
        preset = match_preset(str(model_type).strip().lower(), shape) or preset
    recipe = list(_recipe_for(preset, first).items())
    resumed = _resumed_data(first, {index[k][1] for k, _ in items}, dict(recipe))
    cfg = load(TrainOptions, _nest([("preset", preset), *recipe, *resumed, *items], index), flat=True)
    named = {name for _, name in (index[k] for k, _ in items)}
    cfg = resolve(cfg, named, on_nodes, ranks)
    _check_lora_options(cfg, named)
    validate(cfg)
    if "preset" in given:
        _check_preset_fits_weights(cfg)
    return cfg


# LoRA's own options: given without --lora they would be read by nothing.
LORA_OPTIONS = ("lora_rank", "lora_alpha", "lora_dropout", "lora_targets")


def _check_lora_options(cfg: TrainConfig, named: Set[str]) -> None:
    if not cfg.adapters.lora and (given := [o for o in LORA_OPTIONS if o in named]):
        flag = "--" + given[0].replace("_", "-")
        raise UserError(f"{given[0]}: a LoRA option, but this run trains the whole model; add --lora 1, or drop {flag}")


def _check_preset_fits_weights(cfg: TrainConfig) -> None:
    """A preset named beside --init-from-hf brings its recipe; the weights' config.json brings the
    shape. A preset of another family is a mistake (a Qwen recipe on Llama weights, a run labelled as
    a model it is not); of the same family and another size, its recipe is said to be for another size."""
    hf = cfg.checkpoint.init_from_hf
    if not hf or not Path(hf).exists():
        return
    preset, weights = get_preset(cfg.preset), cfg.shape
    if preset.family != weights.family:
        raise UserError(f"preset: {cfg.preset} is a {preset.family} model and {hf} holds a {weights.family} one "
                        f"(its config.json); drop --preset to train the weights as they are, or pick a "
                        f"{weights.family} preset")
    if (preset.dim, preset.n_layers) != (weights.dim, weights.n_layers):
        log.info(f"note: preset {cfg.preset} is {preset.n_layers} layers of {preset.dim}; {hf} holds "
                 f"{weights.n_layers} of {weights.dim}: the weights' shape with the preset's recipe")


# What a run learns from, which a resume keeps unless told otherwise: its text and how it is
# tokenised. (Another vocabulary would be another model shape, which resuming refuses anyway.)
RESUMED_DATA = (("data", "dataset"), ("data", "dataset_config_name"), ("data", "text_field"),
                ("data", "tokenizer"), ("model", "vocab_size"))


def resume_target(cfg: TrainOptions) -> str | None:
    """Where a run resumes from: the option, with 'auto' meaning checkpoint_dir. A worker that
    torchrun restarted after a failure resumes from checkpoint_dir even when no option says so."""
    ck = cfg.checkpoint
    if ck.resume_from_checkpoint == "auto":
        return ck.checkpoint_dir
    if ck.resume_from_checkpoint:
        return ck.resume_from_checkpoint
    restarted = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0
    return ck.checkpoint_dir if restarted and ck.checkpoint_dir else None


def _same_data(mine: Any, theirs: Any) -> bool:
    """One value of RESUMED_DATA: paths of this machine compare by where they lead."""
    if mine == theirs:
        return True
    paths = [Path(str(v)).expanduser() for v in (mine, theirs)]
    return all(p.exists() for p in paths) and paths[0].resolve() == paths[1].resolve()


def _resumed_data(first: TrainOptions, given: set[str], recipe: dict[str, Any]) -> list[tuple[str, Any]]:
    """On a resume, the checkpoint's data and tokenizer for what no layer gives (said where they
    differ from the recipe's or the default); another one given is refused in one line unless
    `resume_new_data`. Read from the checkpoint's fsdpkit.json; a checkpoint that cannot be read
    here is resume's to report."""
    target = resume_target(first)
    try:
        found = catalog.resolve(target) if target else None
    except (UserError, OSError, ValueError):
        found = None
    saved = found.meta.get("config") if found is not None and isinstance(found.meta, dict) else None
    if found is None or not isinstance(saved, dict):
        return []
    taken, changed = [], []
    for section, name in RESUMED_DATA:
        if name not in (saved.get(section) or {}):
            continue
        theirs, mine = saved[section][name], getattr(getattr(first, section), name)
        if name not in given:
            taken.append((name, theirs))
            if theirs != recipe.get(name, mine):
                log.info(f"fsdpkit: {name} {theirs!r}, as the checkpoint in {found.path.parent} was trained "
                         "(the default on resume)")
        elif not _same_data(mine, theirs):
            changed.append(f"{name} {mine!r} (the checkpoint's: {theirs!r})")
    if changed and not first.checkpoint.resume_new_data:
        raise UserError(f"resume_from_checkpoint: {found.path} was trained on other data than this run names: "
                        f"{'; '.join(changed)}; drop those options to continue on its data, or pass "
                        "--resume-new-data 1 to change it deliberately")
    if changed:
        log.warning(f"resuming {found.path} on other data, as --resume-new-data asks: {'; '.join(changed)}")
    return taken


def resolve(cfg: TrainOptions, given: Set[str] = frozenset(), on_nodes: bool = False,
            ranks: int | None = None) -> TrainConfig:
    """The config with every derived value written into its field (sequence length, the steps a
    token budget means, warm-up, learning-rate floor, validation batch size and count, the model's
    shape), so it holds what the run does. `given` names the fields a layer set: a recipe's warm-up,
    not given, is capped for a short run. `ranks`: the ranks of the run, whose data-parallel
    shares a token budget is spread over (default: the ranks torchrun started, else --nproc)."""
    o, d, lg, shape = cfg.optim, cfg.data, cfg.log, _shape(cfg, on_nodes)
    data = ResolvedData(**{**d.model_dump(), "seq_len": d.seq_len or min(shape.max_seq_len, 2048),
                           "val_batch_size": d.val_batch_size or d.train_batch_size,
                           "tokenizer": _tokenizer(cfg, given, on_nodes)})
    steps = o.max_steps
    if o.tokens is not None:
        if "max_steps" in given:
            raise UserError(f"tokens: give a token budget or max_steps ({o.max_steps}), not both")
        world = ranks or int(os.environ.get("WORLD_SIZE") or cfg.parallel.nproc)
        steps = budget_steps(o.tokens, data, cfg.parallel.data_ranks(world))
    warmup_steps = o.warmup_steps
    if "warmup_steps" not in given and warmup_steps is not None:   # the recipe's
        # The user's fraction wins over the recipe's steps; else the recipe's, capped.
        warmup_steps = None if "warmup" in given else min(warmup_steps, round(RECIPE_WARMUP_SHARE * steps))
    if warmup_steps is None:
        warmup_steps = round(o.warmup * steps)
    min_lr = o.min_lr if o.min_lr is not None else float(f"{o.lr * o.min_lr_ratio:.12g}")  # 3e-5, not 2.99..e-05
    batches = lg.validation_batches
    if batches is None:
        per_batch = _validation_share(steps, lg.validation_freq, 1, data.val_batch_size, data.train_batch_size,
                                      data.grad_accum_steps, lg.validate_at_start)
        batches = max(1, min(8, math.floor(VALIDATION_SHARE / per_batch + 1e-9)))
    out = TrainConfig(
        **{k: getattr(cfg, k) for k in ("preset", "run_dir", "seed")},
        model=ResolvedModel(**{k: getattr(shape, k) for k in ModelOverrides.model_fields}
                            | {"sliding_window": shape.sliding_window or 0}),
        data=data,
        optim=ResolvedOptim(**{**o.model_dump(), "max_steps": steps, "warmup_steps": warmup_steps, "min_lr": min_lr}),
        parallel=cfg.parallel,
        log=ResolvedLog(**{**lg.model_dump(), "validation_batches": batches}),
        checkpoint=cfg.checkpoint,
        adapters=cfg.adapters,
        loss=cfg.loss,
    )
    out._shape = shape
    out._given = frozenset(given)
    return out


def step_tokens(data: ResolvedData, ranks: int) -> int:
    """Tokens one optimizer step trains on: every rank's micro-batches of full sequences."""
    return data.seq_len * data.train_batch_size * data.grad_accum_steps * ranks


def budget_steps(tokens: int, data: ResolvedData, ranks: int) -> int:
    """The optimizer steps a token budget means: enough to train on all of it."""
    return math.ceil(tokens / step_tokens(data, ranks))


def _run_kind(cfg: TrainOptions) -> dict[str, bool]:
    return {"chat": cfg.data.data_format == "chat", "lora": bool(cfg.adapters.lora),
            "dpo": cfg.loss.objective == "dpo", "nf4": cfg.adapters.base_dtype == "nf4"}


def _recipe_for(preset: str, cfg: TrainOptions) -> dict[str, Any]:
    """The preset's recipe for this kind of run: chat fine-tuning, LoRA (QLoRA) and DPO lay their values over it."""
    return get_recipe(preset).for_run(**_run_kind(cfg))


def recipe_source(cfg: TrainOptions) -> str:
    """Where this run's recipe has its numbers from (the layers its kind lays over the preset's)."""
    return get_recipe(cfg.preset).source_for(**_run_kind(cfg))


def _tokenizer(cfg: TrainOptions, given: Set[str], on_nodes: bool) -> str:
    """The tokenizer: token shards' own (`data prepare` made them with it; another is refused); as
    given; else, starting from Hugging Face weights, the one saved with them (their tokenizer.json;
    on a cluster job's nodes, the directory they read); else the recipe's."""
    if (theirs := shards_tokenizer(cfg.data.dataset)) is not None:
        if "tokenizer" in given and not _same_data(cfg.data.tokenizer, theirs):
            raise UserError(f"tokenizer: the token shards in {cfg.data.dataset} were made with {theirs!r}, not "
                            f"{cfg.data.tokenizer!r}; drop --tokenizer (training on shards uses theirs), or prepare "
                            "the data again with this one")
        return theirs
    hf = cfg.checkpoint.init_from_hf
    if "tokenizer" in given or not hf:
        return cfg.data.tokenizer
    here = Path(hf).exists()
    return hf if (here and (Path(hf) / "tokenizer.json").is_file()) or (on_nodes and not here) else cfg.data.tokenizer


def recipe_values(cfg: TrainConfig) -> dict[str, Any]:
    """The options the preset's recipe sets, with the values this config resolved them to."""
    index = field_index()
    out = {}
    for key in _recipe_for(cfg.preset, cfg):
        section, name = index[key]
        out[key] = getattr(cfg if section is None else getattr(cfg, section), name)
    return out


def load_yaml(path: str | os.PathLike[str]) -> dict[str, Any]:
    """A YAML file of `key: value` pairs or `section: {key: value}` blocks. A run's config.yaml
    lists its derived values under `derived:`; they are not options, so they are re-derived."""
    doc = load_mapping(path, "config", "option names to values")
    doc.pop(DERIVED_KEY, None)
    return doc


def to_flags(doc: dict[str, Any]) -> list[str]:
    """The same mapping as `--key value` flags, sections flattened (every field name is unique), each
    under its field's kebab-case flag whatever name (an alias) the mapping used."""
    flags: list[str] = []
    for key, value in doc.items():
        items = value.items() if key in SECTIONS and isinstance(value, dict) else [(key, value)]
        for k, v in items:
            flags += [flag(k), "none" if v is None else str(v).lower() if isinstance(v, bool) else str(v)]
    return flags


def _metavar(name: str, f: FieldInfo) -> str:
    """What a flag takes, by type: {a,b} for choices, INT, FLOAT, BOOL, DIR, or STR."""
    if options := choices(f):
        return "{" + ",".join(options) + "}"
    base, _ = scalar_type(f)
    if base is str and (name.endswith("_dir") or name in ("init_from_hf", "resume_from_checkpoint")):
        return "DIR"
    return {int: "INT", float: "FLOAT", bool: "BOOL"}.get(base, "STR")


def option_schema(name: str) -> dict[str, Any] | None:
    """A training option's values as JSON Schema, from its field: type or choices and the allowed
    range (what an agent's tool shows; None for a name no option has)."""
    if name not in field_index():
        return None
    section, field_name = field_index()[name]
    f = _section_classes()[section].model_fields[field_name]
    if options := choices(f):
        return {"enum": list(options)}
    base, _ = scalar_type(f)
    schema: dict[str, Any] = {int: {"type": "integer"}, float: {"type": "number"},
                              bool: {"type": "boolean"}}.get(base, {"type": "string"})
    for key, keyword in (("ge", "minimum"), ("le", "maximum")):
        if schema["type"] != "string" and (value := bound(f, key)) is not None:
            schema[keyword] = value
    return schema


def _help(f: FieldInfo) -> str:
    """The field's help with its default once: stated in the text where the default is a rule."""
    text = f.description or ""
    if "default:" in text or f.default is None:
        return text
    return f"{text} (default: {str(f.default).lower() if isinstance(f.default, bool) else f.default})"


def build_parser(prog: str = "fsdpkit train") -> argparse.ArgumentParser:
    """The training flags, generated from the fields (so help and defaults cannot drift)."""
    parser = Parser(
        prog=prog, allow_abbrev=False,
        description="Train a Llama-family model with FSDP2. With no flags: the embedded default run. Each option "
                    "is also taken in snake case (--max_steps), as are the reference FSDP example's flags "
                    "(--max_context_width, --num_layers, --model_type, ...).",
    )
    parser.add_argument("--config", help="YAML file with option values (flags override it)")
    # Read by fsdpkit.train.launch (how to report), not a training option.
    parser.add_argument("--json", action="store_true", default=argparse.SUPPRESS,
                        help="print one JSON envelope with the run's summary on stdout; progress goes to stderr")
    for section, cls in _section_classes().items():
        group = parser.add_argument_group(section or "run")
        for name, f in _fields(cls):
            # Kebab case listed; the field's snake-case name and the reference's flags taken unlisted,
            # so job manifests and YAML-minded users keep working.
            parser.add_training_option(flag(name), *aliases(f), group=group, dest=name, default=argparse.SUPPRESS,
                                       metavar=_metavar(name, f), help=_help(f).replace("%", "%%"))
    ignored = parser.add_argument_group("accepted for compatibility with the reference, ignored")
    for name in IGNORED_REFERENCE_FLAGS:
        ignored.add_argument(f"--{name}", dest=f"ignored__{name}", default=argparse.SUPPRESS,
                             metavar="V", help=argparse.SUPPRESS)
    return parser


def parse_args(argv: list[str] | None, prog: str = "fsdpkit train") -> TrainConfig:
    """Parse flags into a validated TrainConfig (the flags it ignores are said through logging)."""
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
    return build(layers)


def validate(cfg: TrainConfig) -> None:
    """The rules between fields (each field's own range is its type's), before anything is written
    or launched."""
    _validate_shape(cfg.shape)
    o = cfg.optim
    if o.min_lr > o.lr:
        raise UserError(f"min_lr: {o.min_lr} must be <= lr ({o.lr})")
    if o.warmup_steps > o.max_steps:
        raise UserError(f"warmup_steps: {o.warmup_steps} must be <= max_steps ({o.max_steps})")
    if cfg.checkpoint.resume_from_checkpoint == "auto" and not cfg.checkpoint.checkpoint_dir:
        raise UserError("resume_from_checkpoint: 'auto' needs --checkpoint-dir to know where to look")
    _validate_adapters(cfg)
    if (cfg.loss.objective == "dpo") != (cfg.data.data_format == "preference"):
        raise UserError("objective: dpo trains on preference records and they train only with it: pass --objective "
                        "dpo with --data-format preference")
    _validate_parallel(cfg)
    if (cfg.checkpoint.every_steps or cfg.checkpoint.every_seconds) and not cfg.checkpoint.checkpoint_dir:
        raise UserError("checkpoint_every: needs --checkpoint-dir to know where checkpoints go")
    if cfg.checkpoint.tiered and not cfg.checkpoint.checkpoint_dir:
        raise UserError("tiered: needs --checkpoint-dir, the durable tier (where the last step and every "
                        "durable_every-th checkpoint go)")


def _validate_parallel(cfg: TrainConfig) -> None:
    """float8's device, context and expert parallel's layouts."""
    if cfg.parallel.float8 and cfg.parallel.device == "cpu":
        raise UserError("float8: needs an NVIDIA GPU (Ada, Hopper or newer); it cannot run with --device cpu")
    if cfg.parallel.context_parallel > 1:
        check_context_layout(cfg.shape, cfg.data.seq_len, cfg.parallel.context_parallel)
        if cfg.loss.objective == "dpo":
            raise UserError("context_parallel: dpo sums each answer's log-probabilities over the whole sequence; "
                            "train it without --context-parallel")
    if cfg.parallel.expert_parallel > 1:
        check_expert_layout(cfg.shape, cfg.parallel.expert_parallel)
        if cfg.adapters.lora or cfg.parallel.cpu_offload or cfg.loss.objective == "dpo":
            raise UserError("expert_parallel: not with --lora, --cpu-offload or --objective dpo (expert weights split "
                            "by expert are trained whole, kept on the GPU, and not yet run under DPO's reference); "
                            "drop one of them")


def _validate_adapters(cfg: TrainConfig) -> None:
    """LoRA's and QLoRA's rules."""
    if cfg.adapters.base_dtype == "nf4" and not cfg.adapters.lora:
        raise UserError("base_dtype: nf4 stores the frozen base of a LoRA run (QLoRA); pass --lora 1, or drop "
                        "--base-dtype to train the whole model")
    if cfg.adapters.base_dtype == "nf4" and cfg.shape.is_moe:
        raise UserError("base_dtype: nf4 holds dense projections; a mixture-of-experts model's experts are grouped "
                        "3-D weights it cannot hold: train its adapters with --base-dtype auto")
    if cfg.adapters.lora and cfg.parallel.float8:
        raise UserError("lora: float8 linear layers would replace the adapted projections; drop --float8")
    if cfg.adapters.lora and not cfg.checkpoint.init_from_hf:
        raise UserError("lora: adapters fine-tune a trained model, and only they are saved: pass --init-from-hf "
                        "with the model's Hugging Face directory")


def _validate_shape(m: ModelConfig) -> None:
    """The model's own rules: head sizes, grouped heads, experts."""
    if m.dim % m.n_heads and not m.head_dim:
        raise UserError(f"n_heads: {m.n_heads} must divide dim ({m.dim}); pick a divisor of {m.dim}")
    if m.n_heads % m.n_kv_heads:
        raise UserError(f"n_kv_heads: {m.n_kv_heads} must divide n_heads ({m.n_heads})")
    if m.head_size % 2:
        raise UserError(f"dim/n_heads: head size {m.head_size} must be even for rotary embeddings")
    if m.is_moe and m.family in ("qwen2", "qwen3"):
        raise UserError(f"n_experts: the {m.family} family has no mixture-of-experts form; use 0, or "
                        "--family qwen3_moe (or mixtral)")
    if m.family == "qwen3_moe" and not m.is_moe:
        raise UserError("n_experts: the qwen3_moe family is a mixture of experts; give --n-experts (its "
                        "published models: 128)")
    if m.is_moe and m.experts_per_token > m.n_experts:
        raise UserError(f"experts_per_token: {m.experts_per_token} must be <= n_experts ({m.n_experts})")
