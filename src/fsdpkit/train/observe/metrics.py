"""Throughput, FLOPs, MFU and memory, written as a human line, JSON lines and TensorBoard events."""

from __future__ import annotations

import contextlib
import resource
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import torch

from fsdpkit.hardware.accelerators import GPU_PEAK_TFLOPS
from fsdpkit.train.observe.log_lines import STEP_PREFIX
from fsdpkit.train.observe.sinks import JsonlSink, Sink, Sinks, TensorBoardSink


def gpu_peak_flops(device: torch.device, dtype: torch.dtype) -> float | None:
    name = torch.cuda.get_device_name(device)
    key = "bf16" if dtype == torch.bfloat16 else "fp32"
    for part, peaks in GPU_PEAK_TFLOPS.items():
        if part in name:
            return peaks[key] * 1e12
    return None


def _gemm_rate(a: torch.Tensor, b: torch.Tensor, seconds: float) -> float:
    iters, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        a @ b
        iters += 1
    return cast("float", 2 * a.shape[0] ** 3 * iters / (time.perf_counter() - start))


def measure_cpu_peak_flops(dtype: torch.dtype = torch.float32, seconds: float = 0.1, runs: int = 5) -> float:
    """This process's matmul FLOP/s on the CPU with its current thread count (the MFU denominator):
    the best of several short runs, since other work on the machine slows some runs, not the best.
    Runs of 20 ms (some eight 512^3 products on one core) read the rate as runs of 60 ms do, and
    every CPU run, each of its ranks, pays this before its first step."""
    n = 512
    a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
    for _ in range(3):
        a @ b
    return max(_gemm_rate(a, b, seconds / runs) for _ in range(runs))


def cpu_bf16_gemm_ratio(bf16_rate: float, seconds: float = 0.1) -> float:
    """A bf16 matmul rate measured on this CPU over its fp32 one. Having AVX512-BF16 is no promise:
    some VMs hide the units that make bf16 fast (benchmarks/RESULTS.md has both kinds)."""
    return bf16_rate / measure_cpu_peak_flops(torch.float32, seconds)


def peak_flops(device: torch.device, dtype: torch.dtype, given_tflops: float | None = None) -> tuple[float | None, str]:
    """The MFU denominator per device and where it comes from: given, a GPU's datasheet, or this CPU
    measured."""
    if given_tflops is not None:
        return given_tflops * 1e12, "given"
    if device.type == "cuda":
        return gpu_peak_flops(device, dtype), "datasheet"
    return measure_cpu_peak_flops(dtype), "measured-gemm"


def _proc_status_kib(field: str) -> int | None:
    """A `VmRSS`/`VmHWM` line of /proc/self/status in KiB (Linux); None elsewhere."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1])
    except OSError:
        pass
    return None


def _status_bytes(field: str) -> int:
    """A /proc/self/status size in bytes; off Linux, the lifetime peak (all there is there)."""
    kib = _proc_status_kib(field)
    if kib is not None:
        return kib * 1024
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss if sys.platform == "darwin" else rss * 1024


def resident_bytes() -> int:
    """This process's resident set now (Linux), or its lifetime peak where that is all there is."""
    return _status_bytes("VmRSS")


def reset_peak_memory(device: torch.device) -> None:
    """Start a new peak-memory window: the CUDA allocator's peak, or on Linux the process's
    resident high-water mark (writing 5 to /proc/self/clear_refs resets VmHWM)."""
    if device.type == "cuda":
        # Before CUDA is initialised nothing is allocated (and resetting raises "Invalid device").
        if torch.cuda.is_initialized():
            torch.cuda.reset_peak_memory_stats(device)
        return
    # Not Linux, or not allowed: the peak stays the process's lifetime peak.
    with contextlib.suppress(OSError):
        Path("/proc/self/clear_refs").write_text("5")


def peak_memory_bytes(device: torch.device) -> int:
    """Peak allocated device memory; on CPU the peak resident set since the last reset (a proxy:
    it also counts the interpreter and libraries, which is why benchmarks subtract a baseline)."""
    if device.type == "cuda":
        return cast("int", torch.cuda.max_memory_allocated(device))
    return _status_bytes("VmHWM")


@dataclass
class StepStats:
    step: int
    loss: float
    lr: float
    grad_norm: float
    elapsed: float  # seconds the measured window took
    steps: int  # optimizer steps in the window
    samples: int  # global samples in the measured window
    tokens: int  # global tokens in the measured window
    world_size: int
    page_faults: int = 0  # this process's minor page faults in the window
    skipped: int = 0  # optimizer steps skipped in the window: their gradients held inf or nan


