"""The sections of a run's configuration (model changes, data, optimizer, parallelism, logging,
checkpoints), each the slice of options one component is built from, and their resolved forms,
where every value a run derives is known. A leaf of the training program: the components import
their section from here, and `fsdpkit.train.config` layers, resolves and parses them."""

from __future__ import annotations

import re
from typing import Literal

from pydantic import field_validator

from fsdpkit.durations import DURATION_UNITS
from fsdpkit.errors import UserError
from fsdpkit.settings import Bool, Float, Int, Settings, Str, fail, option

TRACKERS = ("wandb", "mlflow")
Family = Literal["llama", "mistral", "mixtral", "qwen2", "qwen3", "qwen3_moe"]


def parse_trackers(raw: str | None) -> tuple[str, ...]:
    """"wandb", "mlflow", "wandb,mlflow" or "" (none); ValueError naming the allowed ones."""
    names = tuple(dict.fromkeys(n.strip().lower() for n in str(raw or "").split(",") if n.strip()))
    unknown = [n for n in names if n not in TRACKERS]
    if unknown:
        raise ValueError(f"unknown tracker {unknown[0]!r}; allowed: {', '.join(TRACKERS)} (comma-separated for both)")
    return names


# Validation's default size keeps its forward passes within this share of the training FLOPs.
VALIDATION_SHARE = 0.02


class ModelOverrides(Settings):
    """Changes to the preset's model shape; None keeps the preset's value."""

    # Upper bounds far above any published model, so a typo is refused here rather than by the allocator.
    vocab_size: Int | None = option(None, "vocabulary size", ge=1, le=2**24)
    dim: Int | None = option(None, "hidden size", ge=1, le=2**17, aliases=("hidden_width",))
    n_layers: Int | None = option(None, "number of decoder layers", ge=1, le=2048, aliases=("num_layers",))
    n_heads: Int | None = option(None, "attention heads", ge=1, le=2048, aliases=("num_heads",))
    n_kv_heads: Int | None = option(None, "key/value heads (GQA)", ge=1, le=2048, aliases=("num_key_value_heads",))
    ffn_dim: Int | None = option(None, "MLP intermediate size", ge=1, le=2**20, aliases=("intermediate_size",))
    rope_theta: Float | None = option(None, "RoPE base", ge=1)
    sliding_window: Int | None = option(None, "Mistral sliding attention window (0: none)", ge=0)
    n_experts: Int | None = option(
        None, "MoE experts per layer (0: dense MLP; model_type mixtral without it: 8, qwen3_moe: 128)", ge=0,
        aliases=("num_local_experts",))
    experts_per_token: Int | None = option(None, "experts each token is routed to", ge=1,
                                           aliases=("num_experts_per_tok",))
    init_std: Float | None = option(None, "std of the weight initialisation", ge=0, aliases=("initializer_range",))
    family: Family | None = option(
        None, "Hugging Face class the weights map to", aliases=("model_type",),
        alias_values={"llama_v2": "llama", "llama_v3": "llama"})
    head_dim: Int | None = option(None, "width of each attention head, where it is not dim / n_heads (Qwen 3)",
                                  ge=2, le=2**12)
    qkv_bias: Bool | None = option(None, "biases on the query, key and value projections (Qwen 2.5)")
    qk_norm: Bool | None = option(None, "RMSNorm over each query and key head before RoPE (Qwen 3)")


class DataConfig(Settings):
    dataset: Str = option(
        "embedded", "'embedded' (the Python standard library's source), a local file or folder "
        "(jsonl/json/parquet/txt, .gz/.zst; or token shards from `fsdpkit data prepare`), "
        "or a Hugging Face hub dataset (hf:NAME forces the hub)")
    dataset_config_name: Str | None = option(None, "dataset configuration (hub datasets)")
    data_format: Literal["text", "chat", "preference"] = option(
        "text", "text: documents, loss on every token; chat: conversations (records with `messages`, or "
        "prompt/completion) rendered with the chat template, loss on the assistant's tokens only, each "
        "conversation attending only to itself; preference: prompt/chosen/rejected records for --objective dpo")
    chat_template: Str | None = option(
        None, "chat and preference data: 'chatml' or a Jinja file (default: the tokenizer's own template, else "
        "chatml)")
    train_split: Str = option("train", "split to train on")
    val_split: Str = option("validation", "split to validate on")
    text_field: Str = option("text", "field (or parquet column) holding the text of a record")
    on_bad_record: Literal["skip", "fail"] = option(
        "skip", "a record that is not JSON or lacks the text field: skip it (counted) or fail")
    prefetch: Int = option(4, "batches prepared ahead in a background thread (0: none)", ge=0)
    document_masking: Bool = option(False, "attend only within each document of a packed sequence "
                                    "(an explicit attention mask: slower than plain causal attention)")
    tokenizer: Str = option("bytes", "'bytes' (embedded), or a Hugging Face tokenizer: local dir/file or hub name")
    seq_len: Int | None = option(None, "training sequence length (default: the preset's recipe, else "
                                 "min(context, 2048))", ge=2, aliases=("max_context_width",))
    train_batch_size: Int = option(16, "sequences per rank per micro-step", ge=1)
    val_batch_size: Int | None = option(
        None, "sequences per rank per validation batch (default: train_batch_size)", ge=1)
    grad_accum_steps: Int = option(1, "micro-steps per optimizer step", ge=1)
    epochs: Int | None = option(None, "passes over the data at most (training stops at max_steps first)", ge=1)


