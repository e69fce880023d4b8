"""`fsdpkit cluster check` against kmock with scripted cluster states, and quantity parsing."""

from __future__ import annotations

import json
import os
from decimal import Decimal

import pytest

from fsdpkit.cluster.quantity import parse
from fsdpkit.errors import UserError

from conftest import require, run_cli
from kube_objects import daemonset, healthy_eks, hyperpod_operator, namespace_user, node, trainer_v2

require("kmock")


@pytest.mark.parametrize(("text", "value"), [
    ("100m", Decimal("0.1")), ("2", Decimal(2)), ("1.5", Decimal("1.5")), ("1.5Gi", Decimal(1610612736)),
    ("128974848", Decimal(128974848)), ("129e6", Decimal(129000000)), ("129E6", Decimal(129000000)),
    ("123Mi", Decimal(128974848)), ("1k", Decimal(1000)), ("1M", Decimal(10**6)), ("500u", Decimal("0.0005")),
    ("250n", Decimal("0.00000025")), ("2Ti", Decimal(2 * 2**40)), ("0.5Ki", Decimal(512)), (".5", Decimal("0.5")),
])
def test_every_quantity_format(text, value):
    assert parse(text) == value


def test_bad_quantity_is_refused():
    for bad in ("12 Gi", "Gi", "1.2.3", "1Gb", ""):
        with pytest.raises(UserError):
            parse(bad)














def check(kube):
    r = run_cli("cluster", "check", "--json", env=kube.env, timeout=60)
    envelope = json.loads(r.stdout)
    assert set(envelope) == {"ok", "data", "error"} and envelope["ok"] is (envelope["error"] is None)
    data = envelope["data"]
    return r.returncode, {c["name"]: c for c in data["checks"]}, {n["name"]: n for n in data["nodes"]}


def test_healthy_eks_gpu_cluster_passes(kube):
    healthy_eks(kube)
    code, checks, nodes = check(kube)
    assert code == 0, checks
    assert {k: c["status"] for k, c in checks.items()} == {
        "nodes ready": "pass", "GPU capacity": "pass", "GPU provisioning": "pass", "NVIDIA device plugin": "pass",
        "EFA device plugin": "pass", "Kubeflow Trainer v2": "warn", "Kubeflow training operator": "pass",
        "KubeRay operator": "warn", "FSx for Lustre": "pass"}
    # 16 GPUs, 8 held by the running pod (limits only), the Succeeded pod's 8 released.
    assert checks["GPU capacity"]["detail"] == "2 GPU node(s), 16 GPUs, 8 free"
    # Karpenter pools: tests/cluster/test_kueue.py.
    assert checks["GPU provisioning"]["detail"] == "managed node group gpu: 2 node(s)"
    assert nodes["gpu-a"]["allocated"] == {"cpu": "0.500", "memory": "1073741824", "nvidia.com/gpu": "8",
                                           "vpc.amazonaws.com/efa": "32"}
    assert nodes["gpu-b"]["allocated"] == {}
    assert Decimal(nodes["sys"]["allocatable"]["cpu"]) == Decimal("3.92")
    assert Decimal(nodes["gpu-a"]["allocatable"]["memory"]) == 2097152000 * 1024
    human = run_cli("cluster", "check", env=kube.env, timeout=60)
    assert human.returncode == 0 and "ready: 0 failed, 2 warning(s)" in human.stdout
    assert "8/8" in human.stdout and "0.5/191.45" in human.stdout


def test_a_namespace_user_gets_every_check_it_can_read_and_each_it_cannot_named(kube):
    """Nodes, DaemonSets, Deployments, CRDs and storage are cluster-wide reads a namespace's Role does
    not grant: each check that needs one is `unread`, naming the API server's refusal, never a verdict
    drawn from an empty list ("the cluster has no nodes"). Which job APIs exist comes from discovery."""
    healthy_eks(kube)
    user = namespace_user(kube, "team-a")
    r = run_cli("cluster", "check", "--json", env=user, timeout=60)
    assert r.returncode == 0, r.stdout
    data = json.loads(r.stdout)["data"]
    checks = {c["name"]: c for c in data["checks"]}
    assert {k: c["status"] for k, c in checks.items()} == {
        "nodes": "unread", "NVIDIA device plugin": "unread", "EFA device plugin": "unread",
        "Kubeflow Trainer v2": "warn", "Kubeflow training operator": "unread", "KubeRay operator": "warn",
        "FSx for Lustre": "unread"}
    forbidden = 'is forbidden: User "team-a-ci" cannot list resource'
    assert checks["nodes"]["detail"] == (f'not read (nodes: nodes {forbidden} "nodes" in API group "" at the cluster '
                                         "scope)")
    assert checks["Kubeflow training operator"]["detail"] == (
        "CRD pytorchjobs.kubeflow.org served; its controller not read (deployments: deployments.apps "
        f'{forbidden} "deployments" in API group "apps" at the cluster scope)')
    assert checks["Kubeflow Trainer v2"]["detail"] == "CRD trainjobs.trainer.kubeflow.org not installed"
    assert (data["backends"], data["nodes"]) == (["pytorchjob"], [])
    human = run_cli("cluster", "check", env=user, timeout=60)
    assert human.returncode == 0
    assert human.stdout.strip().endswith("ready as far as this user can read: 0 failed, 2 warning(s), 5 not read")
    assert "GAP   nodes: not read (nodes: nodes is forbidden" in human.stdout


