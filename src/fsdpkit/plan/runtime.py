"""How long a whole run takes: its steps at the planned step time, plus the validation passes and
the checkpoint saves it makes at its own intervals (each save blocks the loop for its write).

    total = steps x step time + validation + saves x (checkpoint / write rate)

Validation is its share of training's FLOPs (TrainConfig.validation_share) at the same speed.
Saves follow the trainer's rule (fsdpkit.train.trainer): every N steps, or every T of wall time,
and the last step always; with tiered checkpointing the periodic saves go to node memory and every
durable_every-th (and the last) to shared storage.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

from fsdpkit.plan.grace import MEMORY_MB_S_PER_NODE, write_seconds
from fsdpkit.train.config import TrainConfig


@dataclass(frozen=True)
class RunTime:
    steps: int
    tokens: int
    train_s: float
    validation_s: float
    saves: int               # checkpoint saves, the last step's included
    checkpoint_s: float      # the time they stop the loop for

    @property
    def total_s(self) -> float:
        return self.train_s + self.validation_s + self.checkpoint_s

    def explain(self) -> str:
        return (f"{self.steps:,} steps ({self.tokens:,} tokens): training {_hours(self.train_s)} + validation "
                f"{_hours(self.validation_s)} + {self.saves} checkpoint save(s) {_hours(self.checkpoint_s)} = "
                f"{_hours(self.total_s)}")

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "total_s": self.total_s, "hours": self.total_s / 3600, "explanation": self.explain()}


def _hours(seconds: float) -> str:
    return f"{seconds / 3600:,.2f} h"


def run_time(cfg: TrainConfig, steps: int, step_tokens: int, step_s: float, write_mb_per_s: float | None,
             nodes: int = 1) -> RunTime:
    """The run's time for `steps` optimizer steps of `step_s` seconds; `write_mb_per_s` None: it
    keeps no checkpoints (no checkpoint directory)."""
    train_s = steps * step_s
    validation_s = cfg.validation_share(steps) * train_s
    if write_mb_per_s is None or not cfg.checkpoint.checkpoint_dir:
        return RunTime(steps, steps * step_tokens, train_s, validation_s, 0, 0.0)
    durable_s = write_seconds(cfg.shape, write_mb_per_s, cfg.lora_shape)
    ck = cfg.checkpoint
    if ck.every_steps:
        periodic = (steps - 1) // ck.every_steps   # the last step's save is counted once, below
    elif ck.every_seconds:
        periodic = math.floor((train_s + validation_s) / ck.every_seconds)
    else:
        periodic = 0
    if ck.tiered:
        durable = periodic // ck.durable_every
        memory_s = write_seconds(cfg.shape, MEMORY_MB_S_PER_NODE * nodes, cfg.lora_shape)
        saves_s = durable * durable_s + (periodic - durable) * memory_s
    else:
        saves_s = periodic * durable_s
    return RunTime(steps, steps * step_tokens, train_s, validation_s, periodic + 1, saves_s + durable_s)
