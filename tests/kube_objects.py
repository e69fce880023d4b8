"""Kubernetes objects as a cluster holds them (nodes, pods, DaemonSets, CRDs), and a healthy EKS GPU
cluster made of them: what the cluster, deploy and validate tests put into kmock."""

from __future__ import annotations

from fsdpkit.cluster.rbac import role_rules


def node(name, itype, gpus=0, efa=0, cpu="191450m", memory="2097152000Ki", ready=True, labels=None):
    alloc = {"cpu": cpu, "memory": memory, "pods": "110"}
    if gpus:
        alloc["nvidia.com/gpu"] = str(gpus)
    if efa:
        alloc["vpc.amazonaws.com/efa"] = str(efa)
    return {"apiVersion": "v1", "kind": "Node",
            "metadata": {"name": name, "labels": {"node.kubernetes.io/instance-type": itype, **(labels or {})}},
            "status": {"allocatable": alloc, "capacity": alloc,
                       "conditions": [{"type": "Ready", "status": "True" if ready else "False"}]}}


def pod(name, node_name, requests, phase="Running", limits=None):
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "namespace": "default"},
            "spec": {"nodeName": node_name, "containers": [{"name": "c", "image": "x", "resources": {
                "requests": requests, **({"limits": limits} if limits else {})}}]},
            "status": {"phase": phase}}


def daemonset(name, ns, labels, ready=2, desired=2):
    return {"apiVersion": "apps/v1", "kind": "DaemonSet", "metadata": {"name": name, "namespace": ns, "labels": labels},
            "status": {"desiredNumberScheduled": desired, "numberReady": ready}}


def deployment(name, ns, labels, available=1, image=None):
    out = {"apiVersion": "apps/v1", "kind": "Deployment",
           "metadata": {"name": name, "namespace": ns, "labels": labels}, "status": {"availableReplicas": available}}
    if image:
        out["spec"] = {"template": {"spec": {"containers": [{"name": "manager", "image": image}]}}}
    return out


def crd(name):
    return {"apiVersion": "apiextensions.k8s.io/v1", "kind": "CustomResourceDefinition", "metadata": {"name": name}}


def trainer_v2(kube, runtimes=("torch-distributed",), jobset=True, version="v2.3.0"):
    """Kubeflow Trainer v2 as its upstream manifests leave it: CRDs, the controller (its image tagged
    with the release), JobSet, runtimes."""
    for name in ("trainjobs.trainer.kubeflow.org", "clustertrainingruntimes.trainer.kubeflow.org",
                 *(["jobsets.jobset.x-k8s.io"] if jobset else [])):
        kube.create("/apis/apiextensions.k8s.io/v1/customresourcedefinitions", crd(name))
    kube.create("/apis/apps/v1/namespaces/kubeflow-system/deployments",
                deployment("kubeflow-trainer-controller-manager", "kubeflow-system",
                           {"app.kubernetes.io/name": "trainer", "app.kubernetes.io/component": "manager",
                            "app.kubernetes.io/part-of": "kubeflow"},
                           image=f"ghcr.io/kubeflow/trainer/trainer-controller-manager:{version}"))
    for name in runtimes:
        kube.create("/apis/trainer.kubeflow.org/v1alpha1/clustertrainingruntimes",
                    {"apiVersion": "trainer.kubeflow.org/v1alpha1", "kind": "ClusterTrainingRuntime",
                     "metadata": {"name": name}, "spec": {"mlPolicy": {"torch": {}}}})


def hyperpod_operator(kube):
    """The HyperPod training operator add-on: its CRD and controller in aws-hyperpod."""
    kube.create("/apis/apiextensions.k8s.io/v1/customresourcedefinitions",
                crd("hyperpodpytorchjobs.sagemaker.amazonaws.com"))
    kube.create("/apis/apps/v1/namespaces/aws-hyperpod/deployments",
                deployment("hp-training-operator-hp-training-controller-manager", "aws-hyperpod",
                           {"hp-training-control-plane": "hp-training-controller-manager"}))


def healthy_eks(kube, *, operator=True, gpu_plugin=True, gpu_plugin_labels=None, hyperpod_labels=None):
    """Two p5 nodes and a system node; plugins installed by Helm; the training operator; FSx CSI."""
    labels = hyperpod_labels or [{"eks.amazonaws.com/nodegroup": "gpu"}] * 2   # eksctl's managed node group
    kube.create("/api/v1/nodes", node("gpu-a", "p5.48xlarge", 8, 32, labels=labels[0]))
    kube.create("/api/v1/nodes", node("gpu-b", "p5.48xlarge", 8, 32, labels=labels[1]))
    kube.create("/api/v1/nodes", node("sys", "m5.xlarge", cpu="3920m", memory="15Gi"))
    kube.create("/api/v1/namespaces/default/pods",
                pod("train-0", "gpu-a", {"cpu": "500m", "memory": "1Gi"},
                    limits={"nvidia.com/gpu": "8", "vpc.amazonaws.com/efa": "32"}))
    kube.create("/api/v1/namespaces/default/pods", pod("done", "gpu-b", {"nvidia.com/gpu": "8"}, phase="Succeeded"))
    if gpu_plugin:
        kube.create("/apis/apps/v1/namespaces/kube-system/daemonsets",
                    daemonset("nvidia-device-plugin", "kube-system",
                              gpu_plugin_labels or {"app.kubernetes.io/name": "nvidia-device-plugin"}))
    kube.create("/apis/apps/v1/namespaces/kube-system/daemonsets",
                daemonset("aws-efa-k8s-device-plugin", "kube-system", {"name": "aws-efa-k8s-device-plugin"}))
    if operator:
        kube.create("/apis/apiextensions.k8s.io/v1/customresourcedefinitions", crd("pytorchjobs.kubeflow.org"))
        kube.create("/apis/apps/v1/namespaces/kubeflow/deployments",
                    deployment("training-operator", "kubeflow", {"control-plane": "kubeflow-training-operator"}))
    kube.create("/apis/storage.k8s.io/v1/csidrivers",
                {"apiVersion": "storage.k8s.io/v1", "kind": "CSIDriver", "metadata": {"name": "fsx.csi.aws.com"}})
    kube.create("/apis/storage.k8s.io/v1/storageclasses",
                {"apiVersion": "storage.k8s.io/v1", "kind": "StorageClass", "metadata": {"name": "fsx-sc"},
                 "provisioner": "fsx.csi.aws.com"})


def namespace_user(kube, namespace="default"):
    """A team's user on a shared cluster: the Role `fsdpkit cluster rbac` renders, nothing cluster-wide.
    This cluster serves only the training operator's jobs (kmock serves every kind it was told of)."""
    for resource in ("trainer.kubeflow.org/v1alpha1/trainjobs", "trainer.kubeflow.org/v1alpha1/clustertrainingruntimes",
                     "jobset.x-k8s.io/v1alpha2/jobsets", "sagemaker.amazonaws.com/v1/hyperpodpytorchjobs",
                     "ray.io/v1/rayclusters", "ray.io/v1/rayjobs", "kueue.x-k8s.io/v1beta2/localqueues",
                     "kueue.x-k8s.io/v1beta2/workloads", "kueue.x-k8s.io/v1beta2/clusterqueues"):
        kube.forget(resource)
    return kube.user("team-a-ci", role_rules([("kubeflow.org", "pytorchjobs")]), namespace)
