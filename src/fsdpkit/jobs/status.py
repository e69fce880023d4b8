"""What a job is doing, the same shape for every backend."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

# Terminal states end `fsdpkit job wait`; its exit code is 0 only for Succeeded.
TERMINAL = ("Succeeded", "Failed", "Cancelled")


@dataclass
class JobStatus:
    name: str
    backend: str
    state: str                      # Pending, Created, Running, Restarting, Deleting, Succeeded, Failed, Cancelled,
    #                                 Unknown
    message: str = ""
    namespace: str | None = None
    attempt: int = 0                # whole-job resubmissions so far
    replicas: dict[str, Any] = field(default_factory=dict)
    conditions: list[dict[str, Any]] = field(default_factory=list)
    details: dict[str, Any] = field(default_factory=dict)
    # What the job says of itself: a TrainJob's trainerStatus (see trainer_progress).
    progress: dict[str, Any] | None = None

    @property
    def finished(self) -> bool:
        return self.state in TERMINAL

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


# Other names operators give the same states: HyperPod's operator says Complete(d) for Succeeded.
_SYNONYMS = {"Complete": "Succeeded", "Completed": "Succeeded"}


def state_from_conditions(conditions: list[dict[str, Any]]) -> tuple[str, str]:
    """A job operator's conditions (Created, Running, Restarting, Succeeded or Complete(d), Failed,
    Suspended) -> (state, message). A final condition wins; otherwise the newest one that is True."""
    true = [{**c, "type": _SYNONYMS.get(str(c.get("type")), c.get("type"))} for c in conditions or []
            if str(c.get("status")) == "True"]
    for final in ("Failed", "Succeeded"):
        for c in true:
            if c.get("type") == final:
                return final, c.get("message") or c.get("reason") or ""
    if not true:
        return "Pending", ""
    newest = max(enumerate(true), key=lambda ic: (ic[1].get("lastTransitionTime") or "", ic[0]))[1]
    return str(newest.get("type")), newest.get("message") or newest.get("reason") or ""


def trainjob_state(status: dict[str, Any]) -> tuple[str, str]:
    """A TrainJob's status -> (state, message). Trainer v2 sets only final conditions (Complete,
    Failed) and Suspended; while it runs, its JobSet's child Jobs say whether pods are active."""
    true = {c.get("type"): c for c in status.get("conditions") or [] if str(c.get("status")) == "True"}
    for kind, state in (("Failed", "Failed"), ("Complete", "Succeeded"), ("Suspended", "Pending")):
        if kind in true:
            c = true[kind]
            return state, c.get("message") or c.get("reason") or ""
    jobs = status.get("jobsStatus") or []
    if any((j.get("active") or 0) > 0 or (j.get("ready") or 0) > 0 for j in jobs):
        return "Running", ""
    return ("Created", "") if jobs else ("Pending", "")


def trainer_progress(status: dict[str, Any]) -> dict[str, Any] | None:
    """A TrainJob's `status.trainerStatus` (Trainer 2.2 and later), which its rank 0 posts
    (fsdpkit.train.observe.trainjob_status): percent done, seconds left, the newest figures and
    when they were posted. None before the first post, or where the controller takes none."""
    ts = status.get("trainerStatus")
    if not ts:
        return None
    return {"percent": ts.get("progressPercentage"), "remaining_s": ts.get("estimatedRemainingSeconds"),
            "metrics": {m.get("name"): m.get("value") for m in ts.get("metrics") or []},
            "updated": ts.get("lastUpdatedTime")}
