"""How long a stopping job must be given: finish the step it is in, write a complete checkpoint to
shared storage, and exit. Kubernetes gives a pod 30 s after SIGTERM unless told otherwise; a
Llama 3.1 8B checkpoint with AdamW state is 96 GB, over three minutes at 500 MB/s.

    grace = 60 s (stop, vote, start and close the writers) + 2 x step time + 1.5 x (checkpoint / write rate)

rounded up to 10 s. The write rate is the volume's aggregate throughput (FSx for Lustre: its
per-TiB tier times its capacity, e.g. 250 MB/s/TiB x 4.8 TiB = 1.2 GB/s); the default assumes a
small, slow one.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

from fsdpkit.train.model.config import ModelConfig, count_params

DEFAULT_WRITE_MB_S = 500
FIXED_S = 60
WRITE_MARGIN = 1.5


@dataclass(frozen=True)
class GracePeriod:
    seconds: int
    checkpoint_bytes: int
    write_mb_per_s: float
    write_s: float
    step_s: float | None

    def explain(self) -> str:
        step = f" + 2 x {self.step_s:.1f} s to finish the step" if self.step_s else ""
        return (f"{self.seconds} s = {FIXED_S} s{step} + {WRITE_MARGIN} x {self.write_s:.0f} s to write the "
                f"{self.checkpoint_bytes / 1e9:.1f} GB checkpoint at {self.write_mb_per_s:g} MB/s")

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "explanation": self.explain()}


def checkpoint_bytes(model: ModelConfig) -> int:
    """A complete checkpoint: fp32 parameters and AdamW's two fp32 moments, 12 bytes a parameter
    (what DCP writes, summed over the ranks' shards)."""
    return 12 * count_params(model)


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


def cadence(model: ModelConfig, write_mb_per_s: float = DEFAULT_WRITE_MB_S) -> Cadence:
    write_s = checkpoint_bytes(model) / (write_mb_per_s * 1e6)
    minutes = math.ceil(max(MIN_EVERY_S, write_s / SAVE_SHARE) / 60)
    return Cadence(f"{minutes}m", minutes * 60, write_s, write_s / (minutes * 60 + write_s))


def grace_period(model: ModelConfig, write_mb_per_s: float = DEFAULT_WRITE_MB_S,
                 step_s: float | None = None) -> GracePeriod:
    size = checkpoint_bytes(model)
    write_s = size / (write_mb_per_s * 1e6)
    total = FIXED_S + 2 * (step_s or 0.0) + WRITE_MARGIN * write_s
    return GracePeriod(int(math.ceil(total / 10) * 10), size, write_mb_per_s, write_s, step_s)
