"""SageMaker HyperPod (EKS orchestrator): the HyperPod training operator's HyperPodPyTorchJob, its
workers started by HyperPod's elastic agent, with process-level restarts before a full-job restart
and log-monitoring rules written from the trainer's own lines (fsdpkit.jobs.log_rules). Or, for
clusters that still run Kubeflow training operator 1.7-1.8, a PyTorchJob with HyperPod's
auto-resume annotations. Both schedule only on nodes HyperPod marks healthy, prefer (or require)
nodes that passed the deep health check, and can pick an instance group."""

from __future__ import annotations

import copy
from typing import Any

from fsdpkit.cluster import pod_rules
from fsdpkit.jobs import manifests as m
from fsdpkit.jobs.log_rules import log_monitoring
from fsdpkit.jobs.resolved import ResolvedJob
from fsdpkit.jobs.spec import JobSpec

HEALTH = "sagemaker.amazonaws.com/node-health-status"
DEEP_HEALTH = "sagemaker.amazonaws.com/deep-health-check-status"
INSTANCE_GROUP = "sagemaker.amazonaws.com/instance-group-name"
AUTO_RESUME = "sagemaker.amazonaws.com/enable-job-auto-resume"
MAX_RETRY = "sagemaker.amazonaws.com/job-max-retry-count"
AGENT_PORT = 8080  # the elastic agent's server, which the operator talks to
# libfabric registers EFA buffers in 2 MiB pages; HyperPod's AMIs reserve them and AWS's examples ask.
HUGEPAGES = {"hugepages-2Mi": "5120Mi"}
AGENT_MARGIN = 15    # seconds hyperpodrun keeps for itself between its workers' deadline and SIGKILL


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


def adapt_pod(spec: JobSpec, template: dict[str, Any], instance_group: bool = True) -> None:
    """A pod on HyperPod: only healthy nodes, deep-health-checked ones preferred or required, and
    (with `instance_group`) the spec's instance group."""
    pod = template["spec"]
    pod["affinity"] = health_affinity(spec)
    if instance_group and spec.hyperpod.instance_group:
        pod.setdefault("nodeSelector", {})[INSTANCE_GROUP] = spec.hyperpod.instance_group


def pytorchjob_manifest(resolved: ResolvedJob) -> dict[str, Any]:
    spec = resolved.spec
    job = m.pytorchjob_manifest(resolved)
    if spec.hyperpod.auto_resume:
        job["metadata"]["annotations"].update({AUTO_RESUME: "true", MAX_RETRY: str(spec.hyperpod.max_retry)})
    for replica in job["spec"]["pytorchReplicaSpecs"].values():
        adapt_pod(spec, replica["template"])
    return job


def shutdown_timeout(job: ResolvedJob) -> int:
    """How long hyperpodrun lets its workers stop after SIGTERM before it kills them: the pod's grace
    less the agent's own margin, so the agent is done before the kubelet's SIGKILL."""
    return max(1, job.pod_grace - AGENT_MARGIN)


def hyperpod_job_command(job: ResolvedJob) -> list[str]:
    """HyperPod's training operator starts workers through its elastic agent, `hyperpodrun`
    (pip package hyperpod-elastic-agent), which takes torchrun's place and reports to the operator.
    Its defaults would end a stop with SIGKILL 15 s after it began; the workers get SIGTERM instead
    (fsdpkit's trainer then saves a checkpoint after its step) and the time the checkpoint needs."""
    spec = job.spec
    if spec.command is not None:
        return list(spec.command)
    # --tee=3 also writes each rank's output under --log_dir, which is where the agent's log monitor reads it.
    return ["hyperpodrun", f"--nnodes={spec.nodes}", f"--nproc-per-node={spec.procs}",
            "--shutdown-signal=SIGTERM", f"--shutdown-timeout={shutdown_timeout(job)}",
            "--server-host=0.0.0.0", f"--server-port={AGENT_PORT}", "--tee=3", "--log_dir=/tmp/hyperpod",
            "-m", "fsdpkit.train", *job.flags()]


