"""Kubernetes manifests rendered from a JobSpec: Secret, PVC, the pod template and the Kubeflow
PyTorchJob. Plain dicts, so they can be printed, validated against the CRD schemas and sent with
the official client unchanged. No secret value is ever placed in a manifest: the HF token Secret
is rendered with a placeholder and filled in only by `submit`, from the user's environment."""

from __future__ import annotations

import copy
from typing import Any

from fsdpkit.cluster import pod_rules
from fsdpkit.jobs import devices
from fsdpkit.jobs.command import node_command, node_env
from fsdpkit.jobs.resolved import ResolvedJob
from fsdpkit.jobs.spec import JobSpec, require_image

MANAGED_BY = {"app.kubernetes.io/managed-by": "fsdpkit"}
JOB_LABEL = "fsdpkit.dev/job"
ATTEMPT = "fsdpkit.dev/attempt"
MAX_RESUBMITS = "fsdpkit.dev/max-resubmits"
# Labels the Kubeflow training operator puts on the pods of a job.
KF_JOB_NAME = "training.kubeflow.org/job-name"
KF_REPLICA_TYPE = "training.kubeflow.org/replica-type"
KF_REPLICA_INDEX = "training.kubeflow.org/replica-index"
HF_TOKEN_KEY = "token"
SECRET_PLACEHOLDER = "<set at submit from ${env}>"
CONTAINER = "pytorch"  # the training operator finds the container by this name


# Karpenter never takes a node a pod so marked runs on (consolidation, drift): a training pod's node
# stays until the pod is gone, whatever NodePool made it.
DO_NOT_DISRUPT = "karpenter.sh/do-not-disrupt"
KUEUE_QUEUE = "kueue.x-k8s.io/queue-name"
KUEUE_PRIORITY = "kueue.x-k8s.io/priority-class"   # names a WorkloadPriorityClass, not a PriorityClass


def labels(spec: JobSpec) -> dict[str, str]:
    """fsdpkit's labels, and Kueue's where a queue is named: the queue, and the priority the way
    Kueue reads it (on the job and on its pods, as the HyperPod CLI sets them)."""
    out = {**MANAGED_BY, JOB_LABEL: spec.name}
    if spec.queue:
        out[KUEUE_QUEUE] = spec.queue
        if spec.priority_class:
            out[KUEUE_PRIORITY] = spec.priority_class
    return out


def pod_priority(spec: JobSpec) -> str | None:
    """The pods' priorityClassName: the spec's priority unless Kueue orders the queue by it (then it
    names a WorkloadPriorityClass, which the Priority admission plugin would not find)."""
    return spec.priority_class if not spec.queue else None


def security_context(spec: JobSpec) -> tuple[dict[str, Any] | None, dict[str, Any]]:
    """(the pod's, the container's) securityContext for the spec's Pod Security level. Baseline: no
    privilege escalation, nothing else taken from what training needs (the image's user, its
    capabilities: EFA and NCCL need none beyond the runtime's defaults). Restricted: also no root,
    every capability dropped, the runtime's seccomp profile; fsGroup so the checkpoint volume is
    writable by that user."""
    container: dict[str, Any] = {"allowPrivilegeEscalation": False}
    if spec.security != "restricted":
        return None, container
    uid = spec.run_as_user
    pod = {"runAsNonRoot": True, "runAsUser": uid, "runAsGroup": uid, "fsGroup": uid,
           "seccompProfile": {"type": "RuntimeDefault"}}
    return pod, {**container, "capabilities": {"drop": ["ALL"]}}


def secret_manifest(spec: JobSpec, value: str | None = None) -> dict[str, Any]:
    """The Secret holding the HF token; `value` only at submit time, a placeholder otherwise."""
    return {
        "apiVersion": "v1", "kind": "Secret", "type": "Opaque",
        "metadata": {"name": spec.hf_secret_name, "namespace": spec.namespace, "labels": labels(spec)},
        "stringData": {HF_TOKEN_KEY: value if value is not None else SECRET_PLACEHOLDER.format(env=spec.hf_token_env)},
    }


