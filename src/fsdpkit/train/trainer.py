"""The training loop: exact max_steps, gradient accumulation, clipping, validation, metrics.

Host-device synchronisation happens only on logging and validation steps: the loss is summed on
the device and read back once per logging window.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import time
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import torch

from fsdpkit import yamlfile
from fsdpkit.errors import UserError
from fsdpkit.train import checkpoint, dist, network
from fsdpkit.train.config import TrainConfig
from fsdpkit.train.data import BatchStream, Prefetcher, TokenShards, get_source, get_tokenizer
from fsdpkit.train.faults import maybe_fail
from fsdpkit.train.hf import load_hf_into
from fsdpkit.train.host_memory import keep_freed_memory
from fsdpkit.train.metrics import (
    MetricsWriter,
    StepStats,
    cpu_bf16_gemm_ratio,
    derive,
    flops_per_token,
    human_line,
    measure_cpu_peak_flops,
    minor_page_faults,
    peak_flops,
    peak_memory_bytes,
    reset_peak_memory,
)
from fsdpkit.train.model import Transformer
from fsdpkit.train.model_config import count_params
from fsdpkit.train.optim import build_optimizer, clipped_step, lr_at, set_lr
from fsdpkit.train.records import attempts, read_rows, surviving
from fsdpkit.train.shard import autocast, build_model, compute_dtype, describe_mesh


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


def preflight(cfg: TrainConfig) -> Path:
    """Everything that can be checked before processes start: returns the run directory."""
    run_dir = Path(cfg.run_dir) if cfg.run_dir else default_run_dir(cfg)
    check_writable(run_dir, "run_dir")
    if cfg.log.tensorboard_dir:
        check_writable(Path(cfg.log.tensorboard_dir), "tensorboard_dir")
    if cfg.checkpoint.checkpoint_dir:
        check_writable(Path(cfg.checkpoint.checkpoint_dir), "checkpoint_dir")
    source, tok = data_pipeline(cfg, cfg.data.train_split, verbose=False)
    vocab = cfg.model_config().vocab_size
    tok_name, tok_vocab = (source.meta["tokenizer"], source.meta["vocab_size"]) if tok is None else (
        tok.name, tok.vocab_size)
    if tok_vocab > vocab:
        raise UserError(f"vocab_size: the model's {vocab} is smaller than tokenizer {tok_name!r}'s {tok_vocab}; "
                        "pass --vocab_size or another tokenizer")
    BatchStream(source, tok, cfg.seq_len(), 1, epochs=1, shuffle_buffer=0).check_not_empty()
    if not dist.under_torchrun():
        dist.check_nproc(cfg.parallel.nproc, cfg.parallel.device)
        # A checkpoint that cannot be resumed is refused before any process starts or file is written.
        if (spec := resume_spec(cfg)) and (found := checkpoint.resolve(spec)):
            checkpoint.check_shape(found, model_shape_of(cfg))
            if found.path == Path(spec) and (problem := checkpoint.verify(found.path)):
                raise checkpoint.DamagedCheckpoint(found.path, problem)
    return run_dir


def model_shape_of(cfg: TrainConfig) -> dict[str, Any]:
    """The model's shape as a checkpoint records it (plain JSON values)."""
    return json.loads(json.dumps(dataclasses.asdict(cfg.model_config())))


def data_pipeline(cfg: TrainConfig, split: str, verbose: bool):
    """The source of a split and its tokenizer (None for token shards, which are tokenised already)."""
    d = cfg.data
    source = get_source(d.dataset, split, cfg.seed, d.text_field, d.dataset_config_name, d.on_bad_record, verbose)
    return source, None if isinstance(source, TokenShards) else get_tokenizer(d.tokenizer)


def resume_spec(cfg: TrainConfig) -> str | None:
    """Where to resume from: the flag, with 'auto' meaning checkpoint_dir. A worker that torchrun
    restarted after a failure resumes from checkpoint_dir even when no flag says so."""
    ck = cfg.checkpoint
    if ck.resume_from_checkpoint == "auto":
        return ck.checkpoint_dir
    if ck.resume_from_checkpoint:
        return ck.resume_from_checkpoint
    restarted = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0
    return ck.checkpoint_dir if restarted and ck.checkpoint_dir else None


