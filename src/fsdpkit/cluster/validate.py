"""Validation workloads: `nvidia-smi -L` on every GPU node (are all its GPUs usable?), and an
nccl-tests all_reduce_perf MPIJob across nodes (is NCCL on EFA, and how fast?)."""

from __future__ import annotations

import logging
import re
import secrets
from decimal import Decimal
from typing import Any

from fsdpkit.cluster import pod_rules
from fsdpkit.cluster.checks import GPU, ClusterReader, node_infos
from fsdpkit.cluster.client import ClusterError, api_errors, is_not_found
from fsdpkit.cluster.nccl import parse_all_reduce, verdict
from fsdpkit.cluster.pods import run_pods
from fsdpkit.errors import TimedOut
from fsdpkit.hardware.instances import lookup, network_env
from fsdpkit.polling import wait_saying

log = logging.getLogger(__name__)

CUDA_IMAGE = "nvidia/cuda:12.6.3-base-ubuntu22.04"
NCCL_TESTS_IMAGE = "public.ecr.aws/hpc-cloud/nccl-tests:latest"
_GPU_LINE = re.compile(r"^GPU \d+: .+\(UUID: GPU-[0-9a-f-]+\)", re.M)


def gpu_pod(name: str, namespace: str, node: str, gpus: int, image: str) -> dict[str, Any]:
    return {
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": name, "namespace": namespace,
                     "labels": {"app.kubernetes.io/managed-by": "fsdpkit", "fsdpkit.dev/validate": "gpu"}},
        "spec": {
            "restartPolicy": "Never", "nodeName": node,
            "tolerations": [{"key": GPU, "operator": "Exists", "effect": "NoSchedule"}],
            "containers": [{"name": "nvidia-smi", "image": image, "command": ["nvidia-smi", "-L"],
                            "resources": {"limits": {GPU: gpus}}}],
        },
    }


def validate_gpu(api_client: Any, namespace: str = "default", image: str = CUDA_IMAGE,
                 timeout: float = 600, poll: float = 2.0) -> list[dict[str, Any]]:
    """One pod per Ready GPU node asking for all of its free GPUs; pass when nvidia-smi lists them all."""
    r = ClusterReader(api_client)
    nodes = node_infos(r.items("nodes", r.core.list_node), r.items("pods", r.core.list_pod_for_all_namespaces))
    results, pods = [], {}
    for n in nodes:
        total = int(n.allocatable.get(GPU, Decimal(0)))
        if not total:
            continue
        free = total - int(n.allocated.get(GPU, Decimal(0)))
        if not n.ready or free <= 0:
            results.append({"node": n.name, "status": "warn", "expected": total, "seen": None,
                            "detail": "not Ready" if not n.ready else f"all {total} GPUs in use: not tested"})
            continue
        name = f"fsdpkit-gpu-{secrets.token_hex(3)}"
        pods[name] = (n.name, free)
    if not pods and not results:
        raise ClusterError("no node advertises nvidia.com/gpu: see `fsdpkit cluster check`")
    done = run_pods(api_client, namespace, [gpu_pod(p, namespace, node, free, image)
                                            for p, (node, free) in pods.items()], timeout, poll) if pods else {}
    for pod, (node, free) in pods.items():
        phase, printed = done[pod]
        seen = len(_GPU_LINE.findall(printed))
        ok = phase == "Succeeded" and seen == free
        detail = f"{seen}/{free} GPUs listed by nvidia-smi" if phase == "Succeeded" else \
            f"nvidia-smi failed: {printed.strip().splitlines()[-1] if printed.strip() else phase}"
        results.append({"node": node, "status": "pass" if ok else "fail", "expected": free, "seen": seen,
                        "detail": detail})
    return sorted(results, key=lambda x: x["node"])


