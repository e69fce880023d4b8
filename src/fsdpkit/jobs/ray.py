"""KubeRay: a RayCluster (a CPU head plus one GPU worker group, EFA and /dev/shm like a training
pod) and RayJobs, rendered from the same JobSpec. `create` reuses a cluster of the same spec instead of
failing or creating a second one, and refuses one of that name made from a different spec; `delete`
removes the RayJobs `submit` made on it, then the cluster.

Ray workers run other programs than fsdpkit's trainer, vLLM among them (VERL's rollouts): they get
no `expandable_segments` allocator setting, which vLLM's sleep mode (on in VERL by default) asserts
is absent."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import shlex
from typing import Any, cast

from fsdpkit.cluster import pod_rules
from fsdpkit.cluster.client import ClusterError, api_errors, is_not_found, label_selector, labels_match
from fsdpkit.cluster.pods import dry_run_pods
from fsdpkit.errors import Conflict, NotFound, TimedOut, UserError
from fsdpkit.jobs import manifests as m
from fsdpkit.jobs.command import GPU_ENV
from fsdpkit.jobs.hyperpod import adapt_pod
from fsdpkit.jobs.resolved import ResolvedJob
from fsdpkit.jobs.spec import JobSpec
from fsdpkit.polling import wait_saying

log = logging.getLogger(__name__)

GROUP, VERSION = "ray.io", "v1"
SPEC_HASH = "fsdpkit.dev/spec-hash"
RAY_VERSION = "2.40.0"
CLUSTER_LABEL = "ray.io/cluster"
ALLOCATOR = "PYTORCH_CUDA_ALLOC_CONF"


def _without_allocator_setting(spec: JobSpec, template: dict[str, Any]) -> None:
    """Drop fsdpkit's own allocator setting from a Ray pod (a value the spec's env gives is kept)."""
    if ALLOCATOR in spec.env:
        return
    container = template["spec"]["containers"][0]
    container["env"] = [e for e in container["env"] if not (e["name"] == ALLOCATOR and e.get("value") ==
                                                            GPU_ENV[ALLOCATOR])]


def _head_spec(spec: JobSpec) -> JobSpec:
    """The head schedules and coordinates: no GPUs or EFA, and not pinned to a GPU instance type."""
    return spec.model_copy(update={"instance_type": None, "gpus_per_node": 0, "efa_per_node": 0,
                                   "cpu": spec.cpu or "4", "memory": spec.memory or "16Gi"})


def raycluster_manifest(job: ResolvedJob) -> dict[str, Any]:
    spec = job.spec
    lo, hi = spec.nodes
    head = m.pod_template(dataclasses.replace(job, spec=_head_spec(spec)), None, container="ray-head")
    head["spec"]["containers"][0]["ports"] = [
        {"containerPort": 6379, "name": "gcs"}, {"containerPort": 8265, "name": "dashboard"},
        {"containerPort": 10001, "name": "client"}]
    worker = m.pod_template(job, None, container="ray-worker")
    _without_allocator_setting(spec, worker)
    if spec.backend == "hyperpod":  # the same node-health rules as HyperPod's jobs; the CPU head in any group
        adapt_pod(spec, head, instance_group=False)
        adapt_pod(spec, worker)
    # KubeRay requires every rayStartParams value to be a string (a bare 8080 is rejected).
    head_params = {"dashboard-host": "0.0.0.0", "metrics-export-port": "8080", "num-gpus": "0"}
    worker_params = {"metrics-export-port": "8080", "num-gpus": str(spec.gpus)}
    obj: dict[str, Any] = {
        "apiVersion": f"{GROUP}/{VERSION}", "kind": "RayCluster",
        "metadata": {"name": spec.name, "namespace": spec.namespace, "labels": m.labels(spec)},
        "spec": {
            "rayVersion": RAY_VERSION,
            "headGroupSpec": {"rayStartParams": head_params, "template": head},
            "workerGroupSpecs": [{
                "groupName": "gpu", "replicas": lo, "minReplicas": lo, "maxReplicas": hi,
                "rayStartParams": worker_params, "template": worker,
            }],
        },
    }
    obj["metadata"]["annotations"] = {SPEC_HASH: spec_hash(obj)}
    pod_rules.check_objects([obj])
    return obj


def spec_hash(obj: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(obj["spec"], sort_keys=True).encode()).hexdigest()[:16]


# VERL's resource pool (trainer.nnodes x trainer.n_gpus_per_node) and its batch (the prompts a step,
# each sampled rollout.n times), with their defaults (VERL 0.5's ppo_trainer.yaml).
VERL_GPUS = {"trainer.nnodes": 1, "trainer.n_gpus_per_node": 8}
VERL_BATCH = {"data.train_batch_size": 1024, "actor_rollout_ref.rollout.n": 1}


def worker_gpus(cluster: dict[str, Any]) -> list[tuple[int, int]]:
    """(replicas, GPUs each) of a RayCluster's worker groups, as Ray counts them (num-gpus)."""
    groups = (cluster.get("spec") or {}).get("workerGroupSpecs") or []
    return [(int(g.get("replicas") or 0), int(float((g.get("rayStartParams") or {}).get("num-gpus") or 0)))
            for g in groups]