def pvc_manifest(spec: JobSpec) -> dict[str, Any]:
    return {
        "apiVersion": "v1", "kind": "PersistentVolumeClaim",
        "metadata": {"name": spec.created_claim, "namespace": spec.namespace, "labels": labels(spec)},
        "spec": {
            "accessModes": [spec.storage.access_mode],
            "storageClassName": spec.storage.storage_class,
            "resources": {"requests": {"storage": spec.storage.size}},
        },
    }


def env_list(spec: JobSpec) -> list[dict[str, Any]]:
    env = node_env(spec)
    if spec.security == "restricted":
        env.setdefault("HOME", "/tmp")  # the image's HOME is root's, which run_as_user cannot write
    out: list[dict[str, Any]] = [{"name": k, "value": str(v)} for k, v in env.items()]
    if spec.hf_token_env:
        out.append({"name": "HF_TOKEN",
                    "valueFrom": {"secretKeyRef": {"name": spec.hf_secret_name, "key": HF_TOKEN_KEY}}})
    out += [{"name": r.env, "valueFrom": {"secretKeyRef": {"name": r.secret, "key": r.key}}} for r in spec.secrets]
    return out


def resources(spec: JobSpec, dra: bool = False) -> dict[str, Any]:
    """Extended resources (GPUs, EFA) must have requests == limits; with `dra` the devices come
    from the pod's claim instead, named in `claims`. cpu and memory are requested (the spec's, else
    the pod's share of the instance); a memory the spec gives is the limit too, so a runaway
    process is killed by its own cgroup rather than starving the node; CPU is not limited
    (throttling the data loader costs more than it saves)."""
    requests: dict[str, Any] = {}
    limits: dict[str, Any] = {}
    if spec.gpus and not dra:
        requests[spec.accelerator_resource] = limits[spec.accelerator_resource] = spec.gpus
    if spec.efa and not dra:
        requests[devices.EFA_RESOURCE] = limits[devices.EFA_RESOURCE] = spec.efa
    if spec.cpu_request:
        requests["cpu"] = spec.cpu_request
    if spec.memory_request:
        requests["memory"] = spec.memory_request
    if spec.memory:
        limits["memory"] = spec.memory
    out: dict[str, Any] = {k: v for k, v in (("requests", requests), ("limits", limits)) if v}
    if dra:
        out["claims"] = [{"name": devices.CLAIM}]
    return out


def pod_template(job: ResolvedJob, command: list[str] | None, container: str = CONTAINER) -> dict[str, Any]:
    """The pod every replica runs; `command` None keeps the image's (KubeRay injects `ray start`)."""
    spec = job.spec
    mounts = [{"name": "dshm", "mountPath": "/dev/shm"}]
    # /dev/shm is 64 MB in a container by default; NCCL and data loaders need far more.
    volumes: list[dict[str, Any]] = [{"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": spec.shm_size}}]
    if spec.claim_name:
        mounts.append({"name": "checkpoints", "mountPath": spec.storage.mount_path})
        volumes.append({"name": "checkpoints", "persistentVolumeClaim": {"claimName": spec.claim_name}})
    image = require_image(spec)
    container_spec: dict[str, Any] = {
        "name": container, "image": image, "imagePullPolicy": pull_policy(image),
        "env": env_list(spec), "volumeMounts": mounts,
    }
    if command is not None:
        container_spec["command"] = command
    dra = job.devices.mode == "dra"
    res = resources(spec, dra)
    if res:
        container_spec["resources"] = res
    pod_security, container_spec["securityContext"] = security_context(spec)
    pod: dict[str, Any] = {"containers": [container_spec], "volumes": volumes}
    if dra:
        pod["resourceClaims"] = devices.pod_claims(spec)
    if pod_security:
        pod["securityContext"] = pod_security
    if job.grace_seconds is not None:
        pod["terminationGracePeriodSeconds"] = job.grace_seconds
    pod.update(placement(spec))
    if priority := pod_priority(spec):
        pod["priorityClassName"] = priority
    meta: dict[str, Any] = {"labels": labels(spec), "annotations": {DO_NOT_DISRUPT: "true"}}
    if spec.placement == "topology":
        meta["annotations"].update(spec.topology.annotations)
    return {"metadata": meta, "spec": pod}