def test_static_manifest_plugin_labels_are_recognised(kube):
    healthy_eks(kube, gpu_plugin_labels={"name": "nvidia-device-plugin-ds"})
    code, checks, _ = check(kube)
    assert code == 0 and checks["NVIDIA device plugin"]["status"] == "pass"


def test_hyperpod_cluster_with_an_unhealthy_node_fails_that_line(kube):
    healthy_eks(kube, hyperpod_labels=[
        {"sagemaker.amazonaws.com/node-health-status": "Schedulable",
         "sagemaker.amazonaws.com/deep-health-check-status": "Passed"},
        {"sagemaker.amazonaws.com/node-health-status": "UnschedulablePendingReplacement",
         "sagemaker.amazonaws.com/deep-health-check-status": "InProgress"}])
    code, checks, _ = check(kube)
    assert code == 1
    assert checks["HyperPod health gpu-a"]["status"] == "pass"
    assert checks["HyperPod health gpu-b"]["status"] == "fail"
    assert checks["HyperPod health gpu-b"]["detail"] == "UnschedulablePendingReplacement"
    assert checks["deep health check gpu-a"]["status"] == "pass"
    assert checks["deep health check gpu-b"]["status"] == "warn"
    assert checks["NVIDIA device plugin"]["status"] == "pass"


def test_cluster_without_a_job_operator_fails_with_trainer_v2_s_install(kube):
    healthy_eks(kube, operator=False)
    code, checks, _ = check(kube)
    assert code == 1
    c = checks["Kubeflow Trainer v2"]
    assert c["status"] == "fail" and c["detail"] == "CRD trainjobs.trainer.kubeflow.org not installed"
    assert "kubeflow/trainer.git/manifests/overlays/manager?ref=v2.3.0" in c["fix"]
    assert checks["Kubeflow training operator"]["status"] == "warn"


def envelope(kube):
    r = run_cli("cluster", "check", "--json", env=kube.env, timeout=60)
    return r.returncode, json.loads(r.stdout)["data"]


def test_which_job_operators_run_and_the_backend_they_make_the_default(kube):
    healthy_eks(kube, operator=False)
    trainer_v2(kube, runtimes=("torch-distributed", "fsdpkit-torch"))
    code, data = envelope(kube)
    checks = {c["name"]: c for c in data["checks"]}
    assert code == 0, checks
    assert checks["Kubeflow Trainer v2"]["status"] == "pass"
    assert checks["Kubeflow Trainer v2"]["detail"].endswith("runtimes: fsdpkit-torch, torch-distributed")
    # The legacy operator is not missing where Trainer v2 runs, and not offered as a fix.
    legacy = checks["Kubeflow training operator"]
    assert legacy["status"] == "warn" and "legacy" in legacy["detail"] and legacy["remedy"] == ""
    assert "HyperPod training operator" not in checks  # not a HyperPod cluster
    assert (data["backends"], data["default_backend"]) == (["trainjob"], "trainjob")
    assert data["operators"] == {"hyperpod": False, "trainjob": True, "pytorchjob": False}


def test_a_trainer_older_than_fsdpkit_s_trainjobs_need_fails_naming_both_releases(kube):
    healthy_eks(kube, operator=False)
    trainer_v2(kube, version="v2.1.0")
    code, data = envelope(kube)
    c = {c["name"]: c for c in data["checks"]}["Kubeflow Trainer v2"]
    assert code == 1 and c["status"] == "fail" and c["fix"].startswith("install it: kubectl apply --server-side")
    assert c["detail"] == ("CRD trainjobs.trainer.kubeflow.org; controller kubeflow-system/kubeflow-trainer-controller-"
                           "manager available (1); release v2.1.0, but fsdpkit's TrainJobs need Kubeflow Trainer >= "
                           "v2.3.0 (runtimePatches with the pod's grace period)")
    assert data["backends"] == [] and data["operators"]["trainjob"] is False


def test_trainer_v2_without_jobset_fails(kube):
    healthy_eks(kube)
    trainer_v2(kube, jobset=False)
    code, data = envelope(kube)
    c = {c["name"]: c for c in data["checks"]}["Kubeflow Trainer v2"]
    assert code == 1 and c["status"] == "fail" and "jobsets.jobset.x-k8s.io is not installed" in c["detail"]
    assert data["backends"] == ["pytorchjob"]


