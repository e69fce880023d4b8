"""`fsdpkit cluster check`: is this cluster ready to train? Each check reads the API the way an SRE
would (nodes and what is allocated on them, device-plugin DaemonSets by every label they ship
with, operator CRDs and controllers, storage) and gives pass / warn / fail with what to do.

A user a shared cluster gives a namespace may read none of that (nodes, CRDs and storage classes
are cluster-scoped): each read refused is a check marked `unread` that names the refusal, never an
empty list taken for "none". Which job operators' APIs exist comes from discovery then, which every
user may read."""

from __future__ import annotations

import json
from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from decimal import Decimal
from typing import Any

from fsdpkit.cluster import kueue, trainer
from fsdpkit.cluster.client import api_errors, api_message, api_resources, is_forbidden, is_not_found, labels_match
from fsdpkit.cluster.quantity import fmt_bytes, fmt_cores, parse

GPU, EFA, NEURON = "nvidia.com/gpu", "vpc.amazonaws.com/efa", "aws.amazon.com/neuron"
INSTANCE_TYPE = "node.kubernetes.io/instance-type"
HEALTH = "sagemaker.amazonaws.com/node-health-status"
DEEP_HEALTH = "sagemaker.amazonaws.com/deep-health-check-status"

# Each component ships under different labels depending on how it was installed; looking for only
# one of them gives false "missing" verdicts.
# Label sets any one of which marks a component (a value of None: the key alone).
LabelSets = Sequence[Mapping[str, str | None]]
NVIDIA_PLUGIN_LABELS: LabelSets = [
    {"name": "nvidia-device-plugin-ds"},                         # static manifest (nvidia-device-plugin.yml)
    {"app.kubernetes.io/name": "nvidia-device-plugin"},          # Helm chart (also HyperPod's dependencies)
    {"app": "nvidia-device-plugin-daemonset"},                   # NVIDIA GPU operator
]
EFA_PLUGIN_LABELS: LabelSets = [
    {"name": "aws-efa-k8s-device-plugin"},                       # eks-charts / static manifest
    {"app.kubernetes.io/name": "aws-efa-k8s-device-plugin"},     # Helm chart
]
TRAINING_OPERATOR_LABELS: LabelSets = [
    {"control-plane": "kubeflow-training-operator"},
    {"app.kubernetes.io/name": "training-operator"},
]
# The HyperPod training operator's controller (an EKS add-on of HyperPod clusters, namespace aws-hyperpod).
HYPERPOD_OPERATOR_LABELS: LabelSets = [
    {"hp-training-control-plane": None}, {"app.kubernetes.io/name": "hp-training-operator"}]
KUEUE_LABELS: LabelSets = [{"app.kubernetes.io/name": "kueue", "control-plane": "controller-manager"}]
KUEUE_RELEASE = "v0.19.2"
KUBERAY_LABELS: LabelSets = [
    {"app.kubernetes.io/name": "kuberay-operator"}, {"app.kubernetes.io/component": "kuberay-operator"}]

