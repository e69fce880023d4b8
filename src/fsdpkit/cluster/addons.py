"""`fsdpkit cluster addons install`: what a training cluster needs beyond EKS's own add-ons.

The device plugins (NVIDIA, EFA) and the optional etcd for torchrun's etcd rendezvous are plain
DaemonSets / Deployments, created here with the official client, pinned, and left alone when they
exist. Kubeflow Trainer v2 (and, asked for by name, the legacy training operator v1) and KubeRay
install the upstream way (kustomize, Helm), through kubectl / helm when they are on PATH; otherwise
the exact command is reported. Beside Trainer v2's own runtimes, fsdpkit adds `fsdpkit-torch`.
Afterwards the readiness checks of `fsdpkit cluster check` say whether each component is there and
healthy.
"""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Callable
from typing import Any

from fsdpkit.cluster import checks, trainer
from fsdpkit.cluster.apply import describe, ensure
from fsdpkit.hardware.instances import INSTANCES
from fsdpkit.image.dockerfile import BASES, DEFAULT_BASE

NVIDIA_PLUGIN_IMAGE = "nvcr.io/nvidia/k8s-device-plugin:v0.17.0"
EFA_PLUGIN_IMAGE = "public.ecr.aws/eks/aws-efa-k8s-device-plugin:v0.5.6"
ETCD_IMAGE = "quay.io/coreos/etcd:v3.5.21"
COMPONENTS = ("nvidia", "efa", "trainer", "training-operator", "kuberay", "mpi", "kueue")
# What `install` does with no --only: Trainer v2 is the Kubeflow job API; the v1 operator is legacy.
DEFAULT_COMPONENTS = ("nvidia", "efa", "trainer", "kuberay")
# Which readiness check verifies each component.
CHECK_NAMES = {"nvidia": "NVIDIA device plugin", "efa": "EFA device plugin", "trainer": "Kubeflow Trainer v2",
               "training-operator": "Kubeflow training operator", "kuberay": "KubeRay operator",
               "mpi": "MPI operator",  # no readiness check of its own: `cluster validate nccl` is its test
               "kueue": "Kueue"}
_PLUGIN_DIR = "/var/lib/kubelet/device-plugins"
_RESTRICTED = {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}}


def _daemonset(name: str, labels: dict[str, str], image: str, pod_spec: dict[str, Any]) -> dict[str, Any]:
    return {
        "apiVersion": "apps/v1", "kind": "DaemonSet",
        "metadata": {"name": name, "namespace": "kube-system", "labels": {**labels, "app.kubernetes.io/managed-by":
                                                                           "fsdpkit"}},
        "spec": {
            "selector": {"matchLabels": labels},
            "updateStrategy": {"type": "RollingUpdate"},
            "template": {
                "metadata": {"labels": labels},
                "spec": {
                    "priorityClassName": "system-node-critical",
                    "containers": [{"name": name, "image": image, "securityContext": _RESTRICTED,
                                    "volumeMounts": [{"name": "device-plugin", "mountPath": _PLUGIN_DIR}]}],
                    "volumes": [{"name": "device-plugin", "hostPath": {"path": _PLUGIN_DIR}}],
                    **pod_spec,
                },
            },
        },
    }