def test_a_hyperpod_cluster_reports_its_training_operator(kube):
    labels = {"sagemaker.amazonaws.com/node-health-status": "Schedulable"}
    healthy_eks(kube, operator=False, hyperpod_labels=[labels, labels])
    code, data = envelope(kube)
    checks = {c["name"]: c for c in data["checks"]}
    assert code == 1 and checks["HyperPod training operator"]["status"] == "fail"
    assert "amazon-sagemaker-hyperpod-training-operator" in checks["HyperPod training operator"]["fix"]
    assert checks["Kubeflow Trainer v2"]["status"] == "warn" and data["backends"] == []
    hyperpod_operator(kube)
    code, data = envelope(kube)
    checks = {c["name"]: c for c in data["checks"]}
    assert code == 0 and checks["HyperPod training operator"]["status"] == "pass"
    assert "aws-hyperpod/hp-training-operator-hp-training-controller-manager" in \
        checks["HyperPod training operator"]["detail"]
    assert data["default_backend"] == "hyperpod"
    assert data["operators"] == {"hyperpod": True, "trainjob": False, "pytorchjob": False}


def test_gpu_plugin_missing_fails_and_no_gpus_are_seen(kube):
    kube.create("/api/v1/nodes", node("gpu-a", "p5.48xlarge"))  # no plugin: no nvidia.com/gpu advertised
    code, checks, _ = check(kube)
    assert code == 1
    assert checks["NVIDIA device plugin"]["status"] == "fail"
    assert "k8s-device-plugin" in checks["NVIDIA device plugin"]["fix"]
    assert checks["GPU capacity"]["status"] == "warn"


def test_a_plugin_with_unready_pods_and_a_notready_node_fail(kube):
    kube.create("/api/v1/nodes", node("gpu-a", "g5.12xlarge", 4, 1, ready=False))
    kube.create("/apis/apps/v1/namespaces/kube-system/daemonsets",
                daemonset("nvidia-device-plugin-daemonset", "gpu-operator", {"app": "nvidia-device-plugin-daemonset"},
                          ready=0, desired=1))
    code, checks, _ = check(kube)
    assert code == 1
    assert checks["nodes ready"]["status"] == "fail" and "gpu-a" in checks["nodes ready"]["detail"]
    assert checks["NVIDIA device plugin"]["detail"] == "gpu-operator/nvidia-device-plugin-daemonset: 0/1 pods ready"


def test_fix_asks_before_running_and_says_what_it_cannot_run(kube, tmp_path):
    """A cluster with no job operator: --fix offers Trainer v2, upstream's way, never silently."""
    healthy_eks(kube, operator=False)
    # A kubectl that records its arguments, so the test sees what --fix ran and when.
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    log = tmp_path / "kubectl.log"
    (bin_dir / "kubectl").write_text(f'#!/bin/sh\nprintf "%s\\n" "$*" >> {log}\n')
    (bin_dir / "kubectl").chmod(0o755)
    env = {**kube.env, "PATH": f"{bin_dir}:/usr/bin:/bin"}
    import subprocess
    import sys

    from conftest import ROOT

    def run(answer):
        return subprocess.run([sys.executable, "-m", "fsdpkit", "cluster", "check", "--fix"], input=answer,
                              capture_output=True, text=True, cwd=ROOT, env={**os.environ, **env},
                              timeout=60)
    # Nobody to answer (a script, an agent: stdin closed): nothing runs, and it says how to run it.
    r = run("")
    assert r.returncode == 1 and r.stderr == ""
    assert "  not run: no answer on stdin; add --yes to run the remedies without asking" in r.stdout.splitlines()
    assert not log.exists()
    r = run("n\n")
    assert r.returncode == 1
    assert "--fix Kubeflow Trainer v2:" in r.stdout and "skipped" in r.stdout
    assert "--fix Kubeflow training operator:" not in r.stdout
    assert not log.exists()  # nothing ran without a yes
    r = run("y\n")
    assert "done; run `fsdpkit cluster check` again" in r.stdout
    assert log.read_text().splitlines() == [
        "apply --server-side -k https://github.com/kubeflow/trainer.git/manifests/overlays/manager?ref=v2.3.0",
        "-n kubeflow-system wait --for=condition=Available --timeout=300s "
        "deployment/kubeflow-trainer-controller-manager",
        "apply --server-side -k https://github.com/kubeflow/trainer.git/manifests/overlays/runtimes?ref=v2.3.0"]
    # KubeRay (a warning here) is offered too, but its remedy needs helm, which this PATH lacks.
    assert "--fix KubeRay operator:" in r.stdout and "cannot run it here: helm is not installed" in r.stdout


def test_missing_context_and_expired_token_are_one_line(kube):
    r = run_cli("cluster", "check", "--context", "nope", env=kube.env)
    assert r.returncode == 3
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "nope" in lines[0] and "kubectl config get-contexts" in lines[0]
    # An expired EKS token: the API server answers 401 Unauthorized.
    kube.route("get /api/v1/nodes", lambda: (_ for _ in ()).throw(
        __import__("kmock").KubernetesError(status=401, reason="Unauthorized", message="Unauthorized")))
    r = run_cli("cluster", "check", env=kube.env)
    assert r.returncode == 3
    assert r.stderr.strip() == ("error: listing nodes: the cluster refused (401 Unauthorized): Unauthorized; check "
                                "your kubeconfig credentials and RBAC permissions")