# Well-known remedies: the text shown to the user, and the command `cluster check --fix` runs once
# the user confirms it.
REMEDIES = {
    "nvidia": "kubectl apply -f https://raw.githubusercontent.com/NVIDIA/k8s-device-plugin/v0.17.0/deployments/"
              "static/nvidia-device-plugin.yml",
    "efa": "helm repo add eks https://aws.github.io/eks-charts && helm upgrade --install aws-efa-k8s-device-plugin "
           "eks/aws-efa-k8s-device-plugin --namespace kube-system",
    "trainer": trainer.INSTALL,
    "training-operator": "kubectl apply --server-side -k "
                         "\"github.com/kubeflow/training-operator.git/manifests/overlays/standalone?ref=v1.9.2\"",
    "kuberay": "helm repo add kuberay https://ray-project.github.io/kuberay-helm/ && helm upgrade --install "
               "kuberay-operator kuberay/kuberay-operator --version 1.4.2",
    # MPIJob v2beta1: what `fsdpkit cluster validate nccl` runs nccl-tests as.
    "mpi": "kubectl apply --server-side -f https://raw.githubusercontent.com/kubeflow/mpi-operator/v0.6.0/deploy/"
           "v2beta1/mpi-operator.yaml",
    # Kueue, for teams' quotas (`fsdpkit cluster team`); HyperPod's task governance brings its own.
    "kueue": f"kubectl apply --server-side -f https://github.com/kubernetes-sigs/kueue/releases/download/{KUEUE_RELEASE}/"
             "manifests.yaml",
    "fsx": "helm repo add aws-fsx-csi-driver https://kubernetes-sigs.github.io/aws-fsx-csi-driver && helm upgrade "
           "--install aws-fsx-csi-driver aws-fsx-csi-driver/aws-fsx-csi-driver --namespace kube-system",
}
FIXES = {k: f"install it: {v}" for k, v in REMEDIES.items()}
FIXES["hyperpod-operator"] = ("install the HyperPod training operator add-on: aws eks create-addon --cluster-name "
                              "CLUSTER --addon-name amazon-sagemaker-hyperpod-training-operator (needs cert-manager)")
# The CRDs the checks look for, each with the version discovery finds it at where CRDs cannot be listed.
CRD_VERSIONS = {"trainjobs.trainer.kubeflow.org": trainer.VERSION, "jobsets.jobset.x-k8s.io": "v1alpha2",
                "pytorchjobs.kubeflow.org": "v1", "hyperpodpytorchjobs.sagemaker.amazonaws.com": "v1",
                "rayclusters.ray.io": "v1", "clusterqueues.kueue.x-k8s.io": "v1beta2"}
# The job backend each job operator serves, in the order a plain cluster prefers them.
JOB_OPERATORS = {"hyperpod": "HyperPod training operator", "trainjob": "Kubeflow Trainer v2",
                 "pytorchjob": "Kubeflow training operator"}


@dataclass
class Check:
    name: str
    status: str           # pass | warn | fail | unread (this user may not read what it checks)
    detail: str
    fix: str = ""
    remedy: str = ""      # a command `--fix` may run, after asking
    backend: str = ""     # a job operator's check: the job backend it serves


@dataclass
class NodeInfo:
    name: str
    instance_type: str
    ready: bool
    allocatable: dict[str, Decimal]
    allocated: dict[str, Decimal]
    labels: dict[str, str] = field(default_factory=dict)
    unschedulable: bool = False

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["allocatable"] = {k: str(v) for k, v in self.allocatable.items()}
        d["allocated"] = {k: str(v) for k, v in self.allocated.items()}
        d.pop("labels")
        return d


@dataclass
class Report:
    checks: list[Check]
    nodes: list[NodeInfo]
    backends: list[str] = field(default_factory=list)   # job backends whose operator runs here, preferred first
    operators: dict[str, bool] = field(default_factory=dict)   # job operator -> installed and running
    team: dict[str, Any] | None = None   # with --team: the team's queue, ClusterQueue, quota and use

    @property
    def failed(self) -> bool:
        return any(c.status == "fail" for c in self.checks)

    def to_dict(self) -> dict[str, Any]:
        return {"ok": not self.failed, "checks": [asdict(c) for c in self.checks],
                "nodes": [n.to_dict() for n in self.nodes], "operators": self.operators, "backends": self.backends,
                "default_backend": self.backends[0] if self.backends else None, "team": self.team}


