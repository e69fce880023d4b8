"""A job's pods summed against a namespace's ResourceQuotas. The API server's quota admission
judges one pod at a time, so a server dry run of one pod of each kind passes a job whose pods
together are over the quota (4 pods x 8 GPUs against 16): the operator then makes two pods and
the others wait forever, with only events to say why. Here the whole job is held to each quota's
hard limit (a job over it can never run in this namespace) and to what is left of it (hard minus
used, from the quota's status, which the quota controller keeps)."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from decimal import Decimal
from typing import Any

from fsdpkit.cluster import quantity
from fsdpkit.cluster.pod_rules import templates

# Quota names that mean a pod's requests without saying so (ResourceQuota's own shorthand).
_PLAIN = ("cpu", "memory", "ephemeral-storage")


@dataclass(frozen=True)
class Excess:
    """One quota line the job does not fit: what it asks in all, the quota's hard limit, and its use."""

    quota: str
    resource: str
    asked: Decimal
    hard: Decimal
    used: Decimal

    @property
    def never(self) -> bool:
        return self.asked > self.hard

    def line(self, pods: int) -> str:
        asked, hard, used = (_fmt(self.resource, q) for q in (self.asked, self.hard, self.used))
        if self.never:
            return (f"ResourceQuota {self.quota}: the job's {pods} pods ask for {self.resource} {asked} in all, over "
                    f"its hard limit of {hard}: it can never run in this namespace")
        left = _fmt(self.resource, self.hard - self.used)
        return (f"ResourceQuota {self.quota}: the job's {pods} pods ask for {self.resource} {asked} in all, and "
                f"{left} of {hard} is left ({used} in use)")


def _fmt(resource: str, q: Decimal) -> str:
    name = resource.removeprefix("requests.").removeprefix("limits.")
    if name in ("memory", "ephemeral-storage") or name.startswith("hugepages-"):
        return quantity.fmt_bytes(q)
    return quantity.fmt_cores(q)


def replicas(obj: dict[str, Any]) -> list[tuple[int, dict[str, Any]]]:
    """(how many, pod spec) of each kind of pod a job object's operator makes."""
    spec = obj.get("spec") or {}
    kind = obj.get("kind")
    found = templates(obj)
    if kind == "PyTorchJob":
        counts = [int(r.get("replicas", 1)) for r in (spec.get("pytorchReplicaSpecs") or {}).values()]
    elif kind == "HyperPodPyTorchJob":
        counts = [int(r.get("replicas", 1)) for r in spec.get("replicaSpecs") or []]
    elif kind == "TrainJob":
        counts = [int((spec.get("trainer") or {}).get("numNodes", 1))]
    else:
        counts = [1] * len(found)
    return [(n, template.get("spec") or {}) for n, (_, template) in zip(counts, found, strict=True)]


def _pod_amount(pod: dict[str, Any], resource: str) -> Decimal:
    """What one pod counts against a quota line: `pods` 1, `limits.X` its containers' limits of X,
    `requests.X` (or plain cpu, memory) their requests; init containers ignored (they run first,
    and a training pod's are small)."""
    if resource == "pods":
        return Decimal(1)
    field, _, name = resource.partition(".") if resource.startswith(("requests.", "limits.")) else \
        ("requests", ".", resource)
    total = Decimal(0)
    for c in pod.get("containers") or []:
        value = ((c.get("resources") or {}).get(field) or {}).get(name)
        if value is not None:
            total += quantity.parse(value)
    return total


def counted(resource: str) -> bool:
    """Whether a quota line counts pods' resources (not objects such as count/secrets, or storage)."""
    return resource == "pods" or resource in _PLAIN or (
        resource.startswith(("requests.", "limits.")) and resource not in ("requests.storage",))


def excesses(quotas: Iterable[dict[str, Any]], pods: list[tuple[int, dict[str, Any]]],
             against_hard_only: bool = False) -> list[Excess]:
    """Every quota line the pods (count, pod spec) are over in all: over its hard limit, or, unless
    `against_hard_only` (a --replace whose old pods are still counted as used), over what is left."""
    out = []
    for q in quotas:
        name = (q.get("metadata") or {}).get("name", "?")
        if (q.get("spec") or {}).get("scopes") or (q.get("spec") or {}).get("scopeSelector"):
            continue   # a scoped quota (priority class, terminating, ...) counts only some pods: left to admission
        status = q.get("status") or {}
        hard = status.get("hard") or (q.get("spec") or {}).get("hard") or {}
        used = status.get("used") or {}
        for resource, limit in hard.items():
            if not counted(resource):
                continue
            asked = sum((n * _pod_amount(pod, resource) for n, pod in pods), Decimal(0))
            if not asked:
                continue
            e = Excess(name, resource, asked, quantity.parse(limit), quantity.parse(used.get(resource, 0)))
            if e.never or (not against_hard_only and e.asked > e.hard - e.used):
                out.append(e)
    return out
