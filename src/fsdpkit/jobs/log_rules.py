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

from typing import Any

from fsdpkit.jobs.resolved import ResolvedJob
from fsdpkit.train.observe.log_lines import ANY_STEP, FINAL, FINITE_STEP

BAD_LOSS_LINES = 3


def log_monitoring(job: ResolvedJob) -> list[dict[str, Any]]:
    """The rules for the job, or none where it does not run fsdpkit's trainer. The hang time and
    the loss threshold are the job's resolved ones (fsdpkit.jobs.resolved, fsdpkit.plan.grace)."""
    t = job.trainer
    if t is None or not job.spec.hyperpod.log_monitoring:
        return []
    start, hang = job.spec.hyperpod.start_timeout, t.hang_seconds
    rules: list[dict[str, Any]] = [
        {"name": "fsdpkit-started", "logPattern": f".*{ANY_STEP}.*", "expectedStartCutOffInSeconds": start},
        # Also bounded from the start: a run whose every loss is nan never matches at all.
        {"name": "fsdpkit-progress", "logPattern": f".*{FINITE_STEP}.*", "expectedStartCutOffInSeconds": start + hang,
         "expectedRecurringFrequencyInSeconds": hang},
        {"name": "fsdpkit-loss", "logPattern": f".*{FINITE_STEP}.*", "metricThreshold": t.loss_threshold,
         "operator": "gt", "metricEvaluationDataPoints": BAD_LOSS_LINES},
    ]
    return [{**rule, "stopPattern": f".*{FINAL}.*"} for rule in rules]