class ClusterReader:
    """Raw JSON reads (no model classes: a partial object from an odd installer must not crash us)."""

    def __init__(self, api_client: Any):
        from kubernetes import client

        self.api = api_client
        self.core = client.CoreV1Api(api_client)
        self.apps = client.AppsV1Api(api_client)
        self.ext = client.ApiextensionsV1Api(api_client)
        self.storage = client.StorageV1Api(api_client)
        self.custom = client.CustomObjectsApi(api_client)
        self.host = api_client.configuration.host
        self.gaps: dict[str, str] = {}   # what this user may not list -> the API server's refusal

    def items(self, what: str, fn: Any, **kw: Any) -> list[dict[str, Any]]:
        """The objects, or [] with `what` in `gaps` where RBAC refused the list."""
        try:
            with api_errors(f"listing {what}", self.host, keep=is_forbidden):
                resp = fn(_preload_content=False, **kw)
        except Exception as e:
            if is_not_found(e):
                return []
            if is_forbidden(e):
                self.gaps[what] = api_message(e)
                return []
            raise
        return json.loads(resp.data or b"{}").get("items") or []

    def unread(self, name: str, *reads: str) -> Check | None:
        """The check `name` as unread, when any of the reads it needs was refused."""
        refused = [f"{what}: {self.gaps[what]}" for what in reads if what in self.gaps]
        if not refused:
            return None
        return Check(name, "unread", f"not read ({'; '.join(refused)})", "ask the cluster's admin for read access "
                     "(a ClusterRole), or run `fsdpkit cluster check` as a user who has it")

    def crds(self, names: Sequence[str]) -> set[str]:
        """The CRDs installed: listed, or where this user may not list CRDs, each of `names`
        (PLURAL.GROUP) the API server serves (discovery)."""
        crds = {str((c.get("metadata") or {}).get("name")) for c in self.items("CRDs",
                                                                                self.ext.list_custom_resource_definition)}
        if "CRDs" not in self.gaps:
            return crds
        return {name for name in names if name.split(".", 1)[0] in
                (api_resources(self.custom, name.split(".", 1)[1], CRD_VERSIONS[name], self.host) or ())}


def _allocated(pods: list[dict[str, Any]]) -> dict[str, dict[str, Decimal]]:
    """Per node, the resources the pods on it request and still hold (not Succeeded or Failed)."""
    allocated: dict[str, dict[str, Decimal]] = defaultdict(lambda: defaultdict(Decimal))
    for pod in pods:
        phase = (pod.get("status") or {}).get("phase")
        node = (pod.get("spec") or {}).get("nodeName")
        if not node or phase in ("Succeeded", "Failed"):
            continue
        for c in (pod.get("spec") or {}).get("containers") or []:
            res = c.get("resources") or {}
            # Extended resources may be given as limits only; Kubernetes then requests the same.
            for k, v in {**(res.get("limits") or {}), **(res.get("requests") or {})}.items():
                if k in ("cpu", "memory", GPU, EFA, NEURON):
                    allocated[node][k] += parse(v)
    return allocated


def node_infos(nodes: list[dict[str, Any]], pods: list[dict[str, Any]]) -> list[NodeInfo]:
    """Allocatable and allocated (sum of the requests of pods that still hold them) per node."""
    allocated = _allocated(pods)
    out = []
    for n in nodes:
        meta, status = n.get("metadata") or {}, n.get("status") or {}
        labels = meta.get("labels") or {}
        ready = any(c.get("type") == "Ready" and c.get("status") == "True" for c in status.get("conditions") or [])
        alloc = {k: parse(v) for k, v in (status.get("allocatable") or {}).items()
                 if k in ("cpu", "memory", GPU, EFA, NEURON)}
        out.append(NodeInfo(meta.get("name", "?"), labels.get(INSTANCE_TYPE, "?"), ready, alloc,
                            dict(allocated.get(str(meta.get("name")), {})), labels,
                            bool((n.get("spec") or {}).get("unschedulable"))))
    return sorted(out, key=lambda i: i.name)


