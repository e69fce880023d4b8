"""The training loop: exact max_steps, gradient accumulation, clipping, validation, metrics.

Host-device synchronisation happens only on logging and validation steps: the loss is summed on
the device and read back once per logging window.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any, cast

import torch
from torch.distributed.fsdp import FSDPModule

from fsdpkit import yamlfile
from fsdpkit.envelope import show_diagnostics
from fsdpkit.errors import UserError
from fsdpkit.train import dpo
from fsdpkit.train.checkpoint import checkpointer
from fsdpkit.train.checkpoint.tiered import SCHEME, MemoryTier
from fsdpkit.train.config import REPLAY_HEAD, TrainConfig, resume_target
from fsdpkit.train.data import BatchStream, Prefetcher
from fsdpkit.train.data.pipeline import data_pipeline
from fsdpkit.train.model import nf4
from fsdpkit.train.model.config import LoraShape, check_nf4_layout, count_params
from fsdpkit.train.model.flops import flops_per_token
from fsdpkit.train.model.hf import check_weights, load_hf_into
from fsdpkit.train.model.hf_config import read_config
from fsdpkit.train.model.transformer import Transformer
from fsdpkit.train.objective import DPO, NextToken, Objective
from fsdpkit.train.observe.log_lines import DONE, NOTHING_TO_DO, STOPPED, node_line, on_node
from fsdpkit.train.observe.metrics import (
    MetricsWriter,
    StepStats,
    cpu_bf16_gemm_ratio,
    derive,
    human_line,
    minor_page_faults,
    peak_flops,
    peak_memory_bytes,
    reset_peak_memory,
)
from fsdpkit.train.observe.records import attempts, read_rows, surviving
from fsdpkit.train.observe.trackers import check_trackers, open_trackers
from fsdpkit.train.observe.trainjob_status import TrainJobStatusSink
from fsdpkit.train.optim import build_optimizer, clipped_step, lr_at, set_lr
from fsdpkit.train.parallel import network
from fsdpkit.train.parallel.shard import autocast, build_model, compute_dtype, describe_mesh, expert_grads
from fsdpkit.train.runtime import dist, run_lock, supervisor
from fsdpkit.train.runtime.faults import maybe_fail
from fsdpkit.train.runtime.host_memory import keep_freed_memory
from fsdpkit.train.sections import check_context_group, check_expert_group
from fsdpkit.train.validation import Validator

log = logging.getLogger(__name__)


@dataclass
class TrainResult:
    run_dir: Path
    steps: int
    losses: list[tuple[int, float]] = field(default_factory=list)
    val_losses: list[tuple[int, float]] = field(default_factory=list)
    stopped_by_signal: bool = False  # SIGTERM before max_steps: the run is unfinished


def default_run_dir(cfg: TrainConfig) -> Path:
    return Path("runs") / f"{datetime.now():%Y%m%d-%H%M%S}-{cfg.preset}"


def check_writable(path: Path, what: str) -> None:
    """Fail before any work if `path` cannot be created or written; creates nothing itself."""
    p = path.resolve()
    if p.exists() and not p.is_dir():
        raise UserError(f"{what}: {path} exists and is not a directory")
    probe = p
    while not probe.exists():
        probe = probe.parent
    if not probe.is_dir() or not os.access(probe, os.W_OK | os.X_OK):
        raise UserError(f"{what}: {path} is not writable (no write permission on {probe})")


def preflight(cfg: TrainConfig) -> tuple[Path, run_lock.RunLock]:
    """Everything that can be checked before processes start: returns the run directory and the
    checkpoint directory's lock, which this process then holds for the run (see run_lock)."""
    run_dir = Path(cfg.run_dir) if cfg.run_dir else default_run_dir(cfg)
    check_writable(run_dir, "run_dir")
    if cfg.log.tensorboard_dir:
        check_writable(Path(cfg.log.tensorboard_dir), "tensorboard_dir")
    if cfg.checkpoint.checkpoint_dir:
        check_writable(Path(cfg.checkpoint.checkpoint_dir), "checkpoint_dir")
    lock = run_lock.hold(cfg.checkpoint.checkpoint_dir)  # a busy directory is refused first
    try:
        _check_inputs(cfg)
    except BaseException:
        lock.release(undo=True)
        raise
    lock.claim(run_dir)
    return run_dir, lock


