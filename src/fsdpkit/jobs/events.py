"""Why a job that has no running pods waits, from the cluster's events: the operator that cannot
create its pods (the training operator's FailedCreatePod on the job, JobSet's Job controller's
FailedCreate on a TrainJob's Jobs: a PriorityClass that does not exist, Pod Security, a quota),
the scheduler that cannot place them (FailedScheduling on the pods, with its reason), Kueue's
verdict on the job's Workload. The job object says "Pending" through all of these; the events say
which, and a job whose pods cannot be created will never start until its spec changes."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

# Reasons of the controllers that make a job's pods (or its Jobs) and could not: the job cannot start.
CANNOT_CREATE = ("FailedCreate", "FailedCreatePod")
# Kueue's events on a Workload while it waits for quota (Normal, yet the answer to "why Pending").
KUEUE_WAITING = ("Pending",)


@dataclass(frozen=True)
class Reason:
    """The newest event that says why the job waits."""

    reason: str
    message: str
    kind: str        # the object it is about: the job, one of its pods, a Job, its Workload
    name: str
    count: int
    at: str

    @property
    def cannot_create(self) -> bool:
        return self.reason in CANNOT_CREATE

    def line(self) -> str:
        who = "the operator cannot create its pods" if self.cannot_create else f"{self.kind} {self.name}"
        again = f" ({self.count} times)" if self.count > 1 else ""
        return f"{who}: {self.reason}{again}: {' '.join(self.message.split())}"

    def to_dict(self) -> dict[str, Any]:
        return {"reason": self.reason, "message": self.message, "object": f"{self.kind}/{self.name}",
                "count": self.count, "at": self.at, "cannot_create": self.cannot_create}


def about(event: dict[str, Any], job: str, kind: str) -> bool:
    """Whether an event is about the job (of `kind`), its pods, the Jobs JobSet makes for it, or its
    Kueue Workload (named KIND-JOB-HASH by Kueue)."""
    obj = event.get("involvedObject") or event.get("regarding") or {}
    name, what = str(obj.get("name") or ""), obj.get("kind")
    if what == kind or what == "JobSet":
        return name == job
    if what == "Pod":   # JOB-master-0, JOB-worker-3, a JobSet's JOB-node-0-0-x7k2p, HyperPod's JOB-pod-0
        return re.match(rf"{re.escape(job)}-(master|worker|node|pod)-\d", name) is not None
    if what == "Job":   # the Jobs JobSet makes of a TrainJob's replicated jobs: JOB-node-0
        return re.fullmatch(rf"{re.escape(job)}-[a-z0-9]+-\d+", name) is not None
    if what == "Workload":
        return re.fullmatch(rf"{kind.lower()}-{re.escape(job)}-[a-z0-9]{{5}}", name) is not None
    return False


def _when(event: dict[str, Any]) -> str:
    return str(event.get("lastTimestamp") or event.get("eventTime") or
               (event.get("metadata") or {}).get("creationTimestamp") or "")


def why_waiting(events: list[dict[str, Any]], job: str, kind: str) -> Reason | None:
    """The newest Warning about the job (else Kueue's newest word on its Workload), or None."""
    mine = [e for e in events if about(e, job, kind)]
    said = [e for e in mine if e.get("type") == "Warning"] or \
        [e for e in mine if e.get("reason") in KUEUE_WAITING and (e.get("involvedObject") or {}).get("kind") ==
         "Workload"]
    if not said:
        return None
    newest = max(said, key=_when)
    obj = newest.get("involvedObject") or newest.get("regarding") or {}
    return Reason(str(newest.get("reason") or ""), str(newest.get("message") or newest.get("note") or ""),
                  str(obj.get("kind") or ""), str(obj.get("name") or ""), int(newest.get("count") or 1),
                  _when(newest))