def check_verl_gpus(entrypoint: str, cluster: str, workers: list[tuple[int, int]]) -> str | None:
    """A VERL entrypoint's GPUs against the RayCluster's workers: more than they hold, or more a node
    than a worker has, is refused (VERL would wait for its placement group for ever); fewer is the
    warning returned. None for an entrypoint that names neither setting."""
    given = {}
    for word in shlex.split(entrypoint):
        key, _, value = word.lstrip("+").partition("=")
        if key in VERL_GPUS or key in VERL_BATCH:
            if not value.isdigit() or int(value) < 1:
                raise UserError(f"ray submit: {key}={value} is not a count of 1 or more")
            given[key] = int(value)
    if not given.keys() & VERL_GPUS.keys():
        return None
    nnodes, per_node = (given.get(k, default) for k, default in VERL_GPUS.items())
    prompts, samples = (given.get(k, default) for k, default in VERL_BATCH.items())
    if prompts * samples % (nnodes * per_node):
        # VERL's own first check (RayPPOTrainer._validate_config, FSDP workers), which it makes only
        # once the job's pods are up.
        raise UserError(f"ray submit: VERL refuses data.train_batch_size x rollout.n = {prompts} x {samples} = "
                        f"{prompts * samples} sequences a step over {nnodes * per_node} GPUs: real_train_batch_size "
                        f"({prompts * samples}) must be divisible by minimal possible batch size "
                        f"({nnodes * per_node})")
    total, widest = sum(n * g for n, g in workers), max((g for n, g in workers if n), default=0)
    held = " + ".join(f"{n} worker(s) x {g} GPUs" for n, g in workers) or "no workers"
    fix = f"set trainer.nnodes and trainer.n_gpus_per_node to fit RayCluster {cluster}'s workers ({held})"
    if per_node > widest:
        raise UserError(f"ray submit: VERL asks trainer.n_gpus_per_node={per_node}, and no worker of RayCluster "
                        f"{cluster} has more than {widest} GPUs; {fix}")
    if nnodes * per_node > total:
        raise UserError(f"ray submit: VERL asks {nnodes} x {per_node} = {nnodes * per_node} GPUs, and RayCluster "
                        f"{cluster}'s workers hold {total}: it would wait for them for ever; {fix}")
    if nnodes * per_node < total:
        return f"ray submit: VERL uses {nnodes * per_node} of the {total} GPUs of RayCluster {cluster}'s workers"
    return None


def rayjob_manifest(spec: JobSpec, entrypoint: str, job_name: str, entrypoint_gpus: float = 0) -> dict[str, Any]:
    """A RayJob on the existing RayCluster `spec.name`. `entrypointNumGpus` reserves GPUs for the
    driver, so code in the entrypoint (a VERL trainer's driver) sees CUDA devices."""
    return {
        "apiVersion": f"{GROUP}/{VERSION}", "kind": "RayJob",
        "metadata": {"name": job_name, "namespace": spec.namespace, "labels": m.labels(spec)},
        "spec": {
            "entrypoint": entrypoint,
            "entrypointNumGpus": entrypoint_gpus,
            "clusterSelector": {CLUSTER_LABEL: spec.name},
            "submissionMode": "K8sJobMode",
        },
    }