def nccl_mpijob(name: str, namespace: str, nodes: int, instance_type: str, image: str) -> dict[str, Any]:
    """An mpi-operator MPIJob: one launcher running mpirun, `nodes` workers with every GPU and EFA
    device of the instance type. NCCL_DEBUG=INFO so the log says which network NCCL chose."""
    inst = lookup(instance_type)
    env = {**network_env(inst, inst.efa, diagnose=True)}
    ranks = nodes * inst.accelerators
    exports = " ".join(f"-x {k}" for k in env)
    launcher_cmd = (f"mpirun --allow-run-as-root -np {ranks} -npernode {inst.accelerators} --bind-to none "
                    f"{exports} -x LD_LIBRARY_PATH -x PATH /opt/nccl-tests/build/all_reduce_perf "
                    "-b 8 -e 16G -f 2 -g 1 -c 1 -n 20")
    resources = {GPU: inst.accelerators, **({"vpc.amazonaws.com/efa": inst.efa} if inst.efa else {})}
    worker = {
        "containers": [{"name": "worker", "image": image, "env": [{"name": k, "value": v} for k, v in env.items()],
                        "resources": {"requests": dict(resources), "limits": dict(resources)},
                        "volumeMounts": [{"name": "dshm", "mountPath": "/dev/shm"}]}],
        "volumes": [{"name": "dshm", "emptyDir": {"medium": "Memory"}}],
        "nodeSelector": {"node.kubernetes.io/instance-type": instance_type},
        "tolerations": [{"key": GPU, "operator": "Exists", "effect": "NoSchedule"}],
    }
    return pod_rules.check_objects([{
        "apiVersion": "kubeflow.org/v2beta1", "kind": "MPIJob",
        "metadata": {"name": name, "namespace": namespace, "labels": {"app.kubernetes.io/managed-by": "fsdpkit"}},
        "spec": {
            "slotsPerWorker": inst.accelerators,
            "runPolicy": {"cleanPodPolicy": "Running", "backoffLimit": 0},
            "mpiReplicaSpecs": {
                "Launcher": {"replicas": 1, "template": {"spec": {
                    "restartPolicy": "OnFailure",
                    "containers": [{"name": "launcher", "image": image, "command": ["/bin/bash", "-c", launcher_cmd],
                                    "env": [{"name": k, "value": v} for k, v in env.items()]}]}}},
                "Worker": {"replicas": nodes, "template": {"spec": worker}},
            },
        },
    }])[0]


def validate_nccl(api_client: Any, nodes: int, instance_type: str, namespace: str = "default",
                  image: str = NCCL_TESTS_IMAGE, timeout: float = 1800, poll: float = 5.0) -> dict[str, Any]:
    from kubernetes import client

    custom, core = client.CustomObjectsApi(api_client), client.CoreV1Api(api_client)
    host = api_client.configuration.host
    name = f"fsdpkit-nccl-{secrets.token_hex(3)}"
    job = nccl_mpijob(name, namespace, nodes, instance_type, image)
    try:
        with api_errors("creating the nccl-tests MPIJob", host):
            custom.create_namespaced_custom_object("kubeflow.org", "v2beta1", namespace, "mpijobs", job,
                                                   field_validation="Strict")
    except Exception as e:
        if is_not_found(e):
            raise ClusterError("the MPIJob CRD (kubeflow.org/v2beta1) is not installed; run `fsdpkit cluster addons "
                               "install --only mpi` (the MPI operator runs nccl-tests)", code="not_found") from None
        raise
    try:
        sel = f"training.kubeflow.org/job-name={name},training.kubeflow.org/job-role=launcher"

        def look() -> list[dict[str, Any]]:
            with api_errors("reading the launcher pod", host):
                items = core.list_namespaced_pod(namespace, label_selector=sel, _preload_content=False).json()["items"]
            return [p for p in items if (p["metadata"].get("labels") or {}).get("training.kubeflow.org/job-name")
                    == name and (p["metadata"].get("labels") or {}).get("training.kubeflow.org/job-role")
                    == "launcher"]

        def phase(launcher: list[dict[str, Any]]) -> str | None:
            return (launcher[0].get("status") or {}).get("phase") if launcher else None

        def what(launcher: list[dict[str, Any]], waited: str) -> str | None:
            if phase(launcher) in ("Succeeded", "Failed"):
                return None
            state = phase(launcher) or "not created yet"
            return f"waiting for nccl-tests on {nodes} nodes: launcher {state} ({waited})"

        launcher = wait_saying(look, lambda seen: phase(seen) in ("Succeeded", "Failed"), timeout, poll, what, log.info)
        if phase(launcher) not in ("Succeeded", "Failed"):
            raise TimedOut(f"nccl-tests did not finish in {timeout:.0f} s; kubectl -n {namespace} describe "
                           f"mpijob {name}")
        with api_errors("reading the launcher's log", host):
            printed = core.read_namespaced_pod_log(launcher[0]["metadata"]["name"], namespace,
                                                   _preload_content=False).data.decode(errors="replace")
    finally:
        try:
            with api_errors("deleting the nccl-tests MPIJob", host):
                custom.delete_namespaced_custom_object("kubeflow.org", "v2beta1", namespace, "mpijobs", name)
        except Exception as e:
            if not is_not_found(e):
                raise
    res = parse_all_reduce(printed)
    status, why = verdict(res, lookup(instance_type), nodes)
    return {"job": name, "status": status, "detail": why, "network": res.network, "provider": res.provider,
            "nics": res.nics, "rows": res.rows, "avg_busbw": res.avg_busbw, "peak_busbw": res.peak_busbw}