def _daemonset_check(name: str, daemonsets: list[dict[str, Any]], label_sets: LabelSets,
                     fix: str, needed: bool) -> Check:
    found = [d for d in daemonsets
             if any(labels_match((d.get("metadata") or {}).get("labels"), ls) for ls in label_sets)]
    if not found:
        return Check(name, "fail" if needed else "warn", "not installed" + ("" if needed else " (no node needs it)"),
                     fix)
    ds = found[0]
    st = ds.get("status") or {}
    desired, ready = int(st.get("desiredNumberScheduled", 0)), int(st.get("numberReady", 0))
    where = f"{ds['metadata'].get('namespace')}/{ds['metadata'].get('name')}"
    if desired and ready < desired:
        return Check(name, "fail", f"{where}: {ready}/{desired} pods ready",
                     f"kubectl -n {ds['metadata'].get('namespace')} describe daemonset {ds['metadata'].get('name')}")
    return Check(name, "pass", f"{where}: {ready}/{desired} pods ready")


def _operator_check(name: str, crd: str, crds: set[str], deployments: list[dict[str, Any]],
                    label_sets: LabelSets, fix: str, needed: bool, r: ClusterReader | None = None) -> Check:
    if crd not in crds:
        return Check(name, "fail" if needed else "warn", f"CRD {crd} not installed", fix)
    if r is not None and (unread := r.unread(name, "deployments")):
        unread.detail = f"CRD {crd} served; its controller {unread.detail}"
        return unread
    found = [d for d in deployments
             if any(labels_match((d.get("metadata") or {}).get("labels"), ls) for ls in label_sets)]
    if not found:
        return Check(name, "fail" if needed else "warn", f"CRD {crd} present but no controller Deployment found", fix)
    d = found[0]
    available = int((d.get("status") or {}).get("availableReplicas") or 0)
    where = f"{d['metadata'].get('namespace')}/{d['metadata'].get('name')}"
    if available < 1:
        return Check(name, "fail", f"{where}: controller not available (0 replicas ready)",
                     f"kubectl -n {d['metadata'].get('namespace')} logs deploy/{d['metadata'].get('name')}")
    return Check(name, "pass", f"CRD {crd}; controller {where} available ({available})")


def _job_operator_checks(r: ClusterReader, crds: set[str], deployments: list[dict[str, Any]],
                         hyperpod_cluster: bool) -> tuple[list[tuple[str, Check]], list[str], dict[str, bool]]:
    """Which job operators run here, and the backends they serve. An absent one is a warning while
    another serves jobs; with none, the one this cluster should have (HyperPod's on a HyperPod
    cluster, else Trainer v2) fails with its install command."""
    found = {
        "trainjob": ("trainer", _operator_check(JOB_OPERATORS["trainjob"], "trainjobs.trainer.kubeflow.org", crds,
                                                deployments, trainer.CONTROLLER_LABELS, FIXES["trainer"], False, r)),
        "pytorchjob": ("training-operator", _operator_check(
            JOB_OPERATORS["pytorchjob"], "pytorchjobs.kubeflow.org", crds, deployments, TRAINING_OPERATOR_LABELS,
            FIXES["training-operator"], False, r)),
    }
    if hyperpod_cluster or "hyperpodpytorchjobs.sagemaker.amazonaws.com" in crds:
        found["hyperpod"] = ("hyperpod-operator", _operator_check(
            JOB_OPERATORS["hyperpod"], "hyperpodpytorchjobs.sagemaker.amazonaws.com", crds, deployments,
            HYPERPOD_OPERATOR_LABELS, FIXES["hyperpod-operator"], False, r))
    for backend, (_, check) in found.items():
        check.backend = backend
    _trainer_detail(r, crds, found["trainjob"][1], deployments)
    # An operator whose API is served and whose controller this user cannot see is taken as running:
    # its jobs would be accepted, and `job submit` says so if not.
    running = {b: b in found and found[b][1].status in ("pass", "unread") for b in JOB_OPERATORS}
    backends = [b for b in JOB_OPERATORS if running[b]]
    if "hyperpod" in found and "hyperpod" not in backends and "pytorchjob" in backends:
        backends.insert(0, "hyperpod")  # through the PyTorchJob path (hyperpod.operator: kubeflow)
    if not backends:
        want = "hyperpod" if "hyperpod" in found else "trainjob"
        found[want][1].status = "fail"
    elif found["pytorchjob"][1].status == "warn":
        # The legacy v1 operator is not missing where a current one runs.
        found["pytorchjob"][1].detail += " (legacy; the pytorchjob backend needs it)"
    return list(found.values()), backends, running