def nvidia_plugin() -> dict[str, Any]:
    """NVIDIA's static deployment (nvidia-device-plugin.yml) with its own label, so the readiness
    check finds it the same way. FAIL_ON_INIT_ERROR=false: pods on CPU nodes idle instead of crashing."""
    ds = _daemonset("nvidia-device-plugin-daemonset", {"name": "nvidia-device-plugin-ds"}, NVIDIA_PLUGIN_IMAGE,
                    {"tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]})
    ds["spec"]["template"]["spec"]["containers"][0]["env"] = [{"name": "FAIL_ON_INIT_ERROR", "value": "false"}]
    return ds


def efa_plugin() -> dict[str, Any]:
    """The EFA plugin only where EFA exists: nodes whose instance type has EFA interfaces (the table)."""
    efa_types = sorted(n for n, i in INSTANCES.items() if i.efa) + sorted(
        f"ml.{n}" for n, i in INSTANCES.items() if i.efa)
    affinity = {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
        {"matchExpressions": [{"key": checks.INSTANCE_TYPE, "operator": "In", "values": efa_types}]}]}}}
    return _daemonset("aws-efa-k8s-device-plugin", {"name": "aws-efa-k8s-device-plugin"}, EFA_PLUGIN_IMAGE, {
        "hostNetwork": True, "affinity": affinity,
        "tolerations": [{"key": "CriticalAddonsOnly", "operator": "Exists"},
                        {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"},
                        {"key": "aws.amazon.com/efa", "operator": "Exists", "effect": "NoSchedule"}]})


def etcd(namespace: str) -> list[dict[str, Any]]:
    """One etcd member and its Service (etcd.NAMESPACE:2379), for `torchrun --rdzv-backend etcd`.
    v2 API on: torch's etcd rendezvous speaks it (etcd 3.5 is the last release that serves it)."""
    labels = {"app.kubernetes.io/name": "etcd", "app.kubernetes.io/managed-by": "fsdpkit"}
    host = f"etcd.{namespace}.svc"
    deploy = {
        "apiVersion": "apps/v1", "kind": "Deployment",
        "metadata": {"name": "etcd", "namespace": namespace, "labels": labels},
        "spec": {"replicas": 1, "selector": {"matchLabels": labels}, "template": {
            "metadata": {"labels": labels},
            "spec": {"containers": [{
                "name": "etcd", "image": ETCD_IMAGE,
                "command": ["etcd", "--name", "etcd", "--data-dir", "/var/lib/etcd", "--enable-v2=true",
                            "--listen-client-urls", "http://0.0.0.0:2379",
                            "--advertise-client-urls", f"http://{host}:2379"],
                "ports": [{"containerPort": 2379, "name": "client"}],
                "readinessProbe": {"httpGet": {"path": "/health", "port": 2379}, "periodSeconds": 5},
                "securityContext": _RESTRICTED,
                "volumeMounts": [{"name": "data", "mountPath": "/var/lib/etcd"}],
            }], "volumes": [{"name": "data", "emptyDir": {}}]},
        }},
    }
    service = {"apiVersion": "v1", "kind": "Service", "metadata": {"name": "etcd", "namespace": namespace,
                                                                    "labels": labels},
               "spec": {"selector": labels, "ports": [{"name": "client", "port": 2379, "targetPort": 2379}]}}
    return [deploy, service]


def plan(components: list[str], with_etcd: bool, namespace: str) -> list[dict[str, Any]]:
    """What install does, in order: ("object", manifest) or ("command", shell line) per component."""
    steps: list[dict[str, Any]] = []
    for c in components:
        if c == "nvidia":
            steps.append({"component": c, "object": nvidia_plugin()})
        elif c == "efa":
            steps.append({"component": c, "object": efa_plugin()})
        elif c == "trainer":
            # Upstream's controller and runtimes, then fsdpkit's own runtime beside them.
            steps.append({"component": c, "command": checks.REMEDIES[c]})
            steps.append({"component": c, "object": trainer.runtime_manifest(BASES[DEFAULT_BASE].image)})
        else:
            steps.append({"component": c, "command": checks.REMEDIES[c]})
    if with_etcd:
        steps += [{"component": "etcd", "object": o} for o in etcd(namespace)]
    return steps


def install(api_client: Any, steps: list[dict[str, Any]], say: Callable[[str], None]) -> dict[str, Any]:
    """Apply each step once; then the readiness verdict for each component."""
    report = checks.run_checks(api_client)
    present = {c.name for c in report.checks if c.status == "pass"}
    done = []
    upstream: dict[str, str] = {}
    for step in steps:
        if "object" in step and upstream.get(step["component"], "installed") not in ("installed", "exists"):
            # fsdpkit's object of an upstream component (the Trainer runtime) needs its CRD first.
            what, action = describe(step["object"]), "not created (its component is not installed)"
        elif "object" in step:
            what = describe(step["object"])
            action = ensure(api_client, step["object"])
        else:
            what = step["command"]
            action = upstream[step["component"]] = _run_upstream(step["component"], step["command"], present)
        say(f"{step['component']}: {action}: {what}")
        done.append({"component": step["component"], "action": action, "what": what})
    verdict = [c for c in checks.run_checks(api_client).checks
               if c.name in {CHECK_NAMES.get(s["component"]) for s in steps}]
    for c in verdict:
        say(f"check {c.name}: {c.status}: {c.detail}")
    return {"steps": done, "checks": [{"name": c.name, "status": c.status, "detail": c.detail} for c in verdict]}


def _run_upstream(component: str, command: str, present: set[str]) -> str:
    if CHECK_NAMES[component] in present:
        return "exists"
    tools = [t for t in ("kubectl", "helm") if t in command.split()]
    missing = [t for t in tools if shutil.which(t) is None]
    if missing:
        return f"not run ({', '.join(missing)} not installed); run it yourself"
    rc = subprocess.run(["/bin/sh", "-c", command], stdout=subprocess.DEVNULL).returncode
    return "installed" if rc == 0 else f"failed (exit {rc})"
