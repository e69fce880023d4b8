"""Validation workloads against kmock, which plays the kubelet and the MPI operator: the pods and
MPIJob that are created, what their output turns into, and that everything is removed again."""

from __future__ import annotations

import json
import threading
import time

import pytest

from fsdpkit.cluster.validate import nccl_mpijob

from conftest import ROOT, require, run_cli
from kube_objects import healthy_eks
from manifest_schemas import validate_builtin

require("kmock")
NCCL = ROOT / "tests" / "data" / "nccl"


def play(kube, path_suffix, react, count=1):
    """Wait for `count` POSTs to a path ending in `path_suffix` and answer each like the cluster would."""
    def loop():
        handled, deadline = 0, time.monotonic() + 30
        while handled < count and time.monotonic() < deadline:
            posts = [b for m, p, b in kube.requests() if m == "POST" and p.split("?")[0].endswith(path_suffix)
                     and b["metadata"]["name"].startswith("fsdpkit-")]
            for body in posts[handled:]:
                react(body)
                handled += 1
            time.sleep(0.1)
    t = threading.Thread(target=loop)
    t.start()
    return t


def test_gpu_validation_runs_nvidia_smi_on_free_gpu_nodes(kube):
    from kubernetes import client

    healthy_eks(kube)  # gpu-a: all 8 GPUs held by a training pod; gpu-b: 8 free
    core = client.CoreV1Api(kube.api())

    def kubelet(pod):
        time.sleep(1.0)   # the image is pulled and nvidia-smi runs: the CLI sees it Pending first
        name = pod["metadata"]["name"]
        listing = "".join(f"GPU {i}: NVIDIA H100 80GB HBM3 (UUID: GPU-{i:08x}-aaaa-bbbb-cccc-0123456789ab)\n"
                          for i in range(8))
        kube.route(f"get /api/v1/namespaces/default/pods/{name}/log", listing.encode())
        core.patch_namespaced_pod_status(name, "default", {"status": {"phase": "Succeeded"}})
    t = play(kube, "/namespaces/default/pods", kubelet)
    r = run_cli("cluster", "validate", "gpu", "--poll", "0.2", "--json", env=kube.env, timeout=60)
    t.join()
    assert r.returncode == 0, r.stderr
    rows = {x["node"]: x for x in json.loads(r.stdout)["data"]}
    assert rows["gpu-b"]["status"] == "pass" and rows["gpu-b"]["detail"] == "8/8 GPUs listed by nvidia-smi"
    assert rows["gpu-a"]["status"] == "warn" and "in use" in rows["gpu-a"]["detail"]
    pod = next(b for m, p, b in kube.requests()
               if m == "POST" and b and b["metadata"]["name"].startswith("fsdpkit-gpu"))
    assert pod["spec"]["nodeName"] == "gpu-b" and pod["spec"]["containers"][0]["resources"]["limits"] == {
        "nvidia.com/gpu": 8}
    validate_builtin(pod)
    assert any(m == "DELETE" and pod["metadata"]["name"] in p for m, p, _ in kube.requests())
    # What the wait said, once, while it waited.
    assert r.stderr.splitlines() == [f"waiting for 1 pod(s) to finish: {pod['metadata']['name']} Pending (0 s of 600)"]


def test_a_node_with_a_missing_gpu_fails(kube):
    from kubernetes import client

    healthy_eks(kube)
    core = client.CoreV1Api(kube.api())

    def kubelet(pod):
        name = pod["metadata"]["name"]
        kube.route(f"get /api/v1/namespaces/default/pods/{name}/log",
                   "".join(f"GPU {i}: NVIDIA H100 80GB HBM3 (UUID: GPU-{i:08x}-aaaa)\n" for i in range(7)).encode())
        core.patch_namespaced_pod_status(name, "default", {"status": {"phase": "Succeeded"}})
    t = play(kube, "/namespaces/default/pods", kubelet)
    r = run_cli("cluster", "validate", "gpu", "--poll", "0.2", env=kube.env, timeout=60)
    t.join()
    assert r.returncode == 1 and "FAIL  gpu-b: 7/8 GPUs listed by nvidia-smi" in r.stdout


def test_mpijob_pods_are_valid():
    job = nccl_mpijob("fsdpkit-nccl-x", "default", 2, "p5.48xlarge", "img")
    for replica in job["spec"]["mpiReplicaSpecs"].values():
        validate_builtin({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "p"}, **replica["template"]})
    cmd = job["spec"]["mpiReplicaSpecs"]["Launcher"]["template"]["spec"]["containers"][0]["command"][-1]
    assert "-np 16 -npernode 8" in cmd and "-x FI_PROVIDER" in cmd and "-x NCCL_DEBUG" in cmd
    worker = job["spec"]["mpiReplicaSpecs"]["Worker"]
    assert worker["replicas"] == 2
    assert worker["template"]["spec"]["containers"][0]["resources"]["limits"] == {
        "nvidia.com/gpu": 8, "vpc.amazonaws.com/efa": 32}


@pytest.mark.parametrize(("log", "code", "verdict"), [("p5-2node-efa.log", 0, "PASS  NCCL all-reduce over efa"),
                                                       ("p5-2node-socket.log", 1, "FAIL  NCCL all-reduce over socket: "
                                                                                  "EFA not used")])
def test_nccl_validation_reads_the_launcher_log(kube, log, code, verdict):
    def mpi_operator(job):
        time.sleep(1.0)   # the operator makes the launcher a moment later
        name = job["metadata"]["name"]
        pod = f"{name}-launcher"
        kube.route(f"get /api/v1/namespaces/default/pods/{pod}/log", (NCCL / log).read_bytes())
        kube.create("/api/v1/namespaces/default/pods", {
            "apiVersion": "v1", "kind": "Pod", "metadata": {"name": pod, "namespace": "default", "labels": {
                "training.kubeflow.org/job-name": name, "training.kubeflow.org/job-role": "launcher"}},
            "spec": {"containers": [{"name": "launcher", "image": "x"}]}, "status": {"phase": "Succeeded"}})
    t = play(kube, "/mpijobs", mpi_operator)
    r = run_cli("cluster", "validate", "nccl", "--nodes", "2", "--instance-type", "p5.48xlarge", "--poll", "0.2",
                env=kube.env, timeout=60)
    t.join()
    assert r.returncode == code, r.stderr
    assert verdict in r.stdout
    assert r.stderr.splitlines() == ["waiting for nccl-tests on 2 nodes: launcher not created yet (0 s of 1800)"]
    assert "17179869184 B  busbw   284.03" in r.stdout or log != "p5-2node-efa.log"
    assert any(m == "DELETE" and "/mpijobs/fsdpkit-nccl-" in p for m, p, _ in kube.requests())
