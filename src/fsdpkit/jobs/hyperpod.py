"""SageMaker HyperPod (EKS orchestrator) on top of the PyTorchJob: schedule only on nodes HyperPod
marks healthy, prefer (or require) nodes that passed the deep health check, pick an instance group,
and let HyperPod's job auto-resume restart the job after it replaces a faulty node. Or, where the
user asks, the HyperPod training operator's own `HyperPodPyTorchJob` kind."""

from __future__ import annotations

import copy
from typing import Any

from fsdpkit.jobs import manifests as m
from fsdpkit.jobs.command import trainer_flags
from fsdpkit.jobs.spec import JobSpec

HEALTH = "sagemaker.amazonaws.com/node-health-status"
DEEP_HEALTH = "sagemaker.amazonaws.com/deep-health-check-status"
INSTANCE_GROUP = "sagemaker.amazonaws.com/instance-group-name"
AUTO_RESUME = "sagemaker.amazonaws.com/enable-job-auto-resume"
MAX_RETRY = "sagemaker.amazonaws.com/job-max-retry-count"


def _with_required(affinity: dict[str, Any], expr: dict[str, Any]) -> None:
    """AND `expr` into every required node-selector term (terms are ORed, expressions ANDed)."""
    node = affinity.setdefault("nodeAffinity", {})
    required = node.setdefault("requiredDuringSchedulingIgnoredDuringExecution", {})
    terms = required.setdefault("nodeSelectorTerms", [])
    if not terms:
        terms.append({"matchExpressions": []})
    for term in terms:
        term.setdefault("matchExpressions", []).append(expr)


def health_affinity(spec: JobSpec) -> dict[str, Any]:
    affinity = copy.deepcopy(spec.affinity)
    _with_required(affinity, {"key": HEALTH, "operator": "In", "values": ["Schedulable"]})
    deep = {"key": DEEP_HEALTH, "operator": "In", "values": ["Passed"]}
    if spec.hyperpod.deep_health_check == "required":
        _with_required(affinity, deep)
    elif spec.hyperpod.deep_health_check == "preferred":
        preferred = affinity["nodeAffinity"].setdefault("preferredDuringSchedulingIgnoredDuringExecution", [])
        preferred.append({"weight": 100, "preference": {"matchExpressions": [deep]}})
    return affinity


def _adapt_pod(spec: JobSpec, template: dict[str, Any]) -> None:
    pod = template["spec"]
    pod["affinity"] = health_affinity(spec)
    if spec.hyperpod.instance_group:
        pod.setdefault("nodeSelector", {})[INSTANCE_GROUP] = spec.hyperpod.instance_group


def pytorchjob_manifest(spec: JobSpec) -> dict[str, Any]:
    job = m.pytorchjob_manifest(spec)
    if spec.hyperpod.auto_resume:
        job["metadata"]["annotations"].update({AUTO_RESUME: "true", MAX_RETRY: str(spec.hyperpod.max_retry)})
    for replica in job["spec"]["pytorchReplicaSpecs"].values():
        _adapt_pod(spec, replica["template"])
    return job


def hyperpod_job_command(spec: JobSpec, root: str | None) -> list[str]:
    """HyperPod's training operator starts workers through its elastic agent, `hyperpodrun`
    (pip package hyperpod-elastic-agent), which takes torchrun's place and reports to the operator."""
    if spec.command is not None:
        return list(spec.command)
    return ["hyperpodrun", f"--nnodes={spec.nodes}", f"--nproc-per-node={spec.procs}",
            "--server-host=0.0.0.0", "--server-port=8080", "--tee=3", "--log_dir=/tmp/hyperpod",
            "-m", "fsdpkit.train", *trainer_flags(spec, root)]


def hyperpod_job_manifest(spec: JobSpec) -> dict[str, Any]:
    _, hi = spec.nodes
    root = spec.storage.root
    template = m.pod_template(spec, hyperpod_job_command(spec, root))
    _adapt_pod(spec, template)
    return {
        "apiVersion": "sagemaker.amazonaws.com/v1", "kind": "HyperPodPyTorchJob",
        "metadata": {"name": spec.name, "namespace": spec.namespace, "labels": m.labels(spec),
                     "annotations": {m.ATTEMPT: "0", m.MAX_RESUBMITS: str(spec.resubmits)}},
        "spec": {
            "nprocPerNode": str(spec.procs),
            "replicaSpecs": [{"name": "pod", "replicas": hi, "template": template}],
            "runPolicy": {"cleanPodPolicy": "None", "jobMaxRetryCount": spec.hyperpod.max_retry},
        },
    }


def render(spec: JobSpec) -> list[dict[str, Any]]:
    objs = [o for o in m.render(spec) if o["kind"] != "PyTorchJob"]
    job = hyperpod_job_manifest(spec) if spec.hyperpod.kind == "HyperPodPyTorchJob" else pytorchjob_manifest(spec)
    return [*objs, job]