class OptimConfig(Settings):
    max_steps: Int = option(300, "optimizer steps to train (exact)", ge=1, aliases=("max_training_steps",))
    tokens: Int | None = option(
        None, "a token budget instead of max_steps: max_steps becomes tokens / (seq_len x train_batch_size x "
        "grad_accum_steps x ranks), rounded up", ge=1)
    lr: Float = option(3e-3, "peak learning rate", ge=0)
    min_lr: Float | None = option(
        None, "learning-rate floor the schedule decays to (default: lr x min_lr_ratio)", ge=0)
    min_lr_ratio: Float = option(0.1, "the floor as a fraction of lr, where min_lr is not given", ge=0, le=1)
    lr_decay_style: Literal["cosine", "linear", "constant"] = option("cosine", "schedule after warm-up")
    lr_decay_iters: Int | None = option(None, "steps to decay over (default: max_steps)", ge=1)
    warmup_steps: Int | None = option(
        None, "linear warm-up steps (default: the preset recipe's, at most a fifth of max_steps; else warmup x "
        "max_steps)", ge=0)
    warmup: Float = option(0.05, "warm-up as a fraction of max_steps", ge=0, le=1)
    weight_decay: Float = option(0.1, "AdamW weight decay (not applied to norms and embeddings)", ge=0)
    beta1: Float = option(0.9, "AdamW beta1", ge=0, le=1)
    beta2: Float = option(0.95, "AdamW beta2", ge=0, le=1)
    eps: Float = option(1e-8, "AdamW epsilon", ge=0)
    grad_clip: Float = option(1.0, "clip the global gradient norm to this (0: off)", ge=0)
    fused_optimizer: Bool = option(True, "fused AdamW kernel (one kernel for all parameters; CPU and CUDA)")


def check_context_group(degree: int, per_node: int) -> None:
    """Refuse a context-parallel degree that does not divide a node's processes: a group's
    all-to-alls run twice a layer, over the node's own links (NVLink), never between nodes."""
    if per_node % degree:
        raise UserError(f"context_parallel: {degree} must divide the processes on each node ({per_node}): the "
                        "ranks that share a sequence sit on one node")


def check_expert_group(degree: int, world: int) -> None:
    """Refuse an expert-parallel degree that does not divide the ranks (its groups tile the world)."""
    if world % degree:
        raise UserError(f"expert_parallel: {degree} must divide the ranks of the run ({world}): each group of "
                        f"{degree} consecutive ranks holds every expert once")