def _trainer_detail(r: ClusterReader, crds: set[str], check: Check, deployments: list[dict[str, Any]]) -> None:
    """Trainer v2 also needs JobSet and the release fsdpkit's TrainJobs need, and a TrainJob names a
    runtime: say which ones there are."""
    if check.status != "pass":
        return
    if "jobsets.jobset.x-k8s.io" not in crds:
        check.status, check.detail = "fail", f"{check.detail}; but CRD jobsets.jobset.x-k8s.io is not installed"
        check.fix = FIXES["trainer"]
        return
    releases = [v for v in map(trainer.image_version, trainer.controller_images(deployments)) if v is not None]
    if releases and min(releases) < trainer.MIN_VERSION:
        check.status = "fail"
        check.detail += f"; release v{'.'.join(map(str, min(releases)))}, but fsdpkit's TrainJobs need {trainer.NEEDS}"
        check.fix = FIXES["trainer"]
        return
    runtimes = sorted((o.get("metadata") or {}).get("name", "?") for o in r.items(
        "cluster training runtimes", r.custom.list_cluster_custom_object, group=trainer.GROUP,
        version=trainer.VERSION, plural="clustertrainingruntimes"))
    if "cluster training runtimes" in r.gaps:
        check.detail += f"; runtimes not read ({r.gaps['cluster training runtimes']})"
        return
    check.detail += f"; runtimes: {', '.join(runtimes) or 'none (install them: ' + trainer.INSTALL + ')'}"


def _node_checks(nodes: list[NodeInfo]) -> list[Check]:
    checks = []
    if not nodes:
        return [Check("nodes", "fail", "the cluster has no nodes", "add a node group (eksctl create nodegroup ...)")]
    not_ready = [n.name for n in nodes if not n.ready]
    checks.append(Check("nodes ready", "fail" if not_ready else "pass",
                        f"{len(nodes) - len(not_ready)}/{len(nodes)} Ready" + (f"; not ready: {', '.join(not_ready)}"
                                                                                 if not_ready else ""),
                        "kubectl describe node NAME (kubelet, disk or network pressure)" if not_ready else ""))
    gpu_nodes = [n for n in nodes if n.allocatable.get(GPU, 0) > 0 or n.allocatable.get(NEURON, 0) > 0]
    free = sum((n.allocatable.get(GPU, Decimal(0)) - n.allocated.get(GPU, Decimal(0)) for n in gpu_nodes
                if n.ready and not n.unschedulable), Decimal(0))
    total = sum((n.allocatable.get(GPU, Decimal(0)) for n in gpu_nodes), Decimal(0))
    checks.append(Check("GPU capacity", "pass" if gpu_nodes else "warn",
                        f"{len(gpu_nodes)} GPU node(s), {int(total)} GPUs, {int(free)} free" if gpu_nodes else
                        "no node advertises nvidia.com/gpu",
                        "" if gpu_nodes else "add GPU nodes, or check the NVIDIA device plugin below"))
    for n in nodes:
        checks += _hyperpod_health(n)
    return checks


def _hyperpod_health(n: NodeInfo) -> list[Check]:
    """A HyperPod node's health and deep-health labels, where it has them."""
    checks = []
    health, deep = n.labels.get(HEALTH), n.labels.get(DEEP_HEALTH)
    if health is not None:
        ok = health == "Schedulable"
        checks.append(Check(f"HyperPod health {n.name}", "pass" if ok else "fail", health,
                            "" if ok else "HyperPod is replacing or rebooting this node; jobs with auto-resume "
                            "continue on a healthy one (aws sagemaker describe-cluster-node)"))
    if deep is not None:
        status = {"Passed": "pass", "InProgress": "warn"}.get(deep, "fail")
        checks.append(Check(f"deep health check {n.name}", status, deep,
                            "" if status == "pass" else "wait for the deep health check, or replace the node"))
    return checks


