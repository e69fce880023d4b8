"""Will a job's training fit its GPUs, and can it keep its work: the capacity planner's verdict on a
spec, and the one rule for a job that will not fit or has nowhere to keep a checkpoint (a warning;
with --strict an error before anything is submitted)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from fsdpkit.errors import UserError, hint_of
from fsdpkit.jobs.resolved import ResolvedJob
from fsdpkit.jobs.spec import JobSpec
from fsdpkit.plan.planner import Plan, advice


class DoesNotFit(UserError):
    """--strict and a warning: the planner says the job will not fit, or it cannot keep a checkpoint."""


def unkept(spec: JobSpec) -> str | None:
    """Why a job would lose its work, where it would: several GPU nodes running fsdpkit's trainer
    with no storage that outlives a pod, so a checkpoint is lost with its node."""
    if spec.command is None and spec.nodes.max > 1 and spec.gpus and not spec.storage.enabled:
        where = "storage.shared_path (a directory every node mounts)" if spec.backend == "slurm" else \
            "storage.claim (an existing PVC such as FSx for Lustre) or storage.size"
        return (f"storage: a {spec.nodes}-node GPU job with no storage cannot keep a checkpoint, so one lost node "
                f"loses the whole run; give {where}")
    return None


def check_job(job: ResolvedJob) -> tuple[Plan, str] | None:
    """The plan for a job's training on its GPUs and the one-line verdict; None when there is
    nothing to plan (its own command, no instance type, not NVIDIA GPUs)."""
    if job.trainer is None or job.trainer.plan is None:
        return None
    return job.trainer.plan, advice(job.trainer.plan)


def capacity(job: ResolvedJob, strict: bool, warn: Callable[[str], None]) -> dict[str, Any] | None:
    """The verdict as data; a job that will not fit, or cannot keep its checkpoints, is `warn`ed
    about, or with `strict` refused."""
    if why := unkept(job.spec):
        if strict:
            raise DoesNotFit(f"{why}; not submitted (--strict)", hint=hint_of(why))
        warn(why)
    checked = check_job(job)
    if checked is None:
        return None
    p, verdict = checked
    if p.fits is False:
        if strict:
            raise DoesNotFit(f"plan: {verdict}; not submitted (--strict); see `fsdpkit plan SPEC`")
        warn(f"plan: {verdict}; see `fsdpkit plan SPEC` (--strict refuses such jobs)")
    return {"fits": p.fits, "peak_gib": round(p.memory.peak / 2**30, 2), "verdict": verdict}