class ParallelConfig(Settings):
    nproc: Int = option(1, "processes on this machine (launches torchrun when > 1)", ge=1)
    device: Literal["auto", "cpu", "cuda"] = option("auto", "where to train")
    sharding_strategy: Literal["full", "hybrid"] = option(
        "full", "FSDP2 sharding: full, or hybrid (HSDP on a 2-D mesh)")
    dp_replicate: Int | None = option(None, "hybrid: replica groups (default: number of nodes)", ge=1)
    mixed_precision: Literal["auto", "bf16", "fp32"] = option(
        "auto", "parameter dtype in compute (auto: bf16 on GPU, fp32 on CPU)", aliases=("bf16",),
        alias_values={"1": "bf16", "0": "fp32", "true": "bf16", "false": "fp32"})
    reduce_dtype: Literal["fp32", "bf16"] = option("fp32", "dtype of gradient reduction")
    context_parallel: Int = option(
        1, "split every sequence over N ranks of a node, for long contexts: each holds 1/N of its tokens and "
        "attends with 1/N of the heads (all-to-all, as DeepSpeed-Ulysses); N divides the processes per node, "
        "seq_len and the attention heads", ge=1, le=64)
    expert_parallel: Int = option(
        1, "split the experts of every mixture-of-experts layer over N consecutive ranks: tokens travel to their "
        "experts' rank and back (all-to-all) instead of every rank gathering every expert; N divides the ranks "
        "and the experts", ge=1, le=1024)
    reshard_after_forward: Bool = option(True, "free gathered parameters after forward (saves memory)")
    cpu_offload: Bool = option(False, "keep sharded parameters and optimizer state on the CPU")
    activation_checkpointing: Literal["none", "full", "selective"] = option(
        "none", "recompute activations in backward: none, full (every block) or selective",
        alias_values={"1": "full", "0": "none", "true": "full", "false": "none"})
    ac_every: Int = option(2, "selective activation checkpointing: every Nth block", ge=1)
    compile: Bool | None = option(
        None, "torch.compile each decoder block (default: on when training on CUDA GPUs, where it is worth about "
        "half again in MFU; off on the CPU, where compiling costs more than it saves)")
    compile_cache_dir: Str | None = option(None, "keep torch.compile's caches here (e.g. on shared storage) so a "
                                           "restarted or resubmitted job starts warm")
    loss_chunk_tokens: Int | None = option(
        None, "tokens per cross-entropy chunk, so full fp32 logits never exist (default: chunks of at most "
        "256 MiB of logits; 0: off)", ge=0)
    fsdp_prefetch: Int = option(
        1, "decoder blocks whose parameters FSDP gathers ahead, forward and backward", ge=0, le=4)
    float8: Bool = option(False, "float8 linear layers (torchao; Hopper or newer GPUs)")
    float8_recipe: Literal["tensorwise", "rowwise"] = option(
        "tensorwise", "float8 scaling: tensorwise (one scale per tensor, the faster) or rowwise (one per row, "
        "closer to bf16)")
    float8_head: Bool = option(False, "float8 in the output head too (its logits feed the loss)")
    keep_host_memory: Bool = option(True, "reuse freed host memory instead of returning it to the OS each step "
                                    "(glibc mallopt: fewer page faults per step)")
    max_restarts: Int = option(0, "with --nproc: torchrun restarts the workers this often after a failure", ge=0)
    require_efa: Literal["auto", "on", "off"] = option(
        "auto", "before the first step, read which network NCCL chose and stop if it fell back to TCP sockets "
        "where EFA was expected (auto: on for multi-node runs on EFA nodes)")

    def compiles(self, device_type: str) -> bool:
        """Whether blocks are compiled on this device: as set, else on CUDA only (the trainer and the
        planner both ask here)."""
        return self.compile if self.compile is not None else device_type == "cuda"

    def precision(self, device_type: str) -> str:
        """The compute dtype on this device, "bf16" or "fp32": as set, else bf16 on CUDA only."""
        if self.mixed_precision != "auto":
            return self.mixed_precision
        return "bf16" if device_type == "cuda" else "fp32"

    def replicas(self, world: int, nodes: int) -> int:
        """HSDP's replica groups for `world` ranks on `nodes` nodes: as set, else one per node; it
        must divide the world."""
        replicas = self.dp_replicate or nodes
        if world % replicas:
            raise UserError(f"dp_replicate: {replicas} must divide the world size ({world})")
        return replicas

    def data_ranks(self, world: int) -> int:
        """Ranks that read their own share of the data: a context-parallel group reads one."""
        return world // self.context_parallel

    def shard_ranks(self, world: int, nodes: int) -> int:
        """Ranks each parameter is sharded over: the world, or under HSDP one replica group's."""
        if self.sharding_strategy == "hybrid" and world > 1:
            return world // self.replicas(world, nodes)
        return world