def _check_inputs(cfg: TrainConfig) -> None:
    """The data, tokenizer, vocabulary, process count, trackers and checkpoint to resume, before any work."""
    check_trackers(cfg.log.trackers)
    pipe = data_pipeline(cfg.data, cfg.seed, cfg.data.train_split, verbose=False)
    source, tok = pipe.source, pipe.tokenizer
    vocab = cfg.shape.vocab_size
    tok_name, tok_vocab = (source.meta["tokenizer"], source.meta["vocab_size"]) if tok is None else (
        tok.name, tok.vocab_size)
    if tok_vocab > vocab:
        raise UserError(f"vocab_size: the model's {vocab} is smaller than tokenizer {tok_name!r}'s {tok_vocab}; "
                        "pass --vocab-size or another tokenizer")
    BatchStream(source, tok, cfg.data.seq_len, 1, epochs=1, shuffle_buffer=0, chat=pipe.chat,
                preference=pipe.preference).check_not_empty()
    if cfg.checkpoint.init_from_hf:
        check_weights(Path(cfg.checkpoint.init_from_hf))
    if not supervisor.under_torchrun():
        dist.check_nproc(cfg.parallel.nproc, cfg.parallel.device)
        check_context_group(cfg.parallel.context_parallel, cfg.parallel.nproc)
        check_expert_group(cfg.parallel.expert_parallel, cfg.parallel.nproc)
        # The workers' mesh, refused here rather than in each.
        shard = cfg.parallel.shard_ranks(cfg.parallel.nproc, 1)
        if cfg.lora_shape is not None and cfg.lora_shape.nf4:
            check_nf4_layout(cfg.shape, shard, cfg.parallel.nproc)
            nf4.check_available()
        if cfg.parallel.float8 and dist.resolve_device_type(cfg.parallel.device) != "cuda":
            raise UserError("float8: needs an NVIDIA GPU (Ada, Hopper or newer); it cannot run on the CPU")
        # A checkpoint that cannot be resumed is refused before any process starts or file is written.
        if spec := resume_target(cfg):
            checkpointer.check_resumable(spec, model_shape_of(cfg))


def model_shape_of(cfg: TrainConfig) -> dict[str, Any]:
    """The model's shape as a checkpoint records it (plain JSON values), with its LoRA adapters'."""
    shape = dataclasses.asdict(cfg.shape)
    if cfg.lora_shape is not None:
        shape["lora"] = dataclasses.asdict(cfg.lora_shape)
    return cast("dict[str, Any]", json.loads(json.dumps(shape)))


@dataclass
class TrainState:
    """What the loop advances: the model and optimizer, and where the run stands."""

    model: Transformer
    optimizer: torch.optim.Optimizer
    step: int = 0          # optimizer steps done
    samples: int = 0       # global samples consumed: the data position a checkpoint records
    attempt: int = 0       # this start of the run (fsdpkit.train.observe.records)


@dataclass
class Window:
    """The steps since the last log line: loss and skipped steps summed on the device (read back
    once per window), wall time and page faults."""

    loss_sum: torch.Tensor
    skipped: torch.Tensor  # steps with inf/nan gradients
    preference: torch.Tensor | None = None  # DPO: sums of its metrics over the window's pairs, the count last
    start: float = 0.0
    faults: int = 0
    steps: int = 0

    @classmethod
    def on(cls, device: torch.device) -> Window:
        w = cls(torch.zeros((), device=device), torch.zeros((), dtype=torch.int64, device=device))
        w.restart_clock()
        return w

    def restart_clock(self) -> None:
        """Time and page faults from now (validation's and checkpointing's are not training's)."""
        self.start, self.faults = time.perf_counter(), minor_page_faults()

    def add_preference(self, sums: torch.Tensor) -> None:
        self.preference = sums.clone() if self.preference is None else self.preference + sums

    def reset(self) -> None:
        self.loss_sum.zero_()
        self.skipped.zero_()
        self.preference = None
        self.steps = 0
        self.restart_clock()


