"""How long a stopping job must be given: finish the step it is in, write a complete checkpoint to
shared storage, and exit. Kubernetes gives a pod 30 s after SIGTERM unless told otherwise; a
Llama 3.1 8B checkpoint with AdamW state is 96 GB, over three minutes at 500 MB/s (a LoRA run's holds
its adapters alone).

    grace = 60 s (stop, vote, start and close the writers) + 2 x step time + 1.5 x (checkpoint / write rate)

rounded up to 10 s. With `checkpoint.tiered` the stop's checkpoint goes to HyperPod's in-memory
store instead, written at MEMORY_MB_S_PER_NODE on every node at once.

A job's start-up, what an operator's start-up and fault deadlines are sized by:

    start-up = 600 s (schedule, pull the image, start the agent, rendezvous)
               + 1.5 x ((base weights + checkpoint) / read rate) + 300 s to compile on GPUs

rounded up to a minute. The write rate is the volume's aggregate throughput (FSx for Lustre: its
per-TiB tier times its capacity, e.g. 250 MB/s/TiB x 4.8 TiB = 1.2 GB/s); the default assumes a
small, slow one.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

from fsdpkit.plan.memory import adapter_shapes
from fsdpkit.train.model.config import LoraShape, ModelConfig, count_params

DEFAULT_WRITE_MB_S = 500
# HyperPod's in-memory checkpoint store, per node: each rank's shard serialised and sent over the
# node's network to the store's service (an assumption, on the low side for p4d/p5 networking).
MEMORY_MB_S_PER_NODE = 1000
FIXED_S = 60
WRITE_MARGIN = 1.5


@dataclass(frozen=True)
class GracePeriod:
    seconds: int
    checkpoint_bytes: int
    write_mb_per_s: float
    write_s: float
    step_s: float | None
    tier: str = "shared storage"   # where the stop's checkpoint goes

    def explain(self) -> str:
        step = f" + 2 x {self.step_s:.1f} s to finish the step" if self.step_s else ""
        return (f"{self.seconds} s = {FIXED_S} s{step} + {WRITE_MARGIN} x {self.write_s:.0f} s to write the "
                f"{self.checkpoint_bytes / 1e9:.1f} GB checkpoint at {self.write_mb_per_s:g} MB/s to {self.tier}")

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "explanation": self.explain()}


def checkpoint_bytes(model: ModelConfig, lora: LoraShape | None = None) -> int:
    """A complete checkpoint: fp32 parameters and AdamW's two fp32 moments, 12 bytes a parameter
    (what DCP writes, summed over the ranks' shards); of a LoRA run, its adapters' alone (the
    frozen base is not saved)."""
    if lora is None:
        return 12 * count_params(model)
    return 12 * model.n_layers * sum(math.prod(s) for s in adapter_shapes(model, lora))


def write_seconds(model: ModelConfig, mb_per_s: float, lora: LoraShape | None = None) -> float:
    """How long a complete checkpoint takes to write (or read) at `mb_per_s`."""
    return checkpoint_bytes(model, lora) / (mb_per_s * 1e6)


# Periodic checkpoints cost at most this share of the run's time; never more often than every 10 min.
SAVE_SHARE = 0.05
MIN_EVERY_S = 600


@dataclass(frozen=True)
class Cadence:
    """How often a job checkpoints when its spec does not say: saving (a blocking write of the whole
    checkpoint) takes at most SAVE_SHARE of the time, and a failure loses at most one interval."""

    every: str           # a checkpoint_every value: "36m"
    seconds: int
    write_s: float
    share: float         # of the run's time spent saving

    def explain(self) -> str:
        return (f"every {self.every}: writing it takes {self.write_s:.0f} s, {self.share:.1%} of the run "
                f"(at most {SAVE_SHARE:.0%}, at least {MIN_EVERY_S // 60} min apart); the last step is always saved")

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "explanation": self.explain()}


def cadence(model: ModelConfig, write_mb_per_s: float = DEFAULT_WRITE_MB_S, lora: LoraShape | None = None) -> Cadence:
    write_s = write_seconds(model, write_mb_per_s, lora)
    minutes = math.ceil(max(MIN_EVERY_S, write_s / SAVE_SHARE) / 60)
    return Cadence(f"{minutes}m", minutes * 60, write_s, write_s / (minutes * 60 + write_s))


def stop_tier(tiered: bool, write_mb_per_s: float, nodes: int) -> tuple[float, str]:
    """Where a stopping job writes its checkpoint, and how fast: shared storage at its rate, or
    with tiered checkpointing every node's share to the in-memory store."""
    if tiered:
        return MEMORY_MB_S_PER_NODE * nodes, f"node memory (tiered, {MEMORY_MB_S_PER_NODE} MB/s a node)"
    return write_mb_per_s, "shared storage"


def grace_period(model: ModelConfig, write_mb_per_s: float = DEFAULT_WRITE_MB_S, step_s: float | None = None,
                 tier: str = "shared storage", lora: LoraShape | None = None) -> GracePeriod:
    size, write_s = checkpoint_bytes(model, lora), write_seconds(model, write_mb_per_s, lora)
    total = FIXED_S + 2 * (step_s or 0.0) + WRITE_MARGIN * write_s
    return GracePeriod(int(math.ceil(total / 10) * 10), size, write_mb_per_s, write_s, step_s, tier)


PULL_S = 600     # schedule the pods, pull a 15-20 GB training image, start the agents and rendezvous
COMPILE_S = 300  # torch.compile's first graphs on a GPU (a warm cache on shared storage is faster)


@dataclass(frozen=True)
class StartUp:
    """From pods asked for to the first step: what a job restarted after a fault spends again."""

    seconds: int
    read_s: float      # the newest checkpoint read back (0 without shared storage to resume from)
    compile_s: float
    base_s: float = 0.0   # the Hugging Face weights a fine-tune starts from, read on every start

    def explain(self) -> str:
        base = f" + {WRITE_MARGIN} x {self.base_s:.0f} s to read the base weights" if self.base_s else ""
        read = f" + {WRITE_MARGIN} x {self.read_s:.0f} s to read the checkpoint back" if self.read_s else ""
        compiled = f" + {self.compile_s:.0f} s to compile" if self.compile_s else ""
        return f"{self.seconds} s = {PULL_S} s to schedule, pull the image and rendezvous{base}{read}{compiled}"

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "explanation": self.explain()}