class LogConfig(Settings):
    logging_freq: Int = option(10, "steps between metric lines", ge=1)
    validation_freq: Int = option(100, "steps between validation passes (0: only at the end)", ge=0)
    validate_at_start: Bool = option(False, "a validation pass before the first step too (step 0 in metrics.jsonl, "
                                     "start_val_loss in summary.json): the model's score before training")
    validation_batches: Int | None = option(
        None, f"batches per rank per validation pass (default: as many as keep validation within "
        f"{VALIDATION_SHARE:.0%} of training compute, 1 to 8)", ge=1)
    tensorboard: Bool = option(True, "write TensorBoard events to RUN_DIR/tensorboard")
    verbose: Bool = option(False, "also print what libraries say on the way (the Hugging Face hub client's "
                           "retries, for one)")
    tensorboard_dir: Str | None = option(None, "TensorBoard directory (default: RUN_DIR/tensorboard)")
    progress: Literal["auto", "on", "off"] = option("auto", "progress bar (auto: when attached to a terminal)")
    peak_tflops: Float | None = option(None, "the MFU denominator, TFLOP/s per device (default: the GPU's "
                                       "datasheet figure, or this CPU's matmul rate measured at start-up)", ge=1e-9)
    log_samples: Bool = option(False, "record the global index of every sample each rank trains on "
                               "(RUN_DIR/samples-rank*.jsonl), to audit data order; chat data also names "
                               "each row's conversations: [epoch, number in the epoch, tokens]")
    tracker: Str | None = option(
        None, "experiment trackers beside TensorBoard: wandb, mlflow, or wandb,mlflow (optional extras: pip install "
        "'fsdpkit[wandb]'); keys come from the environment (WANDB_API_KEY, MLFLOW_TRACKING_URI), a resumed run "
        "continues the same tracker run")
    tracker_project: Str = option("fsdpkit", "the W&B project or MLflow experiment")

    @field_validator("tracker")
    @classmethod
    def _tracker(cls, raw: str | None) -> str | None:
        try:
            return ",".join(parse_trackers(raw)) or None
        except ValueError as e:
            raise fail(str(e)) from None

    @property
    def trackers(self) -> tuple[str, ...]:
        return parse_trackers(self.tracker)


_EVERY = re.compile(r"^(\d+)([smhd])?$")
# The longest interval that still means one: a step count as torch's int32 step counters hold it, a
# wall time of a year. Past either, a value is a typo, not a schedule.
MAX_EVERY_STEPS = 2**31 - 1
MAX_EVERY_SECONDS = 365 * DURATION_UNITS["d"]


def parse_every(raw: str | None) -> tuple[int | None, int | None]:
    """checkpoint_every as (steps, seconds): "500" is steps, "30m" (or 900s, 2h) wall time; "0" the
    last step only."""
    text = str(raw or "0").strip().lower()
    m = _EVERY.match(text)
    if not m:
        raise ValueError(f"expected steps (500) or a wall time (30m, 2h, 900s), got {raw!r}")
    shown = repr(text if len(text) <= 24 else text[:20] + "...")
    n, unit = int(m.group(1)), m.group(2)
    if unit and n == 0:
        raise ValueError(f"a wall time of {text} would never checkpoint; give 0 for the last step only, or a time "
                         "above 0 (30m)")
    if (n * DURATION_UNITS[unit] if unit else n) > (MAX_EVERY_SECONDS if unit else MAX_EVERY_STEPS):
        raise ValueError(f"{shown} is out of range: at most {MAX_EVERY_STEPS} steps or 365d")
    return (None, n * DURATION_UNITS[unit]) if unit else (n or None, None)


class CheckpointConfig(Settings):
    checkpoint_dir: Str | None = option(None, "where sharded checkpoints go")
    checkpoint_every: Str = option(
        "0", "how often to checkpoint: steps (500) or wall time (30m, 2h, 900s); 0: only the last step. The last "
        "step is always saved, with a checkpoint_dir. Cluster jobs with storage default to a wall time that keeps "
        "saving under 5% of the run (see `fsdpkit plan`)", aliases=("checkpoint_freq",))
    resume_from_checkpoint: Str | None = option(
        None, "a checkpoint, a directory whose newest complete checkpoint to resume from, or 'auto' "
        "(the newest in checkpoint_dir; also what a run restarted by torchrun does)", aliases=("resume",))
    resume_new_data: Bool = option(
        False, "resume on another dataset or tokenizer than the checkpoint was trained on (refused otherwise: "
        "without --dataset and --tokenizer a resume continues on the checkpoint's)")
    keep_last: Int = option(3, "complete checkpoints to keep (0: all)", ge=0)
    async_checkpoint: Bool = option(False, "write checkpoints in the background while training continues")
    tiered: Bool = option(
        False, "SageMaker HyperPod's managed tiered checkpointing (the image needs fsdpkit[tiered]: fsdpkit image "
        "init --tiered): periodic saves and the save on SIGTERM go to the cluster's in-memory store in seconds; "
        "every durable_every-th save and the last step also go to checkpoint_dir. Without the package, every save "
        "goes to checkpoint_dir",
        aliases=("tiered_checkpoint",))
    durable_every: Int = option(4, "with tiered: every Nth checkpoint also goes to checkpoint_dir (the durable "
                                "tier; the last step always does)", ge=1)
    init_from_hf: Str | None = option(None, "start from Hugging Face weights: a local directory with config.json "
                                      "and safetensors (its config replaces the preset)")

    @field_validator("checkpoint_every")
    @classmethod
    def _every(cls, raw: str) -> str:
        try:
            parse_every(raw)
        except ValueError as e:
            raise fail(str(e)) from None
        return raw.strip().lower()

    @property
    def every_steps(self) -> int | None:
        return parse_every(self.checkpoint_every)[0]

    @property
    def every_seconds(self) -> int | None:
        return parse_every(self.checkpoint_every)[1]


LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def parse_lora_targets(raw: str) -> tuple[str, ...]:
    """"q_proj,v_proj", or "all" for every projection; ValueError naming the allowed ones."""
    names = LORA_TARGETS if raw.strip() == "all" else tuple(
        dict.fromkeys(n.strip() for n in raw.split(",") if n.strip()))
    unknown = [n for n in names if n not in LORA_TARGETS]
    if unknown or not names:
        raise ValueError(f"unknown LoRA target {unknown[0] if unknown else raw!r}; allowed: all, or a comma-separated "
                         f"list of {', '.join(LORA_TARGETS)}")
    return names


class LossConfig(Settings):
    """What the run minimises: next-token cross-entropy (language modelling and SFT), or a
    preference loss over chosen and rejected answers against the starting model (DPO, Rafailov et
    al. 2023, with TRL's names and defaults)."""

    objective: Literal["sft", "dpo"] = option(
        "sft", "sft: next-token cross-entropy; dpo: direct preference optimisation on --data-format preference "
        "records, against the model as it starts (the reference)")
    dpo_beta: Float = option(0.1, "DPO: how far the policy may move from the reference (TRL's beta)", ge=1e-6, le=100)
    dpo_loss: Literal["sigmoid", "ipo", "hinge"] = option(
        "sigmoid", "DPO's loss as TRL names it: sigmoid (the paper's), ipo (Azar et al.), hinge (SLiC)")


class LoraConfig(Settings):
    """Low-rank adapters (LoRA, Hu et al. 2021) on the attention and MLP projections: the base weights
    stay frozen, only the adapters train, and only they are checkpointed."""

    lora: Bool = option(False, "train LoRA adapters instead of the whole model")
    lora_rank: Int = option(16, "rank of each adapter", ge=1, le=4096)
    lora_alpha: Float = option(32.0, "adapter scale numerator: the update is (alpha / rank) B A x", ge=1e-6)
    lora_dropout: Float = option(0.0, "dropout on the adapter's input", ge=0, le=0.9)
    lora_targets: Str = option("all", "projections that get adapters: all, or a comma-separated list of "
                               + ", ".join(LORA_TARGETS))
    base_dtype: Literal["auto", "nf4"] = option(
        "auto", "storage of LoRA's frozen base: auto (the parameters' dtype) or nf4 (QLoRA: the decoder's "
        "projections in 4-bit NormalFloat, torchao's NF4, about 0.52 bytes a parameter)")

    @field_validator("lora_targets")
    @classmethod
    def _targets(cls, raw: str) -> str:
        try:
            return ",".join(parse_lora_targets(raw))
        except ValueError as e:
            raise fail(str(e)) from None

    @property
    def targets(self) -> tuple[str, ...]:
        return parse_lora_targets(self.lora_targets)


class ResolvedModel(ModelOverrides):
    """The model's whole shape, every field known."""

    vocab_size: Int
    dim: Int
    n_layers: Int
    n_heads: Int
    n_kv_heads: Int
    ffn_dim: Int
    rope_theta: Float
    sliding_window: Int
    n_experts: Int
    experts_per_token: Int
    init_std: Float
    family: Family
    qkv_bias: Bool
    qk_norm: Bool


class ResolvedData(DataConfig):
    seq_len: Int
    val_batch_size: Int


class ResolvedOptim(OptimConfig):
    min_lr: Float
    warmup_steps: Int


class ResolvedLog(LogConfig):
    validation_batches: Int