class RayClient:
    def __init__(self, api_client: Any):
        from kubernetes import client

        self.custom = client.CustomObjectsApi(api_client)
        self.host = api_client.configuration.host

    def get(self, name: str, namespace: str, plural: str = "rayclusters") -> dict[str, Any] | None:
        try:
            with api_errors(f"reading {plural}/{name}", self.host):
                found = self.custom.get_namespaced_custom_object(GROUP, VERSION, namespace, plural, name)
                return cast("dict[str, Any] | None", found)
        except Exception as e:
            if is_not_found(e):
                return None
            raise

    def server_dry_run(self, job: ResolvedJob) -> list[str]:
        """The RayCluster, then one Pod of each group KubeRay will make (the head, each worker group),
        created with dryRun=All: admission speaks to the pods, which the RayCluster alone never meets
        (Pod Security, PriorityClass, quotas). Nothing is stored; KIND/NAME of each accepted."""
        from kubernetes import client

        spec, obj = job.spec, raycluster_manifest(job)
        core = client.CoreV1Api(self.custom.api_client)
        with api_errors(f"server dry run of RayCluster/{spec.name}", self.host):
            self.custom.create_namespaced_custom_object(GROUP, VERSION, spec.namespace, "rayclusters", obj,
                                                        field_validation="Strict", dry_run="All")
        return [f"RayCluster/{spec.name}", *dry_run_pods(core, obj, self.host)]

    def create(self, job: ResolvedJob, wait: float | None = None, poll: float = 5.0) -> dict[str, Any]:
        """Create the RayCluster, or reuse the one of this name if it was made from the same spec."""
        spec, obj = job.spec, raycluster_manifest(job)
        existing = self.get(spec.name, spec.namespace)
        if existing is not None:
            theirs = (existing["metadata"].get("annotations") or {}).get(SPEC_HASH)
            if theirs != obj["metadata"]["annotations"][SPEC_HASH]:
                raise Conflict(f"RayCluster {spec.name!r} already exists in {spec.namespace} with a different spec; "
                                f"`fsdpkit ray delete {spec.name}` first, or pick another name")
            action = "reused"
        else:
            try:
                with api_errors(f"creating RayCluster/{spec.name}", self.host):
                    self.custom.create_namespaced_custom_object(GROUP, VERSION, spec.namespace, "rayclusters", obj,
                                                                field_validation="Strict")
            except Exception as e:
                if is_not_found(e):
                    raise ClusterError("creating RayCluster: the ray.io/v1 CRD is not installed; install the "
                                       "KubeRay operator (see `fsdpkit cluster check`)") from None
                raise
            action = "created"
        state = self.wait_ready(spec.name, spec.namespace, wait, poll) if wait is not None else self.state(
            spec.name, spec.namespace)
        return {"name": spec.name, "namespace": spec.namespace, "action": action, "state": state}

    def state(self, name: str, namespace: str) -> str:
        obj = self.get(name, namespace)
        if obj is None:
            raise NotFound(f"RayCluster {name!r} not found in namespace {namespace}")
        return (obj.get("status") or {}).get("state") or "pending"

    def wait_ready(self, name: str, namespace: str, timeout: float, poll: float) -> str:
        """The cluster's state once KubeRay says it is ready, saying what it is meanwhile (on a change,
        and every 30 s)."""
        state = wait_saying(lambda: self.state(name, namespace), lambda s: s == "ready", timeout, poll,
                            lambda s, waited: None if s == "ready" else
                            f"waiting for RayCluster {name} to be ready (state {s}, {waited})", log.info)
        if state != "ready":
            raise TimedOut(f"RayCluster {name!r} is not ready after {timeout:.0f} s (state {state}); "
                               f"kubectl -n {namespace} describe raycluster {name}")
        return state

    def made_by_submit(self, name: str, namespace: str) -> list[str]:
        """The RayJobs `submit` made on the RayCluster `name`: fsdpkit's label for it, and its
        clusterSelector naming it (checked here too, whatever the server did with the selector)."""
        wanted = {**m.MANAGED_BY, m.JOB_LABEL: name}
        with api_errors("listing RayJobs", self.host):
            items = self.custom.list_namespaced_custom_object(GROUP, VERSION, namespace, "rayjobs",
                                                              label_selector=label_selector(wanted))["items"]
        return [j["metadata"]["name"] for j in items if labels_match(j["metadata"].get("labels"), wanted)
                and (j.get("spec") or {}).get("clusterSelector", {}).get(CLUSTER_LABEL) == name]

    def delete(self, name: str, namespace: str, dry_run: bool = False) -> list[str]:
        """Delete the RayJobs `submit` made on the cluster, then the RayCluster; KIND/NAME of each
        (what would be deleted, with `dry_run`)."""
        if self.get(name, namespace) is None:
            raise NotFound(f"RayCluster {name!r} not found in namespace {namespace}")
        targets = [("rayjobs", j) for j in self.made_by_submit(name, namespace)] + [("rayclusters", name)]
        for plural, obj in targets if not dry_run else ():
            with api_errors(f"deleting {plural}/{obj}", self.host):
                self.custom.delete_namespaced_custom_object(GROUP, VERSION, namespace, plural, obj)
        return [f"{'RayJob' if plural == 'rayjobs' else 'RayCluster'}/{obj}" for plural, obj in targets]

    def submit(self, spec: JobSpec, entrypoint: str, job_name: str, entrypoint_gpus: float) -> dict[str, Any]:
        cluster = self.get(spec.name, spec.namespace)
        if cluster is None:
            raise NotFound(f"RayCluster {spec.name!r} not found in namespace {spec.namespace}; "
                           "start it with `fsdpkit ray create`")
        if fewer := check_verl_gpus(entrypoint, spec.name, worker_gpus(cluster)):
            log.warning(fewer)
        if self.get(job_name, spec.namespace, "rayjobs") is not None:
            raise Conflict(f"RayJob {job_name!r} already exists in {spec.namespace}; pick another --job-name")
        obj = rayjob_manifest(spec, entrypoint, job_name, entrypoint_gpus)
        with api_errors(f"creating RayJob/{job_name}", self.host):
            self.custom.create_namespaced_custom_object(GROUP, VERSION, spec.namespace, "rayjobs", obj,
                                                        field_validation="Strict")
        return {"name": job_name, "cluster": spec.name, "namespace": spec.namespace}