def placement(spec: JobSpec) -> dict[str, Any]:
    """The pod's nodeSelector, tolerations and affinity, where the spec has any."""
    out: dict[str, Any] = {}
    node_selector = dict(spec.node_selector)
    if spec.instance_type:
        node_selector.setdefault("node.kubernetes.io/instance-type", spec.instance_type)
    if node_selector:
        out["nodeSelector"] = node_selector
    tolerations = list(spec.tolerations)
    if spec.gpus and not any(t.get("key") == spec.accelerator_resource for t in tolerations):
        # GPU node groups are commonly tainted so that only GPU pods land there.
        tolerations.append({"key": spec.accelerator_resource, "operator": "Exists", "effect": "NoSchedule"})
    if tolerations:
        out["tolerations"] = tolerations
    if spec.affinity:
        out["affinity"] = spec.affinity
    return out


def pull_policy(image: str | None) -> str:
    """A digest never changes: the node's copy is right. A tag can be pushed again (`:latest`, or a
    retag), so the node must ask the registry each time, or keep running the old image."""
    return "IfNotPresent" if image and "@sha256:" in image else "Always"


def rdzv_endpoint(spec: JobSpec) -> str:
    """The c10d store lives on the first pod: Master-0 of a fixed job, Worker-0 of an elastic one
    (the operator gives each replica a Service of that name)."""
    return f"{spec.name}-{'worker' if spec.nodes.elastic else 'master'}-0:{spec.rdzv_port}"


def pytorchjob_manifest(job: ResolvedJob) -> dict[str, Any]:
    spec = job.spec
    lo, hi = spec.nodes
    template = pod_template(job, node_command(job, rdzv_endpoint(spec), spec.name))
    job_spec: dict[str, Any] = {"runPolicy": {
        "backoffLimit": spec.backoff_limit,
        # Keep finished pods, so `fsdpkit job logs --previous` can still read them; the TTL cleans up.
        "cleanPodPolicy": "None",
    }}
    if spec.ttl_after_finished is not None:
        job_spec["runPolicy"]["ttlSecondsAfterFinished"] = spec.ttl_after_finished
    if priority := pod_priority(spec):
        job_spec["runPolicy"]["schedulingPolicy"] = {"priorityClass": priority}
    if spec.nodes.elastic:
        job_spec["elasticPolicy"] = {
            "rdzvBackend": "c10d", "rdzvPort": spec.rdzv_port, "rdzvId": spec.name,
            "minReplicas": lo, "maxReplicas": hi, "maxRestarts": spec.max_restarts, "nProcPerNode": spec.procs,
        }
        replicas = {"Worker": {"replicas": hi, "restartPolicy": "OnFailure", "template": template}}
    else:
        job_spec["nprocPerNode"] = str(spec.procs)
        replicas = {"Master": {"replicas": 1, "restartPolicy": "OnFailure", "template": template}}
        if lo > 1:
            replicas["Worker"] = {"replicas": lo - 1, "restartPolicy": "OnFailure", "template": copy.deepcopy(template)}
    job_spec["pytorchReplicaSpecs"] = replicas
    return {
        "apiVersion": "kubeflow.org/v1", "kind": "PyTorchJob",
        "metadata": {
            "name": spec.name, "namespace": spec.namespace, "labels": labels(spec),
            "annotations": {ATTEMPT: "0", MAX_RESUBMITS: str(spec.resubmits)},
        },
        "spec": job_spec,
    }


def support_objects(job: ResolvedJob) -> list[dict[str, Any]]:
    """What every Kubernetes job of the spec needs before the job itself: its HF token Secret, the
    PVC fsdpkit creates for it, and with DRA the template its pods' device claims are made from."""
    spec = job.spec
    objs = []
    if spec.hf_secret_name:
        objs.append(secret_manifest(spec))
    if spec.created_claim:
        objs.append(pvc_manifest(spec))
    if job.devices.mode == "dra":
        objs.append(devices.claim_template(spec, labels(spec)))
    return objs


def render(job: ResolvedJob) -> list[dict[str, Any]]:
    """Everything `submit` creates, in creation order (the job last, so its volumes exist); pods
    the API server would refuse are refused here."""
    return pod_rules.check_objects([*support_objects(job), pytorchjob_manifest(job)])