NODEPOOL_LABEL = "karpenter.sh/nodepool"
NODEGROUP_LABEL = "eks.amazonaws.com/nodegroup"
INSTANCE_GROUP_LABEL = "sagemaker.amazonaws.com/instance-group-name"


def _gpu_pools(pools: list[dict[str, Any]]) -> dict[str, str]:
    """Karpenter NodePools that can launch GPU nodes (a GPU limit, or a requirement naming GPU
    instance types), each described: its instance types, capacity type and GPU limit."""
    out = {}
    for p in pools:
        spec = p.get("spec") or {}
        reqs = {r.get("key"): r.get("values") or [] for r in
                ((spec.get("template") or {}).get("spec") or {}).get("requirements") or []}
        limits = spec.get("limits") or {}
        types = reqs.get(INSTANCE_TYPE) or []
        if GPU not in limits and NEURON not in limits and not any(t.split(".")[0].startswith(("p", "g", "trn"))
                                                                  for t in types):
            continue
        parts = [", ".join(types) or "any type", "/".join(reqs.get("karpenter.sh/capacity-type") or ["any capacity"])]
        if limit := limits.get(GPU) or limits.get(NEURON):
            parts.append(f"up to {limit} GPUs")
        out[str((p.get("metadata") or {}).get("name"))] = "; ".join(parts)
    return out


def _provisioning_check(r: ClusterReader, nodes: list[NodeInfo]) -> Check:
    """How this cluster gets GPU nodes: Karpenter NodePools, EKS managed node groups, HyperPod
    instance groups, from the GPU nodes' own labels and the NodePools there are."""
    name = "GPU provisioning"
    served = api_resources(r.custom, "karpenter.sh", "v1", r.host) or set()
    pools = _gpu_pools(r.items("NodePools", r.custom.list_cluster_custom_object, group="karpenter.sh", version="v1",
                               plural="nodepools")) if "nodepools" in served else {}
    gpu_nodes = [n for n in nodes if n.allocatable.get(GPU, 0) > 0 or n.allocatable.get(NEURON, 0) > 0]
    by: dict[str, list[str]] = defaultdict(list)
    for n in gpu_nodes:
        for label, what in ((NODEPOOL_LABEL, "Karpenter NodePool"), (NODEGROUP_LABEL, "managed node group"),
                            (INSTANCE_GROUP_LABEL, "HyperPod instance group")):
            if label in n.labels:
                by[f"{what} {n.labels[label]}"].append(n.name)
                break
        else:
            by["self-managed nodes"].append(n.name)
    described = {f"Karpenter NodePool {p}": f"Karpenter NodePool {p} ({desc})" for p, desc in pools.items()}
    parts = [f"{described.get(source, source)}: {len(names)} node(s)" for source, names in sorted(by.items())]
    parts += [f"{text}: no nodes now; they come when GPU pods are pending"
              for source, text in sorted(described.items()) if source not in by]
    if "NodePools" in r.gaps:
        parts.append(f"NodePools not read ({r.gaps['NodePools']})")
    if not parts:
        return Check(name, "warn", "no GPU nodes and no Karpenter NodePool that launches them",
                     "add GPU capacity: `fsdpkit cluster nodepool` (Karpenter) or `fsdpkit cluster config` (a node "
                     "group)")
    return Check(name, "pass" if by or pools else "unread", "; ".join(parts))


