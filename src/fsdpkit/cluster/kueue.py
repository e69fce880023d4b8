"""Kueue as a team on a shared cluster meets it (HyperPod task governance is Kueue underneath): a
LocalQueue in the team's namespace feeding a ClusterQueue with the team's quota, which it may lend
to and borrow from its cohort; priorities as WorkloadPriorityClasses.

What Kueue decided is read from Kueue itself, never guessed from the quota: the Workload it makes
for a job carries a QuotaReserved condition whose message names the resource, the flavor and the
amount (`insufficient quota for nvidia.com/gpu in flavor p5, ... > maximum capacity (8)` for a job
that can never fit; `insufficient unused quota for ..., 8 more needed` for one that waits)."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from fsdpkit.cluster.client import api_resources
from fsdpkit.errors import UserError
from fsdpkit.hardware.instances import Instance

GROUP = "kueue.x-k8s.io"
VERSIONS = ("v1beta2", "v1beta1")   # v1beta2 from Kueue 0.15; v1beta1 before and beside it
# HyperPod task governance's names for a team's objects (its compute quota allocation makes them).
TEAM_NAMESPACE = "hyperpod-ns-{team}"
TEAM_QUEUE = "hyperpod-ns-{team}-localqueue"
NEVER_FITS = "insufficient quota for"   # Kueue's fitsMaxCapacity: over what the queue could ever lend it
_DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$")


@dataclass(frozen=True)
class Admission:
    """What Kueue said of a job's Workload: admitted, queued (waiting for quota in use), never (over
    the most the ClusterQueue could ever have), or unanswered (no Workload or condition yet)."""

    state: str
    message: str = ""
    workload: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return {"state": self.state, "message": self.message, "workload": self.workload}


def served_version(custom: Any, host: str | None = None) -> str | None:
    """The Kueue API version the cluster serves (discovery, open to every user), newest first; None
    without Kueue. `custom` is a CustomObjectsApi."""
    return next((v for v in VERSIONS if "localqueues" in (api_resources(custom, GROUP, v, host, "finding Kueue's API")
                                                          or ())), None)


def node_quota(inst: Instance) -> dict[str, str | int]:
    """One node's worth of what a training pod on it requests: cpu, memory, its accelerators, EFA."""
    per_node: dict[str, str | int] = {"cpu": inst.vcpus, "memory": f"{inst.memory_gib}Gi"}
    if inst.accelerators:
        per_node[inst.resource] = inst.accelerators
    if inst.efa:
        per_node["vpc.amazonaws.com/efa"] = inst.efa
    return per_node


def owned_by(workload: dict[str, Any], kind: str, name: str) -> bool:
    return any(ref.get("kind") == kind and ref.get("name") == name
               for ref in (workload.get("metadata") or {}).get("ownerReferences") or [])


def admission(workload: dict[str, Any] | None) -> Admission:
    """The state of one Workload from its conditions, as Kueue writes them."""
    if workload is None:
        return Admission("unanswered")
    name = (workload.get("metadata") or {}).get("name")
    conditions = {c.get("type"): c for c in (workload.get("status") or {}).get("conditions") or []}
    admitted, reserved = conditions.get("Admitted"), conditions.get("QuotaReserved")
    if (admitted or {}).get("status") == "True" or (reserved or {}).get("status") == "True":
        return Admission("admitted", str((admitted or reserved or {}).get("message") or ""), name)
    if reserved is None:
        return Admission("unanswered", "", name)
    message = str(reserved.get("message") or reserved.get("reason") or "")
    return Admission("never" if NEVER_FITS in message else "queued", message, name)


@dataclass
class Usage:
    """One resource of one flavor of a ClusterQueue: its nominal quota, what it may borrow and lend,
    and what its admitted workloads use now (of which borrowed)."""

    flavor: str
    resource: str
    nominal: str
    borrowing_limit: str | None = None
    lending_limit: str | None = None
    used: str = "0"
    borrowed: str = "0"

    def line(self) -> str:
        limits = "".join(f", {what} up to {v}" for what, v in (("borrows", self.borrowing_limit),
                                                               ("lends", self.lending_limit)) if v is not None)
        return f"{self.resource} in {self.flavor}: {self.used} used of {self.nominal}" + \
            (f" ({self.borrowed} borrowed)" if self.borrowed not in ("0", "") else "") + limits


@dataclass
class QueueReport:
    cluster_queue: str
    cohort: str | None
    usage: list[Usage] = field(default_factory=list)
    pending: int = 0
    admitted: int = 0

    def to_dict(self) -> dict[str, Any]:
        return {"cluster_queue": self.cluster_queue, "cohort": self.cohort, "pending": self.pending,
                "admitted": self.admitted, "usage": [vars(u) for u in self.usage]}


def queue_report(cq: dict[str, Any]) -> QueueReport:
    """A ClusterQueue's quota (spec.resourceGroups) beside its use (status.flavorsUsage), per flavor
    and resource: nominal, borrowing and lending limits, in use, borrowed."""
    spec, status = cq.get("spec") or {}, cq.get("status") or {}
    used = {(f.get("name"), r.get("name")): r for f in status.get("flavorsUsage") or []
            for r in f.get("resources") or []}
    report = QueueReport(str((cq.get("metadata") or {}).get("name")), spec.get("cohort") or spec.get("cohortName"),
                         pending=int(status.get("pendingWorkloads") or 0),
                         admitted=int(status.get("admittedWorkloads") or 0))
    for group in spec.get("resourceGroups") or []:
        for flavor in group.get("flavors") or []:
            for r in flavor.get("resources") or []:
                u = used.get((flavor.get("name"), r.get("name"))) or {}
                report.usage.append(Usage(
                    str(flavor.get("name")), str(r.get("name")), str(r.get("nominalQuota")),
                    None if r.get("borrowingLimit") is None else str(r["borrowingLimit"]),
                    None if r.get("lendingLimit") is None else str(r["lendingLimit"]),
                    str(u.get("total", "0")), str(u.get("borrowed", "0"))))
    return report