def _agent_container(spec: JobSpec, template: dict[str, Any]) -> None:
    container = template["spec"]["containers"][0]
    container["ports"] = [{"containerPort": AGENT_PORT, "name": "agent"}]
    if spec.efa:
        res = container.setdefault("resources", {})
        for side in ("requests", "limits"):
            res.setdefault(side, {}).update(HUGEPAGES)


def deadlines(job: ResolvedJob) -> dict[str, int]:
    """runPolicy's startup and fault deadlines, as resolved (the spec's, else from the plan); none
    for a job that runs its own command (the operator's defaults)."""
    out = {"startupDeadlineSeconds": job.startup_deadline, "faultDeadlineSeconds": job.fault_deadline}
    return {k: v for k, v in out.items() if v is not None}


def restart_policy(spec: JobSpec) -> dict[str, Any]:
    """Process-level restarts before a whole-job restart, how many of those, and which nodes a
    whole-job restart leaves out: as many repeat offenders as there are spares to stand in."""
    hp = spec.hyperpod
    policy: dict[str, Any] = {"numRestartBeforeFullJobRestart": hp.restarts_before_full_restart,
                              "maxFullJobRestarts": hp.max_full_restarts, "evalPeriodSeconds": hp.restart_eval_period}
    avoid = hp.repeat_offenders_to_avoid if hp.repeat_offenders_to_avoid is not None else hp.spares
    if avoid:
        policy["maxNumRepeatOffendersToAvoid"] = avoid
    if hp.scale_up_snooze is not None:
        policy["scaleUpSnoozeTimeInSeconds"] = hp.scale_up_snooze
    return policy


def run_policy(job: ResolvedJob) -> dict[str, Any]:
    """Retries, restarts, deadlines and the log-monitoring rules. Finished pods are kept for
    `job logs --previous`."""
    spec = job.spec
    hp = spec.hyperpod
    policy: dict[str, Any] = {
        "cleanPodPolicy": "None",
        "jobMaxRetryCount": hp.max_retry if hp.auto_resume else 0,
        "restartPolicy": restart_policy(spec),
        **deadlines(job),
    }
    if spec.ttl_after_finished is not None:
        policy["ttlSecondsAfterFinished"] = spec.ttl_after_finished
    if rules := log_monitoring(job):
        policy["logMonitoringConfiguration"] = rules
    return policy


def hyperpod_job_manifest(resolved: ResolvedJob) -> dict[str, Any]:
    spec = resolved.spec
    template = m.pod_template(resolved, hyperpod_job_command(resolved))
    template["spec"]["terminationGracePeriodSeconds"] = resolved.pod_grace
    adapt_pod(spec, template)
    _agent_container(spec, template)
    replica: dict[str, Any] = {"name": "pod", "replicas": spec.nodes.max, "template": template}
    if spec.hyperpod.spares:
        replica["spares"] = spec.hyperpod.spares
    job: dict[str, Any] = {"nprocPerNode": str(spec.procs), "replicaSpecs": [replica],
                           "runPolicy": run_policy(resolved)}
    if spec.nodes.elastic:
        job["elasticPolicy"] = {"minReplicas": spec.nodes.min, "maxReplicas": spec.nodes.max}
    annotations = {m.ATTEMPT: "0", m.MAX_RESUBMITS: str(spec.resubmits)}
    if spec.placement == "topology":  # on the job too, where task governance reads it (as the HyperPod CLI puts it)
        annotations.update(spec.topology.annotations)
    return {
        "apiVersion": "sagemaker.amazonaws.com/v1", "kind": "HyperPodPyTorchJob",
        "metadata": {"name": spec.name, "namespace": spec.namespace, "labels": m.labels(spec),
                     "annotations": annotations},
        "spec": job,
    }


def render(resolved: ResolvedJob) -> list[dict[str, Any]]:
    spec = resolved.spec
    job = hyperpod_job_manifest(resolved) if spec.hyperpod.operator == "hyperpod" else pytorchjob_manifest(resolved)
    return pod_rules.check_objects([*m.support_objects(resolved), job])
