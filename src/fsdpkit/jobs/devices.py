"""How a job's pods ask for GPUs and EFA: the device plugins' extended resources (`nvidia.com/gpu`,
`vpc.amazonaws.com/efa`, integer counts), or Dynamic Resource Allocation (resource.k8s.io/v1): one
ResourceClaimTemplate per job, each pod's claim made from it, against the DeviceClasses of NVIDIA's
DRA driver and AWS's EFA DRA driver.

What DRA says that a count cannot: which EFA interfaces go with which GPU. On a p5 each GPU shares
its PCIe root with four of the 32 EFA interfaces; the claim asks for eight such groups, each a GPU
and its interfaces constrained to one `resource.kubernetes.io/pcieRoot`, so NCCL's traffic for a GPU
leaves through the NICs beside it. The choice is one rule (`choose`), fed by what the cluster
offers (`DraOffer`, read by `job submit`); `job render` reads no cluster and says so."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from fsdpkit.errors import UserError
from fsdpkit.jobs.spec import CLUSTER_BACKENDS, JobSpec

API_VERSION = "resource.k8s.io/v1"
GPU_CLASS = "gpu.nvidia.com"           # the DeviceClass NVIDIA's DRA driver installs
EFA_CLASS = "efa.networking.k8s.aws"   # the DeviceClass AWS's EFA DRA driver (aws-dranet) installs
PCIE_ROOT = "resource.kubernetes.io/pcieRoot"
CLAIM = "devices"                      # the pod's name for its claim, and its container's
EFA_RESOURCE = "vpc.amazonaws.com/efa"
NOT_READ = "no cluster read: `job submit` asks the cluster whether it offers DRA"


@dataclass(frozen=True)
class DraOffer:
    """What a cluster offers for DRA, from discovery and its DeviceClasses: whether it serves
    resource.k8s.io/v1, the DeviceClass names, or why they could not be read."""

    served: bool
    classes: frozenset[str] = frozenset()
    unread: str | None = None

    def lacks(self, spec: JobSpec) -> str | None:
        """What the spec's devices need and this cluster does not offer; None when it has it all."""
        if not self.served:
            return "the cluster does not serve resource.k8s.io/v1 (Kubernetes 1.34 or later)"
        if self.unread:
            return f"its DeviceClasses could not be read ({self.unread})"
        wanted = [GPU_CLASS] + ([EFA_CLASS] if spec.efa else [])
        missing = [c for c in wanted if c not in self.classes]
        if missing:
            return f"it has no DeviceClass {', '.join(missing)} (" + \
                ", ".join(_DRIVERS[c] for c in missing) + " installs it)"
        return None


_DRIVERS = {GPU_CLASS: "NVIDIA's DRA driver", EFA_CLASS: "AWS's EFA DRA driver, aws-dranet"}


@dataclass(frozen=True)
class DeviceChoice:
    mode: str      # "dra" | "extended"
    why: str


def _decided_without_cluster(spec: JobSpec) -> DeviceChoice | None:
    """Under devices auto, the answers no cluster can change: no GPUs, no NVIDIA driver, a queue."""
    if spec.backend not in CLUSTER_BACKENDS or not spec.gpus:
        return DeviceChoice("extended", "no GPUs asked for on Kubernetes")
    if spec.accelerator_resource != "nvidia.com/gpu":
        return DeviceChoice("extended", f"{spec.accelerator_resource} has no DRA driver fsdpkit asks for")
    if spec.queue:
        return DeviceChoice("extended", "Kueue counts the queue's quota in nvidia.com/gpu; it counts DRA devices "
                                        "only when configured to (deviceClassMappings)")
    return None


def asks_cluster(spec: JobSpec) -> bool:
    """Whether the choice depends on what the cluster offers (so `job submit` reads its DRA offer)."""
    return spec.devices == "dra" or (spec.devices == "auto" and _decided_without_cluster(spec) is None)


def choose(spec: JobSpec, offer: DraOffer | None) -> DeviceChoice:
    """The one rule for how the pods ask for devices. `offer` None: no cluster was asked (job
    render, plan). `devices: dra` on a cluster without it is refused, naming what is missing."""
    if spec.devices == "extended":
        return DeviceChoice("extended", "given (devices: extended)")
    if spec.devices == "dra":
        if offer is not None and offer.unread:   # a namespace user: the drivers are the spec's word
            return DeviceChoice("dra", f"given (devices: dra); not checked: {offer.lacks(spec)}")
        if offer is not None and (missing := offer.lacks(spec)):
            raise UserError(f"devices: dra, but {missing}; install it, or set devices: extended")
        return DeviceChoice("dra", "given (devices: dra)" + ("" if offer else "; not checked against a cluster"))
    if decided := _decided_without_cluster(spec):
        return decided
    if offer is None:
        return DeviceChoice("extended", NOT_READ)
    if missing := offer.lacks(spec):
        return DeviceChoice("extended", missing + ("; set devices: dra where the cluster has the drivers"
                                                   if offer.unread else ""))
    classes = GPU_CLASS + (f" and {EFA_CLASS}" if spec.efa else "")
    return DeviceChoice("dra", f"the cluster serves resource.k8s.io/v1 with DeviceClass {classes}")


def claim_template_name(spec: JobSpec) -> str:
    return f"{spec.name}-devices"


def device_requests(spec: JobSpec) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(requests, constraints) of one node's claim. Where the instance's GPUs and EFA interfaces
    split into equal groups (p5: 8 of 1 GPU + 4 EFA; p4d: 4 of 2 GPUs + 1 EFA) and the job takes
    whole groups, each group is a GPU request and an EFA request bound to one PCIe root; otherwise
    (no EFA, a g6.48xlarge's 8 GPUs and one EFA, a part of a node) one request of each."""
    gpus, efa, inst = spec.gpus, spec.efa, spec.instance

    def request(name: str, cls: str, count: int) -> dict[str, Any]:
        return {"name": name, "exactly": {"deviceClassName": cls, "count": count}}

    if inst and efa and inst.accelerators and inst.efa:
        groups = math.gcd(inst.accelerators, inst.efa)
        per_gpu, per_efa = inst.accelerators // groups, inst.efa // groups
        taken = gpus // per_gpu
        if groups > 1 and gpus % per_gpu == 0 and efa == taken * per_efa:
            requests, constraints = [], []
            for i in range(taken):
                requests += [request(f"gpu-{i}", GPU_CLASS, per_gpu), request(f"efa-{i}", EFA_CLASS, per_efa)]
                constraints.append({"requests": [f"gpu-{i}", f"efa-{i}"], "matchAttribute": PCIE_ROOT})
            return requests, constraints
    requests = [request("gpu", GPU_CLASS, gpus)] + ([request("efa", EFA_CLASS, efa)] if efa else [])
    return requests, []


def claim_template(spec: JobSpec, labels: dict[str, str]) -> dict[str, Any]:
    """The job's ResourceClaimTemplate: each pod gets a claim of its own made from it."""
    requests, constraints = device_requests(spec)
    devices: dict[str, Any] = {"requests": requests}
    if constraints:
        devices["constraints"] = constraints
    return {"apiVersion": API_VERSION, "kind": "ResourceClaimTemplate",
            "metadata": {"name": claim_template_name(spec), "namespace": spec.namespace, "labels": labels},
            "spec": {"spec": {"devices": devices}}}


def pod_claims(spec: JobSpec) -> list[dict[str, str]]:
    """The pod's resourceClaims entry naming the job's template."""
    return [{"name": CLAIM, "resourceClaimTemplateName": claim_template_name(spec)}]