@dataclass
class Run:
    """One start of a training run: its config, its processes and the sinks rank 0 writes to."""

    cfg: TrainConfig
    rt: dist.Runtime
    run_dir: Path
    result: TrainResult
    stream: Any
    objective: Objective
    validate: Validator
    sources: tuple[Any, ...]
    dtype: torch.dtype
    flops_per_token: float
    peak: float | None
    peak_source: str
    writer: MetricsWriter | None = None
    sample_log: Any = None
    checkpointer: checkpointer.Checkpointer | None = None
    stop: dist.StopRequest | None = None
    saved_at: int | None = None
    saved_clock: float = field(default_factory=time.monotonic)  # when the last checkpoint (or the run) began
    start_step: int = 0  # where this start of the run began (resumed at)
    saves: int = 0       # checkpoints this start of the run has written (every durable_every-th is durable)
    # The config.json the run imported (init_from_hf), read once as the run starts: each checkpoint
    # keeps it, and its export writes it again with what training changed.
    hf_config: dict[str, Any] | None = None

    def say(self, line: str) -> None:
        if self.writer:
            self.writer.print(line)

    def say_on_every_node(self, line: str) -> None:
        """Rank 0 says `line`; the first process of every other node too, marked with its node
        (HyperPod's agent reads each node's own log for the run's end)."""
        if self.writer:
            self.writer.print(line)
        elif self.rt.local_rank == 0:
            print(on_node(line, self.rt.rank // self.rt.local_world_size), flush=True)

    def bad_records(self) -> int:
        """Records skipped as bad so far, each once (sources without such records count 0)."""
        return sum(getattr(src, "bad_records", 0) for src in self.sources)


def train(cfg: TrainConfig, accepted: Callable[[], None] = lambda: None) -> TrainResult:
    """A run in this process; `accepted` is called once its checks have passed."""
    run_dir, lock = preflight(cfg)
    accepted()
    try:
        return _train(cfg, run_dir)
    finally:
        lock.release()


def _train(cfg: TrainConfig, run_dir: Path) -> TrainResult:
    nccl = network.capture_nccl_log(run_dir, dist.resolve_device_type(cfg.parallel.device))
    rt = dist.setup(cfg.parallel.device, cfg.parallel.context_parallel, cfg.parallel.expert_parallel)
    if cfg.parallel.compile is None:  # the default follows the device, now that it is known
        cfg = cfg.model_copy(update={"parallel": cfg.parallel.model_copy(
            update={"compile": cfg.parallel.compiles(rt.device.type)})})
    try:
        # Before any step is spent: which network NCCL really chose (and a stop if not EFA where
        # EFA was expected).
        if verdict := network.check(rt, cfg.parallel.require_efa, nccl):
            log.info(verdict.line())
        return _run(cfg, rt, run_dir)
    finally:
        dist.teardown()


def _run(cfg: TrainConfig, rt: dist.Runtime, run_dir: Path) -> TrainResult:
    """Set up, loop, finish; the stream, sample log, signal handler and writer are closed on every path."""
    torch.manual_seed(cfg.seed)
    if cfg.parallel.keep_host_memory:
        keep_freed_memory()
    reset_peak_memory(rt.device)  # the memory figure is this run's, not the imports'
    ck = cfg.checkpoint
    tier = MemoryTier.open(Path(ck.checkpoint_dir), rt) if ck.tiered and ck.checkpoint_dir else None
    state = _start_state(cfg, rt, tier)
    with contextlib.ExitStack() as stack:
        run = _open_run(cfg, rt, run_dir, state, stack, tier)
        window = Window.on(rt.device)
        state.model.train()
        if cfg.log.validate_at_start and state.step == 0:   # a resumed run has its start's on record
            _validation(run, state.model, 0)
            window.restart_clock()
        for step in range(state.step, cfg.optim.max_steps):
            lr = lr_at(step, cfg.optim)
            set_lr(state.optimizer, lr)
            grad_norm = _train_step(run, state, window)
            if grad_norm is None:  # the data ran out (--epochs)
                run.say(f"fsdpkit: the data ran out after {cfg.data.epochs} epoch(s) at step {step}; stopping")
                if run.checkpointer and run.saved_at != state.step and state.step > run.start_step:
                    _save(run, state)   # the run's last step, as at max_steps
                break
            if _after_step(run, state, window, lr, grad_norm):
                break
        run.result.steps = state.step
        if run.checkpointer:
            run.checkpointer.wait()
        _finish(run, state)
    return run.result


def _starting_model(cfg: TrainConfig, rt: dist.Runtime, lora: LoraShape | None) -> Transformer:
    """The model as a run starts it: built from the seed, with the Hugging Face weights where given."""
    model = build_model(cfg.shape, cfg.parallel, cfg.data.seq_len, cfg.seed, rt, lora)
    if cfg.checkpoint.init_from_hf:
        load_hf_into(model, Path(cfg.checkpoint.init_from_hf), cfg.shape)
    return model


def _objective(cfg: TrainConfig, rt: dist.Runtime, eos_id: int | None) -> Objective:
    """The run's objective; for DPO its reference, the model as training starts: the policy with its
    adapters off under LoRA, else a frozen copy built and loaded as the policy was (the same
    weights on every start of the run, resumed or not)."""
    if cfg.loss.objective == "sft":
        return NextToken(eos_id)
    reference = None
    if cfg.lora_shape is None:
        reference = _starting_model(cfg, rt, None)
        reference.requires_grad_(False)
        reference.eval()
    return DPO(reference, cfg.loss.dpo_beta, cfg.loss.dpo_loss)


def _start_state(cfg: TrainConfig, rt: dist.Runtime, tier: MemoryTier | None = None) -> TrainState:
    """The model (from Hugging Face weights if asked), its optimizer, and the newest checkpoint's
    state when resuming (the memory tier's, where it is newer)."""
    model = _starting_model(cfg, rt, cfg.lora_shape)
    if cfg.checkpoint.init_from_hf:
        log.info(f"fsdpkit: initialised from Hugging Face weights in {cfg.checkpoint.init_from_hf}")
    state = TrainState(model, build_optimizer(model, cfg.optim))
    if resume_from := resume_target(cfg):
        found = checkpointer.resume(resume_from, model, state.optimizer, model_shape_of(cfg), rt, tier)
        if found is None:
            log.info(f"fsdpkit: no complete checkpoint in {resume_from}; starting from step 0")
        else:
            state.step, state.samples = found.step, found.meta["samples"]
            log.info(f"fsdpkit: resumed from {found.path} at step {state.step}")
            state.samples = _carry_data_position(found.meta, cfg, rt.data_ranks, state.samples)
    return state


def _carry_data_position(meta: dict[str, Any], cfg: TrainConfig, data_ranks: int, samples: int) -> int:
    """The data position after resuming with another sequence length or global batch (allowed: the
    model is the same). The position is kept in tokens: with another sequence length the samples
    consumed are rescaled, so no text is skipped or repeated; the schedule continues by step."""
    saved = (meta.get("config") or {}).get("data") or {}
    old_len, new_len = saved.get("seq_len"), cfg.data.seq_len
    d = cfg.data
    # Checkpoints of runs without context parallel record no data_ranks: their world read the data.
    old_ranks = meta.get("data_ranks") or meta.get("world_size") or 0
    old_batch = (saved.get("train_batch_size") or 0) * old_ranks * (saved.get("grad_accum_steps") or 1)
    new_batch = d.train_batch_size * data_ranks * d.grad_accum_steps
    if old_len and old_len != new_len:
        carried = -(-samples * old_len // new_len)
        log.info(f"fsdpkit: resumed with seq_len {new_len} (the checkpoint's: {old_len}): the data continues "
                 f"after the {samples * old_len:,} tokens already trained on (sample {carried:,} at the new "
                 "length)")
        samples = carried
    if old_batch and old_batch != new_batch:
        log.info(f"fsdpkit: resumed with a global batch of {new_batch} sequences per step (the checkpoint's: "
                 f"{old_batch}): the data continues at sample {samples:,}; the learning-rate schedule "
                 f"continues at step {meta.get('step', '?')} of {cfg.optim.max_steps}")
    return samples


def _open_run(cfg: TrainConfig, rt: dist.Runtime, run_dir: Path, state: TrainState,
              stack: contextlib.ExitStack, tier: MemoryTier | None = None) -> Run:
    """Data, validation, performance figures, sinks and the checkpointer of this start of the run."""
    d = cfg.data
    pipe = data_pipeline(d, cfg.seed, d.train_split, verbose=rt.is_main)
    source = pipe.source
    batches = BatchStream(source, pipe.tokenizer, cfg.data.seq_len, d.train_batch_size, rt.data_rank, rt.data_ranks,
                          cfg.seed, epochs=d.epochs, skip_blocks=state.samples, chat=pipe.chat,
                          preference=pipe.preference)
    stream = Prefetcher(batches, d.prefetch, pin_memory=rt.device.type == "cuda") if d.prefetch else iter(batches)
    if isinstance(stream, Prefetcher):
        stack.callback(stream.close)
    objective = _objective(cfg, rt, pipe.eos_id if d.document_masking else None)
    validate = Validator(cfg.data, cfg.log.validation_batches, cfg.seed, cfg.parallel, rt, objective)
    if validate.batches == 0:
        log.warning(f"the {d.val_split!r} split holds less than one global validation batch "
                    f"({cfg.data.val_batch_size} x {rt.data_ranks} blocks of {cfg.data.seq_len + 1} tokens); "
                    "no validation")
    dtype = compute_dtype(cfg.parallel, rt.device.type)
    peak, peak_source = peak_flops(rt.device, dtype, cfg.log.peak_tflops)
    if peak is not None and peak_source == "measured-gemm":
        # Every rank measures at once, as they will compute, and the best counts: one figure for the
        # run (a rank measured while another was still loading reads low).
        peak = dist.all_reduce_max(peak, rt)
    # Only rank 0's diagnostics are shown, so only rank 0 spends the 0.1 s measuring fp32 for this one.
    bf16_on_cpu = rt.is_main and peak_source == "measured-gemm" and dtype == torch.bfloat16
    if bf16_on_cpu and peak is not None and (ratio := cpu_bf16_gemm_ratio(peak)) < 1:
        log.warning(f"on this CPU bf16 matrix products run at {ratio:.2f}x the fp32 rate (measured); "
                    "--mixed-precision fp32 is faster here")
    run = Run(cfg, rt, run_dir, TrainResult(run_dir=run_dir, steps=state.step), stream, objective, validate,
              (source, validate.source), dtype, flops_per_token(cfg.shape, cfg.data.seq_len), peak,
              peak_source, start_step=state.step,
              hf_config=read_config(Path(cfg.checkpoint.init_from_hf)) if cfg.checkpoint.init_from_hf else None)
    # This start of the run is attempt N: N earlier starts are on record (restarts, resubmissions,
    # a rerun with --resume). Rank 0's count, so every rank's sample log agrees.
    state.attempt = dist.broadcast_int(attempts(read_rows(run_dir / "metrics.jsonl")) if rt.is_main else 0, rt)
    _open_sinks(run, state, stack)
    run.stop = dist.StopRequest(rt)
    stack.callback(run.stop.close)
    if ck_dir := cfg.checkpoint.checkpoint_dir:
        ck = cfg.checkpoint
        run.checkpointer = checkpointer.Checkpointer(Path(ck_dir), rt, ck.keep_last, ck.async_checkpoint, tier)
    return run


def _open_sinks(run: Run, state: TrainState, stack: contextlib.ExitStack) -> None:
    """Each rank's sample log (--log-samples) and rank 0's metrics writer, config.yaml and start lines."""
    cfg, rt, run_dir, lg = run.cfg, run.rt, run.run_dir, run.cfg.log
    if lg.log_samples:
        run_dir.mkdir(parents=True, exist_ok=True)
        run.sample_log = stack.enter_context((run_dir / f"samples-rank{rt.rank}.jsonl").open("a", buffering=1))
        run.sample_log.write(json.dumps({"kind": "start", "step": state.step, "attempt": state.attempt}) + "\n")
    if not rt.is_main:
        return
    run_dir.mkdir(parents=True, exist_ok=True)
    record = cfg.record(run_dir)
    (run_dir / "config.yaml").write_text(REPLAY_HEAD + yamlfile.dump(cfg.replay(run_dir)))
    tb_dir = Path(lg.tensorboard_dir) if lg.tensorboard_dir else run_dir / "tensorboard"
    show_bar = lg.progress == "on" or (lg.progress == "auto" and sys.stderr.isatty())
    trackers = open_trackers(lg.trackers, run_dir, lg.tracker_project, record, state.attempt)
    if status := TrainJobStatusSink.from_env(cfg.optim.max_steps):  # in a TrainJob whose controller asks for it
        trackers.append(status)
    writer = run.writer = MetricsWriter(run_dir, tb_dir if lg.tensorboard else None, show_bar, cfg.optim.max_steps,
                                        state.attempt, trackers)
    # The sinks are told whether the run ended well (an exception leaves through here too).
    stack.push(lambda kind, _e, _tb: writer.close(ok=kind is None))
    # Each start of the run is marked, so readers can tell its attempts apart (a resume that repeats
    # no step included).
    run.writer.record("start", {"step": state.step, "world_size": rt.world_size,
                                "restart": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")),
                                "resubmission": int(os.environ.get("FSDPKIT_ATTEMPT", "0"))})
    # Diagnostics from here on go beside the metric lines (under the progress bar, if one is shown).
    show_diagnostics(writer.print)
    d, mcfg = cfg.data, cfg.shape
    run.say(f"fsdpkit: {cfg.preset} ({count_params(mcfg) / 1e6:.2f}M params), {rt.world_size} x "
            f"{rt.device.type}, {str(run.dtype).removeprefix('torch.')}, seq {cfg.data.seq_len}, global batch "
            f"{d.train_batch_size * rt.data_ranks * d.grad_accum_steps}, {cfg.optim.max_steps} steps -> {run_dir}")
    if (ep := rt.expert_parallel) > 1:
        run.say(f"fsdpkit: expert parallel {ep}: each rank holds {mcfg.n_experts // ep} of the {mcfg.n_experts} "
                f"experts of every layer, tokens travel to theirs by all-to-all; {rt.world_size // ep} copy(ies) of "
                "each expert")
    if rt.context_parallel > 1:
        run.say(f"fsdpkit: context parallel {rt.context_parallel}: each rank holds "
                f"{cfg.data.seq_len // rt.context_parallel} tokens of every sequence and attends with "
                f"{mcfg.n_heads // rt.context_parallel} of {mcfg.n_heads} heads; {rt.data_ranks} data-parallel "
                "share(s) of the batch")
    config_name = f" ({d.dataset_config_name})" if d.dataset_config_name else ""
    run.say(f"fsdpkit: data {d.dataset}{config_name}, tokenizer {d.tokenizer}, vocab {mcfg.vocab_size}")
    peak_txt = f"{run.peak / 1e12:.3f} TFLOP/s ({run.peak_source})" if run.peak else "unknown for this device"
    run.say(f"fsdpkit: MFU denominator {peak_txt}; mesh {describe_mesh(state.model)}; activation "
            f"checkpointing {cfg.parallel.activation_checkpointing}; compile {cfg.parallel.compile}")
    if (lora := cfg.lora_shape) is not None:
        # PEFT's print_trainable_parameters line: the adapters (whole, not this rank's shard) of the whole model.
        trainable = sum(p.numel() for p in state.model.parameters() if p.requires_grad)
        total = count_params(mcfg) + trainable
        run.say(f"fsdpkit: LoRA rank {lora.rank}, alpha {lora.alpha:g} on {','.join(lora.targets)}; "
                f"{_base_line(state.model)}; trainable params: {trainable:,} || all params: {total:,} || "
                f"trainable%: {100 * trainable / total:.4f}")


def _base_line(model: torch.nn.Module) -> str:
    """What the frozen base's projections take on this rank: in NF4 (QLoRA), their bytes per parameter."""
    stored, elements = nf4.nf4_bytes(model)
    if not elements:
        return "base frozen in the parameters' dtype"
    return f"base projections in nf4: {stored / elements:.3f} bytes a parameter, {stored / 2**20:.1f} MiB on this rank"


def _train_step(run: Run, state: TrainState, window: Window) -> torch.Tensor | None:
    """One optimizer step over grad_accum_steps micro-batches; the gradient norm, or None when the
    data ran out before the step could start."""
    cfg, rt, model = run.cfg, run.rt, state.model
    accum = cfg.data.grad_accum_steps
    for micro in range(accum):
        try:
            batch = next(run.stream)
        except StopIteration:
            return None
        if run.sample_log:
            entry = {"step": state.step + 1, "micro": micro, "blocks": batch.indices, "attempt": state.attempt}
            if batch.records is not None:   # chat: each row's [epoch, conversation, its tokens there]
                entry["records"] = batch.records
            run.sample_log.write(json.dumps(entry) + "\n")
        if rt.distributed and accum > 1:
            # Reduce-scatter gradients once per optimizer step, not once per micro-step.
            cast(FSDPModule, model).set_requires_gradient_sync(micro == accum - 1)
        with autocast(cfg.parallel, rt):
            step = run.objective(model, batch, rt.device)
        (step.total / accum).backward()
        window.loss_sum += step.loss.detach().float() / accum
        if step.sums is not None:
            window.add_preference(step.sums.detach())
    expert_grads(model)
    grad_norm = clipped_step(state.optimizer, cfg.optim.grad_clip)
    window.skipped += ~grad_norm.isfinite()
    state.optimizer.zero_grad(set_to_none=True)
    maybe_fail("step", state.step + 1, rt.rank)
    window.steps += 1
    state.step += 1
    state.samples += cfg.data.train_batch_size * rt.data_ranks * accum
    return grad_norm


def _validation(run: Run, model: Transformer, n: int) -> None:
    """A validation pass after step `n` (0: before the first), its row in the metrics."""
    val = run.validate(model)
    if val is not None:
        run.result.val_losses.append((n, val))
        if run.writer:
            extra = {f"val_{name}": value for name, value in run.validate.metrics.items()}
            run.writer.record("val", {"step": n, "val_loss": val, **extra}, f"Batch {n} Validation loss: {val:.5f}")


def _after_step(run: Run, state: TrainState, window: Window, lr: float, grad_norm: torch.Tensor) -> bool:
    """Logging, validation and checkpointing due after this step; True when the run stops here (SIGTERM)."""
    cfg, n = run.cfg, state.step
    lg, ck, last = cfg.log, cfg.checkpoint, n == cfg.optim.max_steps
    if n % lg.logging_freq == 0 or last:
        _log_window(run, window, lr, grad_norm, n, state.model)
    if (lg.validation_freq and n % lg.validation_freq == 0) or last:
        _validation(run, state.model, n)
        window.restart_clock()
    every = ck.every_seconds
    time_due = every is not None and time.monotonic() - run.saved_clock >= every
    assert run.stop is not None  # made by _open_run, before the first step
    stopping, time_due = run.stop.agreed(time_due)
    # With a checkpoint directory the last step is always saved, on checkpoint_every or not.
    due = (ck.every_steps and n % ck.every_steps == 0) or time_due or last
    if run.checkpointer and (due or stopping):
        # With a memory tier (checkpoint.tiered) the stop's save goes there, the last step and every
        # durable_every-th save to shared storage; without one, every save does.
        run.saves += 1
        _save(run, state, durable=last or (not stopping and run.saves % ck.durable_every == 0))
        window.restart_clock()
    if stopping:
        if run.checkpointer:
            run.checkpointer.wait()
        run.result.stopped_by_signal = True
        saved = "checkpoint saved" if ck.checkpoint_dir else "no --checkpoint-dir, nothing saved"
        run.say_on_every_node(f"{STOPPED.format(step=n)} ({saved})")
    return stopping


def _log_window(run: Run, window: Window, lr: float, grad_norm: torch.Tensor, n: int, model: Transformer) -> None:
    """The window's mean loss over ranks (the one host sync), and on rank 0 its metrics row."""
    cfg, rt = run.cfg, run.rt
    d = cfg.data
    loss = dist.all_reduce_mean(window.loss_sum / window.steps, rt).item()
    # A sum over ranks (the mean times the ranks: the ratios are the same).
    preference = None if window.preference is None else dist.all_reduce_mean(window.preference, rt).cpu()
    per_step = d.train_batch_size * rt.data_ranks * d.grad_accum_steps
    stats = StepStats(n, loss, lr, float(grad_norm), time.perf_counter() - window.start, window.steps,
                      per_step * window.steps, per_step * cfg.data.seq_len * window.steps, rt.world_size,
                      minor_page_faults() - window.faults, int(window.skipped))
    run.result.losses.append((n, loss))
    if run.writer:
        m = derive(stats, run.flops_per_token, run.peak, peak_memory_bytes(rt.device))
        m["bad_records"] = run.bad_records()
        if preference is not None:   # means over every rank's pairs in the window
            m.update(dpo.means(preference))
        if (load := model.expert_load()) is not None:  # rank 0's last micro-batch, every layer
            m["expert_tokens"] = load.tolist()
            m["expert_load_max_over_mean"] = max(m["expert_tokens"]) / (sum(m["expert_tokens"]) / len(load))
        run.writer.record("train", m, human_line(m))
        run.writer.advance(window.steps, loss)
    elif rt.local_rank == 0:
        # Each node's first process says the step too: HyperPod's agent reads local rank 0 of every
        # node for its hang and loss rules, and `job logs --replica` then shows progress on any node.
        print(node_line(n, loss, rt.rank // rt.local_world_size), flush=True)
    window.reset()


def _save(run: Run, state: TrainState, durable: bool = True) -> None:
    cfg = run.cfg
    meta = {"samples": state.samples, "model": model_shape_of(cfg), "preset": cfg.preset,
            "loss": run.result.losses[-1][1] if run.result.losses else None, "config": cfg.record(run.run_dir)}
    if run.hf_config is not None:
        meta["hf_config"] = run.hf_config
    assert run.checkpointer is not None  # saving is asked only of a run with a checkpoint directory
    path = run.checkpointer.save(state.step, state.model, state.optimizer, meta, durable)
    run.saved_at, run.saved_clock = state.step, time.monotonic()
    background = cfg.checkpoint.async_checkpoint and not str(path).startswith(SCHEME)
    how = "writing in the background" if background else "saved"
    run.say(f"fsdpkit: checkpoint {path} {how}")


def _finish(run: Run, state: TrainState) -> None:
    """summary.json from the whole run's record (earlier attempts included, what survived of them)
    and the closing line."""
    if not run.writer:
        if not run.result.stopped_by_signal:
            run.say_on_every_node(DONE.format(steps=run.result.steps) if run.result.losses else NOTHING_TO_DO)
        return
    run.writer.flush()
    rows = read_rows(run.run_dir / "metrics.jsonl")
    kept = surviving(rows)
    train_rows = [r for r in kept if r.get("kind") == "train"]
    val_rows = [r for r in kept if r.get("kind") == "val"]
    summary = {
        "steps": run.result.steps,
        "final_loss": train_rows[-1]["loss"] if train_rows else None,
        "first_loss": train_rows[0]["loss"] if train_rows else None,
        "final_val_loss": val_rows[-1]["val_loss"] if val_rows else None,
        "start_val_loss": next((r["val_loss"] for r in val_rows if r["step"] == 0), None),
        "attempts": attempts(rows),
        "world_size": run.rt.world_size,
        "bad_records": run.bad_records(),
    }
    (run.run_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    if run.result.stopped_by_signal:
        return  # said when it stopped, with the checkpoint it saved
    if run.result.losses:
        # One logged window has one loss: "X -> X" would read as a run that learned nothing.
        loss = (f"loss {summary['final_loss']:.4f} (one logging window: --logging-freq below "
                f"{run.cfg.log.logging_freq} logs more)" if len(train_rows) == 1 else
                f"loss {summary['first_loss']:.4f} -> {summary['final_loss']:.4f}")
        if summary["start_val_loss"] is not None and summary["final_val_loss"] is not None:
            loss += f", validation {summary['start_val_loss']:.4f} -> {summary['final_val_loss']:.4f}"
        run.say(f"{DONE.format(steps=run.result.steps)}; {loss}; metrics in {run.run_dir / 'metrics.jsonl'}")
    else:  # resumed at (or past) max_steps: a resubmitted job that had already finished
        run.say(f"{NOTHING_TO_DO}: already at step {run.result.steps} of {run.cfg.optim.max_steps}")