def _team_check(r: ClusterReader, team: str) -> tuple[Check, dict[str, Any] | None]:
    """The team's LocalQueue (HyperPod task governance's names) and its ClusterQueue's quota, use,
    borrowing and lending, as Kueue reports them."""
    name, ns = f"team {team}", kueue.TEAM_NAMESPACE.format(team=team)
    version = kueue.served_version(r.custom, r.host)
    if version is None:
        return Check(name, "fail", "this cluster has no Kueue (no kueue.x-k8s.io API): no team quotas",
                     "turn on HyperPod task governance, or install Kueue"), None
    queues = r.items(f"LocalQueues in {ns}", r.custom.list_namespaced_custom_object, group=kueue.GROUP,
                     version=version, namespace=ns, plural="localqueues")
    if unread := r.unread(name, f"LocalQueues in {ns}"):
        return unread, None
    local = next((q for q in queues if (q.get("metadata") or {}).get("name") == kueue.TEAM_QUEUE.format(team=team)),
                 queues[0] if len(queues) == 1 else None)
    if local is None:
        return Check(name, "fail", f"no LocalQueue in namespace {ns}" if not queues else
                     f"{len(queues)} LocalQueues in {ns}, none named {kueue.TEAM_QUEUE.format(team=team)}",
                     "ask the cluster's admin for the team's compute quota (HyperPod task governance)"), None
    lq, cq_name = local["metadata"]["name"], str((local.get("spec") or {}).get("clusterQueue"))
    found = r.items("ClusterQueues", r.custom.list_cluster_custom_object, group=kueue.GROUP, version=version,
                    plural="clusterqueues")
    if "ClusterQueues" in r.gaps:
        return Check(name, "unread", f"LocalQueue {ns}/{lq} -> ClusterQueue {cq_name}; its quota not read "
                     f"({r.gaps['ClusterQueues']})", "ask the cluster's admin to let the team read its "
                     "ClusterQueue"), {"namespace": ns, "local_queue": lq, "cluster_queue": cq_name}
    cq = next((q for q in found if (q.get("metadata") or {}).get("name") == cq_name), None)
    if cq is None:
        return Check(name, "fail", f"LocalQueue {ns}/{lq} points at ClusterQueue {cq_name}, which does not exist",
                     "ask the cluster's admin"), None
    report = kueue.queue_report(cq)
    cohort = f" (cohort {report.cohort})" if report.cohort else ""
    detail = f"queue {ns}/{lq} -> ClusterQueue {cq_name}{cohort}: " + "; ".join(u.line() for u in report.usage) + \
        f"; {report.admitted} admitted, {report.pending} pending"
    return Check(name, "pass", detail), {"namespace": ns, "local_queue": lq, **report.to_dict()}


def run_checks(api_client: Any, team: str | None = None) -> Report:
    r = ClusterReader(api_client)
    nodes_raw = r.items("nodes", r.core.list_node)
    pods = r.items("pods", r.core.list_pod_for_all_namespaces)
    nodes = node_infos(nodes_raw, pods)
    daemonsets = r.items("daemonsets", r.apps.list_daemon_set_for_all_namespaces)
    deployments = r.items("deployments", r.apps.list_deployment_for_all_namespaces)
    crds = r.crds(list(CRD_VERSIONS))
    classes = r.items("storage classes", r.storage.list_storage_class)
    drivers = {(d.get("metadata") or {}).get("name") for d in r.items("CSI drivers", r.storage.list_csi_driver)}

    checks = [unread] if (unread := r.unread("nodes", "nodes")) else _node_checks(nodes)
    if not r.unread("nodes", "nodes"):
        checks.append(_provisioning_check(r, nodes))
    team_report = None
    if team:
        team_check, team_report = _team_check(r, team)
        checks.append(team_check)
    if "pods" in r.gaps and (capacity := next((c for c in checks if c.name == "GPU capacity"), None)):
        capacity.detail += f" (free not known: pods not read: {r.gaps['pods']})"
    hyperpod_cluster = any(HEALTH in n.labels for n in nodes)
    operators, backends, running = _job_operator_checks(r, crds, deployments, hyperpod_cluster)
    checks += _add_on_checks(r, nodes, daemonsets, deployments, crds, operators, team)
    checks.append(unread if (unread := r.unread("FSx for Lustre", "CSI drivers", "storage classes"))
                  else _fsx_check(classes, drivers))
    return Report(checks, nodes, backends, running, team_report)


