"""The HyperPod training operator's log-monitoring rules, written from fsdpkit's own progress line
(fsdpkit.train.observe.log_lines), which no other tool can know exactly.

HyperPod's elastic agent reads the log of local rank 0 on every node and evaluates each rule on
each line (`re.match`, so every pattern starts with `.*`):
- started: a step line within `start_timeout` of the start, else the job never started;
- progress: a step line with a finite loss at least every `hang_timeout` seconds, else it hangs (a
  loss of nan or inf is no progress, so a run that went non-finite is caught here too);
- loss: a finite loss above `loss_threshold` on 3 logging lines in a row is a bad run.
Each rule stops at the trainer's last line (`stopPattern`): a node that finished, or stopped with
its checkpoint saved, and then waits for its launcher to exit is not hung.
The operator then restarts per the job's restartPolicy, and the trainer resumes from its newest
checkpoint."""

from __future__ import annotations

import math
from typing import Any

from fsdpkit.jobs.command import durable_write_seconds, planned_step_seconds
from fsdpkit.jobs.spec import JobSpec, train_config
from fsdpkit.train.config import TrainConfig
from fsdpkit.train.observe.log_lines import ANY_STEP, FINAL, FINITE_STEP

MIN_HANG_S = 600       # below this, a slow storage stall or a long validation reads as a hang
DEFAULT_HANG_S = 1800  # without a step time to plan from (no GPU instance type)
HANG_WINDOWS = 5       # logging windows a hang must outlast
BAD_LOSS_LINES = 3


def hang_seconds(spec: JobSpec, cfg: TrainConfig) -> int:
    """Time between two step lines that means a hang: several logging windows at the planned step
    time, plus a checkpoint's write (a synchronous save stops the loop) and a validation pass."""
    if spec.hyperpod.hang_timeout is not None:
        return spec.hyperpod.hang_timeout
    step_s = planned_step_seconds(spec, cfg)
    if step_s is None and (spec.instance is None or spec.instance.resource != "nvidia.com/gpu"):
        return DEFAULT_HANG_S
    write_s = durable_write_seconds(spec, cfg) if spec.command is None else 0.0
    window_s = cfg.log.logging_freq * (step_s or 0.0)
    return max(MIN_HANG_S, math.ceil((HANG_WINDOWS * window_s + 1.5 * write_s + 60) / 60) * 60)


def loss_threshold(spec: JobSpec, cfg: TrainConfig) -> int:
    """Twice the loss of a uniform guess over the vocabulary: a run that starts at ln(V) and is
    above 2 ln(V) three times in a row has diverged."""
    if spec.hyperpod.loss_threshold is not None:
        return spec.hyperpod.loss_threshold
    return math.ceil(2 * math.log(cfg.shape.vocab_size))


def log_monitoring(spec: JobSpec) -> list[dict[str, Any]]:
    """The rules for the job, or none where it does not run fsdpkit's trainer."""
    if spec.command is not None or not spec.hyperpod.log_monitoring:
        return []
    cfg = train_config(spec)
    start, hang = spec.hyperpod.start_timeout, hang_seconds(spec, cfg)
    rules: list[dict[str, Any]] = [
        {"name": "fsdpkit-started", "logPattern": f".*{ANY_STEP}.*", "expectedStartCutOffInSeconds": start},
        # Also bounded from the start: a run whose every loss is nan never matches at all.
        {"name": "fsdpkit-progress", "logPattern": f".*{FINITE_STEP}.*", "expectedStartCutOffInSeconds": start + hang,
         "expectedRecurringFrequencyInSeconds": hang},
        {"name": "fsdpkit-loss", "logPattern": f".*{FINITE_STEP}.*", "metricThreshold": loss_threshold(spec, cfg),
         "operator": "gt", "metricEvaluationDataPoints": BAD_LOSS_LINES},
    ]
    return [{**rule, "stopPattern": f".*{FINAL}.*"} for rule in rules]