class Validator:
    """Mean loss over the first N held-out batches, the same batches every time, averaged over ranks."""

    def __init__(self, cfg: TrainConfig, rt: dist.Runtime):
        source, tok = data_pipeline(cfg, cfg.data.val_split, verbose=rt.is_main)
        self.source = source
        self.stream = BatchStream(source, tok, cfg.seq_len(), cfg.val_batch_size(), rt.rank,
                                  rt.world_size, cfg.seed, shuffle_buffer=0, epochs=1)
        # Every rank must run the same number of forwards (FSDP collectives): count on each rank,
        # deterministically, how many whole global batches the held-out split holds.
        available = self.stream.count_blocks() // (cfg.val_batch_size() * rt.world_size)
        self.batches = min(cfg.validation_batches(), available)
        self.eos_id = None
        if cfg.data.document_masking:
            self.eos_id = source.meta["eos_id"] if tok is None else tok.eos_id
        self.cfg, self.rt = cfg, rt

    @torch.no_grad()
    def __call__(self, model: Transformer) -> float | None:
        if self.batches == 0:
            return None
        model.eval()
        total = torch.zeros((), device=self.rt.device)
        # In slices of the training micro-batch: validation then never needs more memory than a
        # training step (a 16-sequence batch of 8192 tokens has 34 GB of bf16 logits at a 128k
        # vocabulary, where the compiled loss is not chunked). Blocks are full, so the batch's mean
        # is the slices' means weighted by their sizes.
        rows = self.cfg.data.train_batch_size
        for _, (x, y, _idx) in zip(range(self.batches), self.stream, strict=False):
            for start in range(0, x.shape[0], rows):
                part = slice(start, start + rows)
                with autocast(self.cfg, self.rt):
                    ce, _ = model.loss(x[part].to(self.rt.device), y[part].to(self.rt.device), self.eos_id)
                total += ce.float() * (x[part].shape[0] / x.shape[0])
        model.train()
        return dist.all_reduce_mean(total / self.batches, self.rt).item()


def train(cfg: TrainConfig, notices: list[str] | None = None) -> TrainResult:
    run_dir = preflight(cfg)
    notices = list(notices or [])
    nccl = network.capture_nccl_log(run_dir, dist.resolve_device_type(cfg.parallel.device))
    rt = dist.setup(cfg.parallel.device)
    try:
        # Before any step is spent: which network NCCL really chose (and a stop if not EFA where
        # EFA was expected).
        if verdict := network.check(rt, cfg.parallel.require_efa, nccl):
            notices.append(verdict.line())
        return _train(cfg, rt, run_dir, notices)
    finally:
        dist.teardown()