@dataclass(frozen=True)
class TeamPlan:
    """A team's share of one GPU instance type, in nodes: its nominal quota, how much more it may
    borrow from the cohort and how much of its own it lends, and the priorities its jobs run at."""

    team: str
    instance_type: str
    nodes: int
    cohort: str | None = None
    borrow_nodes: int | None = None    # None: no limit on borrowing within the cohort
    lend_nodes: int | None = None      # None: all of it may be lent while unused
    priorities: tuple[tuple[str, int], ...] = ()


def check_team(plan: TeamPlan) -> None:
    """Each value Kubernetes or Kueue would refuse later, as a one-line UserError naming its flag."""
    ns = TEAM_NAMESPACE.format(team=plan.team)
    if not _DNS_LABEL.match(ns) or len(TEAM_QUEUE.format(team=plan.team)) > 63:
        raise UserError(f"--name: {plan.team!r} makes namespace {ns!r}, not a Kubernetes name (lowercase letters, "
                        f"digits and '-', the queue's name within 63 characters)")
    if plan.nodes < 1:
        raise UserError(f"--nodes: {plan.nodes} is out of range (at least 1)")
    for flag, n in (("--borrow-nodes", plan.borrow_nodes), ("--lend-nodes", plan.lend_nodes)):
        if n is not None and not plan.cohort:
            raise UserError(f"{flag}: borrowing and lending are within a cohort; give --cohort")
        if n is not None and n < 0:
            raise UserError(f"{flag}: {n} is out of range (at least 0)")
    if plan.lend_nodes is not None and plan.lend_nodes > plan.nodes:
        raise UserError(f"--lend-nodes: {plan.lend_nodes} is more than the team's {plan.nodes}")
    for name, _ in plan.priorities:
        if not _DNS_LABEL.match(name):
            raise UserError(f"--priority: {name!r} is not a Kubernetes name (lowercase letters, digits and '-')")


def team_objects(plan: TeamPlan, per_node: dict[str, str | int]) -> list[dict[str, Any]]:
    """What a team needs in Kueue, named as HyperPod task governance names them (so `job init --team`
    and `cluster check --team` find them on EKS too): its namespace, a ResourceFlavor for the
    instance type (its nodes by label), the team's ClusterQueue covering every resource the job's
    pods request (`per_node`: one node's cpu, memory, GPUs, EFA; a request the queue does not cover
    would leave the job inadmissible), its LocalQueue, and the WorkloadPriorityClasses. Lent quota is
    reclaimed when the team needs it (reclaimWithinCohort), and a higher priority preempts a lower."""
    check_team(plan)
    ns = TEAM_NAMESPACE.format(team=plan.team)
    api = f"{GROUP}/{VERSIONS[0]}"
    labels = {"app.kubernetes.io/managed-by": "fsdpkit"}
    cq_name = f"{ns}-clusterqueue"

    resources = []
    for name, value in per_node.items():
        r: dict[str, Any] = {"name": name, "nominalQuota": str(_times(value, plan.nodes))}
        if plan.cohort and plan.borrow_nodes is not None:
            r["borrowingLimit"] = str(_times(value, plan.borrow_nodes))
        if plan.cohort and plan.lend_nodes is not None:
            r["lendingLimit"] = str(_times(value, plan.lend_nodes))
        resources.append(r)
    cq_spec: dict[str, Any] = {
        "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": ns}},
        "queueingStrategy": "BestEffortFIFO",
        "resourceGroups": [{"coveredResources": list(per_node), "flavors": [{"name": plan.instance_type,
                                                                              "resources": resources}]}],
        "preemption": {"withinClusterQueue": "LowerPriority", "reclaimWithinCohort": "Any"},
    }
    if plan.cohort:
        cq_spec["cohortName"] = plan.cohort
    objs: list[dict[str, Any]] = [
        {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": ns, "labels": labels}},
        {"apiVersion": api, "kind": "ResourceFlavor", "metadata": {"name": plan.instance_type, "labels": labels},
         "spec": {"nodeLabels": {"node.kubernetes.io/instance-type": plan.instance_type}}},
        {"apiVersion": api, "kind": "ClusterQueue", "metadata": {"name": cq_name, "labels": labels}, "spec": cq_spec},
        {"apiVersion": api, "kind": "LocalQueue",
         "metadata": {"name": TEAM_QUEUE.format(team=plan.team), "namespace": ns, "labels": labels},
         "spec": {"clusterQueue": cq_name}},
    ]
    objs += [{"apiVersion": api, "kind": "WorkloadPriorityClass", "metadata": {"name": name, "labels": labels},
              "value": value, "description": f"fsdpkit: {name}"} for name, value in plan.priorities]
    return objs


def _times(value: str | int, n: int) -> str | int:
    """A per-node quantity times n nodes: integers stay integers, `2048Gi` stays in Gi."""
    if isinstance(value, int):
        return value * n
    digits = value.rstrip("KMGTPEi")
    return f"{int(digits) * n}{value[len(digits):]}"