def startup(model: ModelConfig | None, read_mb_per_s: float = DEFAULT_WRITE_MB_S, compiles: bool = True,
            lora: LoraShape | None = None, base: ModelConfig | None = None) -> StartUp:
    """The planned start-up; `model` None where nothing is resumed (no checkpoint storage); `base`
    the model whose Hugging Face weights (bf16, as the hub ships them) every start reads. The
    volume's write rate stands for its read rate: FSx for Lustre reads at least as fast."""
    read_s = write_seconds(model, read_mb_per_s, lora) if model is not None else 0.0
    base_s = 2 * count_params(base) / (read_mb_per_s * 1e6) if base is not None else 0.0
    compile_s = COMPILE_S if compiles else 0.0
    total = PULL_S + WRITE_MARGIN * (base_s + read_s) + compile_s
    return StartUp(int(math.ceil(total / 60) * 60), read_s, compile_s, base_s)


MIN_HANG_S = 600       # below this, a slow storage stall or a long validation reads as a hang
DEFAULT_HANG_S = 1800  # without a step time to plan from (no NVIDIA instance type)
HANG_WINDOWS = 5       # logging windows a hang must outlast


@dataclass(frozen=True)
class HangTime:
    """Time between two step lines that means a hang (HyperPod's log rule): several logging windows
    at the planned step time, plus a checkpoint's write (a synchronous save stops the loop) and a
    validation pass, in whole minutes; DEFAULT_HANG_S without a step time to plan from."""

    step_s: float | None
    logging_freq: int
    write_s: float
    planned: bool      # the job's nodes are GPUs the planner models

    @property
    def seconds(self) -> int:
        if not self.planned:
            return DEFAULT_HANG_S
        return max(MIN_HANG_S, math.ceil(self._raw() / 60) * 60)

    def explain(self) -> str:
        if not self.planned:
            return f"{DEFAULT_HANG_S} s: no step time to plan from (no NVIDIA instance type)"
        return (f"{HANG_WINDOWS} logging windows of {self.logging_freq} steps at {self.step_s or 0.0:.1f} s + "
                f"{WRITE_MARGIN} x {self.write_s:.0f} s to write a checkpoint + 60 s = {self._raw():.0f} s, in whole "
                f"minutes, at least {MIN_HANG_S} s")

    def _raw(self) -> float:
        return HANG_WINDOWS * self.logging_freq * (self.step_s or 0.0) + WRITE_MARGIN * self.write_s + 60
