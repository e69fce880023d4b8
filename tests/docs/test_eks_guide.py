"""docs/eks.md as one path: its command lines run as written, in order, against a cluster that
starts as EKS gives it (nodes, no operator: kmock serves a job kind only once its CRD is created)
and moto for AWS (tests/cluster_world.py). The `cluster addons install` lines run the upstream
installs (kubectl and helm stand-ins create the operators' own CRDs and controllers), and every
later step must find what it uses: the NCCL check its MPIJob kind, the example its PyTorchJob kind,
the team's quota Kueue's API (`cluster team --apply` after `addons install --only kueue`). Lines that
create cloud resources run as dry runs, as in the skills' walk: both provisioning paths' `cluster
create` and the Karpenter NodePool (applied to kmock in tests/aws/test_karpenter.py)."""

from __future__ import annotations

import re
import shutil
import subprocess

import pytest
from cluster_world import World, cluster_world, line_argv
from doc_commands import command_lines

from conftest import ROOT, require, run_cli

pytestmark = pytest.mark.slow
require("kmock")
require("moto.server")

GUIDE = ROOT / "docs" / "eks.md"
LINES = command_lines(GUIDE)
# What a line ends with other than success: (exit code, a piece of what it says).
EXPECT = {
    # The EKS cluster is found by name in moto, but its API endpoint is in no network reachable here.
    r"^fsdpkit cluster check --eks-cluster": (3, "cannot reach the Kubernetes API"),
}


def walk(world: World, lines: list[str]) -> list[tuple[str, subprocess.CompletedProcess]]:
    """Each line run in a reader's folder (a fresh clone's examples, under git), in order, up to
    and including the first that ends otherwise than the guide says."""
    folder = world.root / "reader"
    shutil.copytree(ROOT / "examples", folder / "examples")
    for git in (["init", "-q"], ["add", "-A"], ["-c", "user.email=a@b", "-c", "user.name=a", "commit", "-qm", "x"]):
        subprocess.run(["git", *git], cwd=folder, check=True, capture_output=True)
    (world.volume / "llama3-8b" / "checkpoints").mkdir(parents=True)   # the job's, on its claim
    ran = []
    for line in lines:
        world.settle()
        # `cluster check --fix` asks before each remedy: the reader following the guide says yes.
        r = run_cli(*line_argv(line), cwd=folder, env=world.env, timeout=600, stdin="y\n" * 10)
        ran.append((line, r))
        code, says = next((v for rx, v in EXPECT.items() if re.search(rx, line)), (0, ""))
        if r.returncode != code or says not in r.stdout + r.stderr:
            break
    return ran


def created(world: World, plural: str) -> list[str]:
    """Names of the objects of a kind the API server was asked to create (not as a dry run)."""
    return [(body.get("metadata") or {}).get("name") for method, path, body in world.kube.requests()
            if method == "POST" and "dryRun" not in path and path.split("?")[0].endswith(f"/{plural}")
            and isinstance(body, dict)]


def test_the_eks_guide_runs_in_order_on_a_bare_cluster_and_each_step_finds_what_an_earlier_one_installed(
        tmp_path):
    with cluster_world(tmp_path, operators=False) as world:
        ran = walk(world, LINES)
        last, r = ran[-1]
        assert len(ran) == len(LINES), f"docs/eks.md: `{last}` exited {r.returncode}:\n{r.stdout[-1500:]}\n" \
                                       f"{r.stderr[-2000:]}"
        # The upstream installs, in the guide's order: `cluster addons install --etcd` (the default
        # components), `--only training-operator,mpi`, then the FSx CSI driver `cluster check --fix`
        # offered and the reader said yes to.
        assert world.installs() == [
            "kubectl apply --server-side -k https://github.com/kubeflow/trainer.git/manifests/overlays/manager?ref=v2.3.0",
            "kubectl -n kubeflow-system wait --for=condition=Available --timeout=300s "
            "deployment/kubeflow-trainer-controller-manager",
            "kubectl apply --server-side -k https://github.com/kubeflow/trainer.git/manifests/overlays/runtimes?ref=v2.3.0",
            "helm repo add kuberay https://ray-project.github.io/kuberay-helm/",
            "helm upgrade --install kuberay-operator kuberay/kuberay-operator --version 1.4.2",
            "kubectl apply --server-side -k github.com/kubeflow/training-operator.git/manifests/overlays/standalone"
            "?ref=v1.9.2",
            "kubectl apply --server-side -f https://raw.githubusercontent.com/kubeflow/mpi-operator/v0.6.0/deploy/v2beta1/"
            "mpi-operator.yaml",
            "helm repo add aws-fsx-csi-driver https://kubernetes-sigs.github.io/aws-fsx-csi-driver",
            "helm upgrade --install aws-fsx-csi-driver aws-fsx-csi-driver/aws-fsx-csi-driver --namespace kube-system",
            "kubectl apply --server-side -f https://github.com/kubernetes-sigs/kueue/releases/download/v0.19.2/"
            "manifests.yaml"]
        # The team's quota, applied once Kueue was there, then found by `cluster check --team`.
        assert created(world, "clusterqueues") == ["hyperpod-ns-ml-clusterqueue"]
        assert created(world, "localqueues") == ["hyperpod-ns-ml-localqueue"]
        # What the later steps created with what was installed: the NCCL check's MPIJob, the
        # example's PyTorchJob (by deploy, then again by job submit --replace), fsdpkit's Trainer runtime.
        assert len(created(world, "mpijobs")) == 1
        assert created(world, "pytorchjobs") == ["llama3-8b", "llama3-8b"]
        assert "fsdpkit-torch" in created(world, "clustertrainingruntimes")


def test_without_the_guide_s_operator_install_the_nccl_check_is_the_step_that_stops(tmp_path):
    """The walk can fail: the guide with its `--only training-operator,mpi` line left out stops at
    the NCCL check, which names the install it lacks."""
    lines = [line for line in LINES if "--only training-operator,mpi" not in line]
    assert len(lines) == len(LINES) - 1
    with cluster_world(tmp_path, operators=False) as world:
        ran = walk(world, lines)
    last, r = ran[-1]
    assert last == "fsdpkit cluster validate nccl --nodes 2 --instance-type p5.48xlarge"
    assert r.returncode == 3 and r.stderr.strip().endswith(
        "the MPIJob CRD (kubeflow.org/v2beta1) is not installed; run `fsdpkit cluster addons install --only mpi` "
        "(the MPI operator runs nccl-tests)"), r.stderr
    assert len(r.stderr.strip().splitlines()) == 1