def minor_page_faults() -> int:
    """Minor page faults of this process so far: memory the OS had to map in (zeroed) on first touch.
    A steady training step should make next to none (see fsdpkit.train.runtime.host_memory)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def derive(s: StepStats, flops_tok: float, peak: float | None, mem: int) -> dict[str, Any]:
    tok_s = s.tokens / s.elapsed
    per_dev = tok_s / s.world_size
    tflops = flops_tok * per_dev / 1e12
    mfu = tflops * 1e12 / peak if peak else None
    return {
        "step": s.step,
        "loss": s.loss,
        "lr": s.lr,
        "grad_norm": s.grad_norm,
        "step_time_s": s.elapsed / s.steps,
        "samples_per_s": s.samples / s.elapsed,
        "tokens_per_s": tok_s,
        "tokens_per_s_per_device": per_dev,
        "tflops_per_device": tflops,
        # More than the peak is impossible: the denominator is wrong (a CPU peak measured while the
        # machine was busy), so no figure is recorded rather than one over 100%.
        "mfu": mfu if mfu is None or mfu <= 1 else None,
        "mfu_above_peak": mfu is not None and mfu > 1,
        "peak_memory_gib": mem / 2**30,
        "host_page_faults_per_step": s.page_faults / s.steps,
        "skipped_steps": s.skipped,
    }


def human_line(m: dict[str, Any]) -> str:
    """The reference's line (`Batch N Loss: ..., Speed: ... samples/sec, lr: ...`) plus new fields."""
    mfu = f"{100 * m['mfu']:.2f}%" if m.get("mfu") is not None else \
        "n/a (above the peak: see --peak-tflops)" if m.get("mfu_above_peak") else "n/a"
    return (
        STEP_PREFIX.format(step=m["step"], loss=m["loss"]) + f"Speed: {m['samples_per_s']:.2f} samples/sec, "
        f"lr: {m['lr']:.6f}, grad_norm: {m['grad_norm']:.3f}, tokens/s: {m['tokens_per_s']:.0f}, "
        f"tokens/s/device: {m['tokens_per_s_per_device']:.0f}, "
        f"TFLOPs/device: {m['tflops_per_device']:.3f}, MFU: {mfu}, mem: {m['peak_memory_gib']:.2f} GiB"
        + (f", expert load max/mean {m['expert_load_max_over_mean']:.2f}" if "expert_load_max_over_mean" in m else "")
        + (f", rewards: accuracy {m['rewards/accuracies']:.3f}, margin {m['rewards/margins']:.4f}"
           if "rewards/accuracies" in m else "")
        + (f", skipped {m['skipped_steps']} step(s): inf/nan gradients" if m.get("skipped_steps") else "")
    )


class MetricsWriter:
    """Rank 0's output: every record to the run's sinks (metrics.jsonl, TensorBoard, the trackers;
    observe.sinks), and stdout lines under a progress bar."""

    def __init__(self, run_dir: Path, tensorboard_dir: Path | None, progress: bool, total_steps: int,
                 attempt: int = 0, trackers: list[Sink] | None = None):
        self.attempt = attempt  # on every start row, so each attempt of a resumed run is told apart
        self.jsonl = JsonlSink(run_dir, attempt)
        self.sinks = Sinks([self.jsonl],
                           [*([TensorBoardSink(tensorboard_dir)] if tensorboard_dir is not None else []),
                            *(trackers or [])])
        self.bar = None
        if progress:
            from tqdm import tqdm

            self.bar = tqdm(total=total_steps, unit="step", dynamic_ncols=True, leave=True)

    def print(self, line: str) -> None:
        if self.bar is not None:
            self.bar.write(line)
        else:
            print(line, flush=True)

    def record(self, kind: str, metrics: dict[str, Any], line: str | None = None) -> None:
        self.sinks.log(kind, {**metrics, "attempt": self.attempt} if kind == "start" else metrics)
        if line:
            self.print(line)

    def flush(self) -> None:
        """metrics.jsonl whole on disk, for a reader in this process (the run's summary)."""
        self.jsonl.file.flush()

    def advance(self, steps: int, loss: float | None = None) -> None:
        if self.bar is not None:
            self.bar.update(steps)
            if loss is not None:
                self.bar.set_postfix(loss=f"{loss:.4f}")

    def close(self, ok: bool = True) -> None:
        if self.bar is not None:
            self.bar.close()
        self.sinks.close(ok)