def _family(n: NodeInfo) -> str:
    """p5 of p5.48xlarge and of HyperPod's ml.p5.48xlarge."""
    return n.instance_type.removeprefix("ml.").split(".")[0]


def _add_on_checks(r: ClusterReader, nodes: list[NodeInfo], daemonsets: list[dict[str, Any]],
                   deployments: list[dict[str, Any]], crds: set[str], operators: list[tuple[str, Check]],
                   team: str | None) -> list[Check]:
    """The device plugins (needed where the nodes' types have GPUs or EFA), the job operators, KubeRay
    and Kueue: each with the remedy that installs it where it is missing."""
    gpu_types = any(_family(n) in ("p4d", "p4de", "p5", "p5e", "p5en", "g5", "g6", "g6e") for n in nodes)
    efa_nodes = any(n.allocatable.get(EFA, 0) > 0 for n in nodes) or any(
        _family(n) in ("p4d", "p4de", "p5", "p5e", "p5en") for n in nodes)
    out = []
    for key, check in (
        ("nvidia", _daemonset_check("NVIDIA device plugin", daemonsets, NVIDIA_PLUGIN_LABELS, FIXES["nvidia"],
                                    needed=gpu_types)),
        ("efa", _daemonset_check("EFA device plugin", daemonsets, EFA_PLUGIN_LABELS, FIXES["efa"], needed=efa_nodes)),
        *operators,
        ("kuberay", _operator_check("KubeRay operator", "rayclusters.ray.io", crds, deployments, KUBERAY_LABELS,
                                    FIXES["kuberay"], False, r)),
        # Kueue is said where it is, or where a team's quota is asked for; its absence is no warning.
        *([("kueue", _operator_check("Kueue", "clusterqueues.kueue.x-k8s.io", crds, deployments, KUEUE_LABELS,
                                     FIXES["kueue"], True, r))] if team or "clusterqueues.kueue.x-k8s.io" in crds
          else []),
    ):
        if key in ("nvidia", "efa") and (unread := r.unread(check.name, "nodes", "daemonsets")):
            check = unread
        # Missing (not merely unhealthy): installing it is the remedy; the legacy v1 operator is
        # never offered (its fix says how, for a spec that needs it).
        if key in REMEDIES and check.fix == FIXES[key] and key != "training-operator":
            check.remedy = REMEDIES[key]
        out.append(check)
    return out


def _fsx_check(classes: list[dict[str, Any]], drivers: set[Any]) -> Check:
    """FSx for Lustre's CSI driver, and the storage classes that provision with it."""
    if "fsx.csi.aws.com" not in drivers:
        return Check("FSx for Lustre", "warn", "CSI driver fsx.csi.aws.com not installed: checkpoints need another "
                     "shared volume", FIXES["fsx"], REMEDIES["fsx"])
    fsx = [c["metadata"]["name"] for c in classes if c.get("provisioner") == "fsx.csi.aws.com"]
    return Check("FSx for Lustre", "pass", "CSI driver installed" + (f"; storage classes: {', '.join(fsx)}" if fsx else
                                                                     "; no storage class uses it (static PVs only)"))


def _pair(n: NodeInfo, key: str, f: Callable[[Any], str] = lambda v: str(int(v))) -> str:
    """allocated/allocatable"""
    return f"{f(n.allocated.get(key, Decimal(0)))}/{f(n.allocatable.get(key, Decimal(0)))}"


def node_table(nodes: list[NodeInfo]) -> list[str]:
    rows = [f"{'node':34s} {'type':16s} {'ready':5s} {'GPU':>7s} {'EFA':>7s} {'CPU':>13s} {'memory':>21s}"]
    for n in nodes:
        rows.append(f"{n.name[:34]:34s} {n.instance_type[:16]:16s} {'yes' if n.ready else 'NO':5s} "
                    f"{_pair(n, GPU):>7s} {_pair(n, EFA):>7s} {_pair(n, 'cpu', fmt_cores):>13s} "
                    f"{_pair(n, 'memory', fmt_bytes):>21s}")
    return rows
