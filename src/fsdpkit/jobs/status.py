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
    state: str                      # Pending, Created, Running, Restarting, Succeeded, Failed, Cancelled, Unknown
    message: str = ""
    namespace: str | None = None
    attempt: int = 0                # whole-job resubmissions so far
    replicas: dict[str, Any] = field(default_factory=dict)
    conditions: list[dict[str, Any]] = field(default_factory=list)
    details: dict[str, Any] = field(default_factory=dict)

    @property
    def finished(self) -> bool:
        return self.state in TERMINAL

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def state_from_conditions(conditions: list[dict[str, Any]]) -> tuple[str, str]:
    """The training operator's job conditions (Created, Running, Restarting, Succeeded, Failed,
    Suspended) -> (state, message). A final condition wins; otherwise the newest one that is True."""
    true = [c for c in conditions or [] if str(c.get("status")) == "True"]
    for final in ("Failed", "Succeeded"):
        for c in true:
            if c.get("type") == final:
                return final, c.get("message") or c.get("reason") or ""
    if not true:
        return "Pending", ""
    newest = max(enumerate(true), key=lambda ic: (ic[1].get("lastTransitionTime") or "", ic[0]))[1]
    return str(newest.get("type")), newest.get("message") or newest.get("reason") or ""