def _train(cfg: TrainConfig, rt: dist.Runtime, run_dir: Path, notices: list[str]) -> TrainResult:
    torch.manual_seed(cfg.seed)
    if cfg.parallel.keep_host_memory:
        keep_freed_memory()
    reset_peak_memory(rt.device)  # the memory figure is this run's, not the imports'
    mcfg, seq_len = cfg.model_config(), cfg.seq_len()
    d, o, lg = cfg.data, cfg.optim, cfg.log
    model = build_model(cfg, rt)
    if cfg.checkpoint.init_from_hf:
        load_hf_into(model, Path(cfg.checkpoint.init_from_hf), mcfg)
        notices.append(f"fsdpkit: initialised from Hugging Face weights in {cfg.checkpoint.init_from_hf}")
    optimizer = build_optimizer(model, cfg)
    model_shape = model_shape_of(cfg)
    start_step, samples_done = 0, 0
    resume_from = resume_spec(cfg)
    if resume_from:
        found = checkpoint.resume(resume_from, model, optimizer, model_shape, rt, notices)
        if found is None:
            notices.append(f"fsdpkit: no complete checkpoint in {resume_from}; starting from step 0")
        else:
            start_step, samples_done = found.step, found.meta["samples"]
            notices.append(f"fsdpkit: resumed from {found.path} at step {start_step}")
    source, tok = data_pipeline(cfg, d.train_split, verbose=rt.is_main)
    batches = BatchStream(source, tok, seq_len, d.train_batch_size, rt.rank, rt.world_size, cfg.seed,
                          epochs=d.epochs, skip_blocks=samples_done)
    pin = rt.device.type == "cuda"
    stream = Prefetcher(batches, d.prefetch, pin_memory=pin) if d.prefetch else iter(batches)
    eos_id = (source.meta["eos_id"] if tok is None else tok.eos_id) if d.document_masking else None
    # This start of the run is attempt N: N earlier starts are on record (restarts, resubmissions,
    # a rerun with --resume). Rank 0's count, so every rank's sample log agrees.
    attempt = dist.broadcast_int(attempts(read_rows(run_dir / "metrics.jsonl")) if rt.is_main else 0, rt)
    sample_log = None
    if lg.log_samples:
        run_dir.mkdir(parents=True, exist_ok=True)
        sample_log = (run_dir / f"samples-rank{rt.rank}.jsonl").open("a", buffering=1)
        sample_log.write(json.dumps({"kind": "start", "step": start_step, "attempt": attempt}) + "\n")
    validate = Validator(cfg, rt)

    def bad_records() -> int:
        """Records skipped as bad so far, each once (sources without such records count 0)."""
        return sum(getattr(src, "bad_records", 0) for src in (source, validate.source))
    if validate.batches == 0:
        notices.append(f"warning: the {d.val_split!r} split holds less than one global validation batch "
                       f"({cfg.val_batch_size()} x {rt.world_size} blocks of {seq_len + 1} tokens); no validation")
    dtype = compute_dtype(cfg.parallel, rt.device.type)
    flops_tok = flops_per_token(mcfg, seq_len)
    peak, peak_source = peak_flops(rt.device, dtype, lg.peak_tflops)
    # Only rank 0 prints notices, so only rank 0 spends the 0.3 s measuring fp32 for this one.
    bf16_on_cpu = rt.is_main and peak_source == "measured-gemm" and dtype == torch.bfloat16
    if bf16_on_cpu and (ratio := cpu_bf16_gemm_ratio(peak)) < 1:
        notices.append(f"warning: on this CPU bf16 matrix products run at {ratio:.2f}x the fp32 rate (measured); "
                       "--mixed_precision fp32 is faster here")

    writer = None
    if rt.is_main:
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "config.yaml").write_text(yamlfile.dump(cfg.record(run_dir)))
        tb_dir = Path(lg.tensorboard_dir) if lg.tensorboard_dir else run_dir / "tensorboard"
        show_bar = lg.progress == "on" or (lg.progress == "auto" and sys.stderr.isatty())
        writer = MetricsWriter(run_dir, tb_dir if lg.tensorboard else None, show_bar, o.max_steps, attempt)
        # Each start of the run is marked, so readers can tell its attempts apart (a resume that
        # repeats no step included).
        writer.record("start", {"step": start_step, "world_size": rt.world_size,
                                "restart": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")),
                                "resubmission": int(os.environ.get("FSDPKIT_ATTEMPT", "0"))})
        for note in notices:
            writer.print(note)
        writer.print(
            f"fsdpkit: {cfg.preset} ({count_params(mcfg) / 1e6:.2f}M params), {rt.world_size} x "
            f"{rt.device.type}, {str(dtype).removeprefix('torch.')}, seq {seq_len}, global batch "
            f"{d.train_batch_size * rt.world_size * d.grad_accum_steps}, {o.max_steps} steps -> {run_dir}"
        )
        peak_txt = f"{peak / 1e12:.3f} TFLOP/s ({peak_source})" if peak else "unknown for this device"
        writer.print(f"fsdpkit: MFU denominator {peak_txt}; mesh {describe_mesh(model)}; activation "
                     f"checkpointing {cfg.parallel.activation_checkpointing}; compile {cfg.parallel.compile}")

    result = TrainResult(run_dir=run_dir, steps=start_step)
    tokens_per_step = d.train_batch_size * seq_len * rt.world_size * d.grad_accum_steps
    samples_per_step = d.train_batch_size * rt.world_size * d.grad_accum_steps
    loss_sum = torch.zeros((), device=rt.device)
    skipped = torch.zeros((), dtype=torch.int64, device=rt.device)  # steps with inf/nan gradients
    window_start, window_steps, window_faults = time.perf_counter(), 0, minor_page_faults()
    model.train()
    stop = dist.StopRequest(rt)
    checkpointer, saved_at = None, None
    if cfg.checkpoint.checkpoint_dir:
        checkpointer = checkpoint.Checkpointer(Path(cfg.checkpoint.checkpoint_dir), rt, cfg.checkpoint.keep_last,
                                               cfg.checkpoint.async_checkpoint)

    def save(n: int) -> None:
        nonlocal saved_at
        meta = {"samples": samples_done, "model": model_shape, "preset": cfg.preset,
                "loss": result.losses[-1][1] if result.losses else None, "config": cfg.record(run_dir)}
        path = checkpointer.save(n, model, optimizer, meta)
        saved_at = n
        if writer:
            how = "writing in the background" if cfg.checkpoint.async_checkpoint else "saved"
            writer.print(f"fsdpkit: checkpoint {path} {how}")
    for step in range(start_step, o.max_steps):
        lr = lr_at(step, cfg)
        set_lr(optimizer, lr)
        try:
            for micro in range(d.grad_accum_steps):
                x, y, indices = next(stream)
                if sample_log:
                    sample_log.write(json.dumps({"step": step + 1, "micro": micro, "blocks": indices,
                                                 "attempt": attempt}) + "\n")
                x, y = x.to(rt.device, non_blocking=True), y.to(rt.device, non_blocking=True)
                if rt.distributed and d.grad_accum_steps > 1:
                    # Reduce-scatter gradients once per optimizer step, not once per micro-step.
                    model.set_requires_gradient_sync(micro == d.grad_accum_steps - 1)
                with autocast(cfg, rt):
                    ce, total = model.loss(x, y, eos_id)
                (total / d.grad_accum_steps).backward()
                loss_sum += ce.detach().float() / d.grad_accum_steps
        except StopIteration:
            if writer:
                writer.print(f"fsdpkit: the data ran out after {d.epochs} epoch(s) at step {step}; stopping")
            if checkpointer and saved_at != result.steps and result.steps > start_step:
                save(result.steps)   # the run's last step, as at max_steps
            break
        grad_norm = clipped_step(optimizer, o.grad_clip)
        skipped += ~grad_norm.isfinite()
        optimizer.zero_grad(set_to_none=True)
        maybe_fail("step", step + 1, rt.rank)
        window_steps += 1
        samples_done += samples_per_step
        result.steps = step + 1
        n = step + 1
        if n % lg.logging_freq == 0 or n == o.max_steps:
            loss = dist.all_reduce_mean(loss_sum / window_steps, rt).item()
            elapsed = time.perf_counter() - window_start
            stats = StepStats(n, loss, lr, float(grad_norm), elapsed, window_steps,
                              samples_per_step * window_steps, tokens_per_step * window_steps,
                              rt.world_size, minor_page_faults() - window_faults, int(skipped))
            result.losses.append((n, loss))
            if writer:
                m = derive(stats, flops_tok, peak, peak_memory_bytes(rt.device))
                if m["mfu_above_peak"] and peak_source == "measured-gemm":
                    # Faster than the CPU's measured peak: other work slowed that measurement.
                    peak = max(peak, measure_cpu_peak_flops(dtype))
                    writer.print(f"fsdpkit: MFU denominator re-measured: {peak / 1e12:.3f} TFLOP/s (the start-up "
                                 "measurement was slowed by other work on this machine)")
                    m = derive(stats, flops_tok, peak, peak_memory_bytes(rt.device))
                m["bad_records"] = bad_records()
                writer.record("train", m, human_line(m))
                writer.advance(window_steps, loss)
            loss_sum.zero_()
            skipped.zero_()
            window_start, window_steps, window_faults = time.perf_counter(), 0, minor_page_faults()
        if (lg.validation_freq and n % lg.validation_freq == 0) or n == o.max_steps:
            val = validate(model)
            if val is not None:
                result.val_losses.append((n, val))
                if writer:
                    writer.record("val", {"step": n, "val_loss": val}, f"Batch {n} Validation loss: {val:.5f}")
            # Validation's time and page faults are not training's.
            window_start, window_faults = time.perf_counter(), minor_page_faults()
        ck = cfg.checkpoint
        stopping = stop.agreed()
        # With a checkpoint directory the last step is always saved, on checkpoint_freq or not.
        due = (ck.checkpoint_freq and n % ck.checkpoint_freq == 0) or n == o.max_steps
        if checkpointer and (due or stopping):
            save(n)
            window_start, window_faults = time.perf_counter(), minor_page_faults()
        if stopping:
            if checkpointer:
                checkpointer.wait()
            result.stopped_by_signal = True
            if writer:
                saved = "checkpoint saved" if ck.checkpoint_dir else "no --checkpoint_dir, nothing saved"
                writer.print(f"fsdpkit: stopping at step {n} on SIGTERM ({saved})")
            break

    stop.close()
    if checkpointer:
        checkpointer.wait()
    if isinstance(stream, Prefetcher):
        stream.close()
    if sample_log:
        sample_log.close()
    if writer:
        writer.jsonl.flush()
        # The whole run's history, earlier attempts included (what survived of them), not this attempt's.
        rows = read_rows(run_dir / "metrics.jsonl")
        kept = surviving(rows)
        train_rows = [r for r in kept if r.get("kind") == "train"]
        val_rows = [r for r in kept if r.get("kind") == "val"]
        summary = {
            "steps": result.steps,
            "final_loss": train_rows[-1]["loss"] if train_rows else None,
            "first_loss": train_rows[0]["loss"] if train_rows else None,
            "final_val_loss": val_rows[-1]["val_loss"] if val_rows else None,
            "attempts": attempts(rows),
            "world_size": rt.world_size,
            "bad_records": bad_records(),
        }
        (run_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
        if result.stopped_by_signal:
            pass  # said above, with the checkpoint it saved
        elif result.losses:
            writer.print(f"fsdpkit: done after {result.steps} steps; loss {summary['first_loss']:.4f} -> "
                         f"{summary['final_loss']:.4f}; metrics in {run_dir / 'metrics.jsonl'}")
        else:  # resumed at (or past) max_steps: a resubmitted job that had already finished
            writer.print(f"fsdpkit: nothing to do: already at step {result.steps} of {cfg.optim.max_steps}")
        writer.close()
    return result
