"""Kubeflow Trainer v2: a TrainJob on a ClusterTrainingRuntime, with a JobSet underneath.

Every per-job value goes into the TrainJob itself: the image, command, node count and resources in
`trainer`, and the rest of fsdpkit's pod (shared memory, the checkpoint volume, node selection,
tolerations, the grace period a checkpoint needs) as a runtime patch. So a job runs as well on the
cluster's own `torch-distributed` runtime as on `fsdpkit-torch` (fsdpkit.cluster.trainer), which
adds only what a job cannot patch."""

from __future__ import annotations

from typing import Any

from fsdpkit.cluster import pod_rules
from fsdpkit.cluster.trainer import API_VERSION, GROUP, NODE, runtime_manifest
from fsdpkit.jobs import devices
from fsdpkit.jobs import manifests as m
from fsdpkit.jobs.command import node_command
from fsdpkit.jobs.resolved import ResolvedJob
from fsdpkit.jobs.spec import JobSpec

PATCH_MANAGER = "fsdpkit.dev/job"  # who owns the runtime patch (the list is keyed by manager)
# The only pod fields a runtime patch may set that fsdpkit's pod template uses.
_PATCHABLE = ("volumes", "nodeSelector", "tolerations", "affinity", "terminationGracePeriodSeconds",
              "securityContext")


# The kubelet's --cluster-domain (EKS's, and Kubernetes' default).
CLUSTER_DOMAIN = "cluster.local"


def rdzv_endpoint(spec: JobSpec) -> str:
    """The first pod by its full name under JobSet's headless Service. The kubelet writes that name
    into the pod's own /etc/hosts, so node 0 knows itself as the rendezvous host (torch's
    `_matches_machine_hostname`) before cluster DNS has its record; `NAME-node-0-0.NAME` alone
    resolves only through DNS, and a node 0 that starts first would not host the store."""
    return f"{spec.name}-{NODE}-0-0.{spec.name}.{spec.namespace}.svc.{CLUSTER_DOMAIN}:{spec.rdzv_port}"


def trainjob_labels(spec: JobSpec) -> dict[str, str]:
    out = m.labels(spec)
    if spec.priority_class:  # a TrainJob's pods take no priorityClassName; Kueue's workload priority does it
        out[m.KUEUE_PRIORITY] = spec.priority_class
    return out


def device_runtime(job: ResolvedJob) -> dict[str, Any]:
    """With DRA, the job's own TrainingRuntime, fsdpkit-torch's shape with the pods' device claims:
    a runtime patch has no resourceClaims field (Trainer v2.3), and a claim template is namespaced,
    so the pod that names it comes from a runtime in the job's namespace."""
    spec = job.spec
    return runtime_manifest(spec.image or "", namespace=spec.namespace, name=devices.claim_template_name(spec),
                            pod={"resourceClaims": devices.pod_claims(spec)}, labels=m.labels(spec))


def trainjob_manifest(job: ResolvedJob) -> dict[str, Any]:
    spec = job.spec
    pod = m.pod_template(job, node_command(job, rdzv_endpoint(spec), spec.name), container=NODE)
    container = pod["spec"]["containers"][0]
    trainer: dict[str, Any] = {"image": spec.image, "command": container["command"], "numNodes": spec.nodes.max,
                               "numProcPerNode": spec.procs, "env": container["env"]}
    if "resources" in container:
        trainer["resourcesPerNode"] = container["resources"]
    pod_patch = {k: v for k, v in pod["spec"].items() if k in _PATCHABLE}
    pod_patch["containers"] = [{"name": NODE, "volumeMounts": container["volumeMounts"],
                                "securityContext": container["securityContext"]}]
    node_patch = {"name": NODE, "template": {"metadata": {"labels": m.labels(spec)}, "spec": {
        "template": {"metadata": pod["metadata"], "spec": pod_patch}}}}
    return {
        "apiVersion": API_VERSION, "kind": "TrainJob",
        "metadata": {"name": spec.name, "namespace": spec.namespace, "labels": trainjob_labels(spec),
                     "annotations": {m.ATTEMPT: "0", m.MAX_RESUBMITS: str(spec.resubmits)}},
        "spec": {
            "runtimeRef": {"name": devices.claim_template_name(spec), "kind": "TrainingRuntime", "apiGroup": GROUP}
            if job.devices.mode == "dra" else
            {"name": spec.trainjob.runtime, "kind": "ClusterTrainingRuntime", "apiGroup": GROUP},
            "trainer": trainer,
            "runtimePatches": [{"manager": PATCH_MANAGER, "trainingRuntimeSpec": {
                "template": {"spec": {"replicatedJobs": [node_patch]}}}}],
        },
    }


def render(job: ResolvedJob) -> list[dict[str, Any]]:
    """Secret, PVC and claim template as for every Kubernetes job, with DRA the job's runtime, then
    the TrainJob."""
    runtime = [device_runtime(job)] if job.devices.mode == "dra" else []
    return pod_rules.check_objects([*m.support_objects(job), *runtime, trainjob_manifest(job)])
