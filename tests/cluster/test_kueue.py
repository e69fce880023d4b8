"""Teams on a shared cluster through Kueue (HyperPod task governance's shape): the objects
`fsdpkit cluster team` renders, validated against Kueue's CRDs with their CEL rules and read back
by kubectl; Kueue's verdicts read from its own conditions; `cluster check --team` showing the team's
quota, use, borrowing and lending, and how the GPU nodes come (Karpenter or node groups), against
kmock holding what Kueue and Karpenter would."""

from __future__ import annotations

import json

import pytest

from fsdpkit import yamlfile
from fsdpkit.cluster import kueue

from conftest import cli_here, require
from kube_objects import healthy_eks, node
from manifest_schemas import kubectl_reads, validate_object

TEAM = ["cluster", "team", "--name", "ml", "--instance-type", "p5.48xlarge", "--nodes", "2", "--cohort", "research",
        "--borrow-nodes", "2", "--lend-nodes", "1", "--priority", "training=100", "--priority", "inference=1000"]


def team_objects():
    r = cli_here(*TEAM, "--json")
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)["data"]["manifests"]


def test_a_team_s_kueue_objects_validate_against_kueue_s_crds_and_read_back_as_meant():
    objs = team_objects()
    assert [(o["kind"], o["metadata"]["name"]) for o in objs] == [
        ("Namespace", "hyperpod-ns-ml"), ("ResourceFlavor", "p5.48xlarge"),
        ("ClusterQueue", "hyperpod-ns-ml-clusterqueue"), ("LocalQueue", "hyperpod-ns-ml-localqueue"),
        ("WorkloadPriorityClass", "training"), ("WorkloadPriorityClass", "inference")]
    for obj in objs:
        assert validate_object(obj) == [], obj["kind"]
    assert kubectl_reads(yamlfile.dump_all(objs)) == objs
    cq = objs[2]["spec"]
    # Two p5 nodes' worth of every resource a training pod requests, each lendable and borrowable in nodes.
    assert cq["resourceGroups"] == [{
        "coveredResources": ["cpu", "memory", "nvidia.com/gpu", "vpc.amazonaws.com/efa"],
        "flavors": [{"name": "p5.48xlarge", "resources": [
            {"name": "cpu", "nominalQuota": "384", "borrowingLimit": "384", "lendingLimit": "192"},
            {"name": "memory", "nominalQuota": "4096Gi", "borrowingLimit": "4096Gi", "lendingLimit": "2048Gi"},
            {"name": "nvidia.com/gpu", "nominalQuota": "16", "borrowingLimit": "16", "lendingLimit": "8"},
            {"name": "vpc.amazonaws.com/efa", "nominalQuota": "64", "borrowingLimit": "64", "lendingLimit": "32"}]}]}]
    assert (cq["cohortName"], cq["preemption"]) == ("research", {"withinClusterQueue": "LowerPriority",
                                                                 "reclaimWithinCohort": "Any"})
    assert cq["namespaceSelector"] == {"matchLabels": {"kubernetes.io/metadata.name": "hyperpod-ns-ml"}}
    assert objs[1]["spec"] == {"nodeLabels": {"node.kubernetes.io/instance-type": "p5.48xlarge"}}
    assert [(o["value"]) for o in objs[4:]] == [100, 1000]


def test_job_init_for_the_team_lands_in_its_namespace_and_queue_at_its_priority(tmp_path):
    from fsdpkit.jobs.resolved import load_job

    out = tmp_path / "job.yaml"
    r = cli_here("job", "init", "--backend", "pytorchjob", "--team", "ml", "--priority", "training",
                 "--instance-type", "p5.48xlarge", "--nodes", "2", "--image", "img:1", "--out", str(out))
    assert r.returncode == 0, r.stderr
    spec = load_job(out).spec
    assert (spec.namespace, spec.queue, spec.priority_class) == (
        "hyperpod-ns-ml", "hyperpod-ns-ml-localqueue", "training")
    assert "# team ml: its quota and use: `fsdpkit cluster check --team ml`" in out.read_text()
    for args, message in ((["--priority", "training"], "--priority: a Kueue priority needs --team"),
                          (["--team", "ml"], "--team: a team's quota is a Kueue queue on Kubernetes")):
        r = cli_here("job", "init", *args, "--out", "-")
        assert r.returncode == 2 and r.stderr.startswith(f"error: {message}"), r.stderr


@pytest.mark.parametrize(("args", "message"), [
    (["--borrow-nodes", "1"], "--borrow-nodes: borrowing and lending are within a cohort; give --cohort"),
    (["--cohort", "c", "--lend-nodes", "3"], "--lend-nodes: 3 is more than the team's 2"),
    (["--priority", "high"], "--priority: 'high' is not NAME=VALUE"),
    (["--priority", "High=1"], "--priority: 'High' is not a Kubernetes name"),
])
def test_a_team_kueue_would_refuse_is_refused_naming_the_flag(args, message):
    r = cli_here("cluster", "team", "--name", "ml", "--instance-type", "p5.48xlarge", "--nodes", "2", *args)
    assert r.returncode == 2 and r.stderr.startswith(f"error: {message}"), r.stderr
    r = cli_here("cluster", "team", "--name", "ML_team", "--instance-type", "p5.48xlarge", "--nodes", "2")
    assert r.stderr.startswith("error: --name: 'ML_team' makes namespace 'hyperpod-ns-ML_team', not a Kubernetes name")


@pytest.mark.parametrize(("conditions", "state"), [
    ([], "unanswered"),
    ([{"type": "QuotaReserved", "status": "True", "message": "Quota reserved in ClusterQueue q"},
      {"type": "Admitted", "status": "True", "message": "The workload is admitted"}], "admitted"),
    ([{"type": "QuotaReserved", "status": "False", "reason": "Pending", "message":
       "couldn't assign flavors to pod set worker: insufficient unused quota for nvidia.com/gpu in flavor p5, 8 more "
       "needed"}], "queued"),
    ([{"type": "QuotaReserved", "status": "False", "reason": "Pending", "message":
       "couldn't assign flavors to pod set worker: insufficient quota for nvidia.com/gpu in flavor p5, previously "
       "considered podsets requests (8) + current podset request (8) > maximum capacity (8)"}], "never"),
])
def test_kueue_s_verdict_is_read_from_its_own_conditions(conditions, state):
    workload = {"metadata": {"name": "w"}, "status": {"conditions": conditions}}
    assert kueue.admission(workload).state == state
    assert kueue.admission(None).state == "unanswered"


CLUSTERQUEUES = "/apis/kueue.x-k8s.io/v1beta2/clusterqueues"


def _team_cluster(kube):
    """A cluster with the team's objects as `cluster team` renders them, Kueue's status on its
    ClusterQueue (8 of its 16 GPUs in use, 8 more borrowed from the cohort), and GPU nodes from a
    Karpenter NodePool beside a node group's."""
    for obj in team_objects():
        if obj["kind"] == "LocalQueue":
            kube.create(f"/apis/kueue.x-k8s.io/v1beta2/namespaces/{obj['metadata']['namespace']}/localqueues", obj)
        elif obj["kind"] == "ClusterQueue":
            obj["status"] = {"admittedWorkloads": 2, "pendingWorkloads": 1, "flavorsUsage": [
                {"name": "p5.48xlarge", "resources": [{"name": "nvidia.com/gpu", "total": "24", "borrowed": "8"},
                                                      {"name": "cpu", "total": "380", "borrowed": "0"}]}]}
            assert validate_object(obj) == []   # the status as Kueue writes it, against its CRD
            kube.create(CLUSTERQUEUES, obj)


def test_cluster_check_shows_the_team_s_quota_and_where_the_gpu_nodes_come_from(kube):
    require("kmock")
    healthy_eks(kube)
    kube.serve("karpenter.sh/v1/nodepools")
    from fsdpkit.aws.karpenter import NodePoolPlan, render

    pool = render(NodePoolPlan("llm", "us-west-2", "p5.48xlarge", 4, capacity_type="reserved",
                               capacity_reservation="cr-0123456789abcdef0"))[1]
    kube.create("/apis/karpenter.sh/v1/nodepools", pool)
    kube.create("/apis/karpenter.sh/v1/nodepools", render(NodePoolPlan("llm", "us-west-2", "g6e.12xlarge", 2))[1])
    kube.create("/api/v1/nodes", node("gpu-k", "p5.48xlarge", 8, 32, labels={"karpenter.sh/nodepool":
                                                                              "gpu-p5-48xlarge"}))
    _team_cluster(kube)
    r = cli_here("cluster", "check", "--team", "ml", "--json", env=kube.env)
    data = json.loads(r.stdout)["data"]
    checks = {c["name"]: c for c in data["checks"]}
    assert checks["GPU provisioning"] == {
        "name": "GPU provisioning", "status": "pass", "fix": "", "remedy": "", "backend": "",
        "detail": "Karpenter NodePool gpu-p5-48xlarge (p5.48xlarge; reserved; up to 32 GPUs): 1 node(s); managed "
                  "node group gpu: 2 node(s); Karpenter NodePool gpu-g6e-12xlarge (g6e.12xlarge; on-demand; up to 8 "
                  "GPUs): no nodes now; they come when GPU pods are pending"}
    assert checks["team ml"]["status"] == "pass"
    assert checks["team ml"]["detail"] == (
        "queue hyperpod-ns-ml/hyperpod-ns-ml-localqueue -> ClusterQueue hyperpod-ns-ml-clusterqueue (cohort "
        "research): cpu in p5.48xlarge: 380 used of 384, borrows up to 384, lends up to 192; memory in p5.48xlarge: "
        "0 used of 4096Gi, borrows up to 4096Gi, lends up to 2048Gi; nvidia.com/gpu in p5.48xlarge: 24 used of 16 "
        "(8 borrowed), borrows up to 16, lends up to 8; vpc.amazonaws.com/efa in p5.48xlarge: 0 used of 64, borrows "
        "up to 64, lends up to 32; 2 admitted, 1 pending")
    assert data["team"]["usage"][2] == {"flavor": "p5.48xlarge", "resource": "nvidia.com/gpu", "nominal": "16",
                                        "borrowing_limit": "16", "lending_limit": "8", "used": "24", "borrowed": "8"}
    # A team that has no queue here, and a team member who may not read the cluster-scoped ClusterQueue.
    r = cli_here("cluster", "check", "--team", "vision", "--json", env=kube.env)
    checks = {c["name"]: c for c in json.loads(r.stdout)["data"]["checks"]}
    assert (checks["team vision"]["status"], checks["team vision"]["detail"]) == (
        "fail", "no LocalQueue in namespace hyperpod-ns-vision")
    user = kube.user("ml-dev", [{"apiGroups": ["kueue.x-k8s.io"], "resources": ["localqueues"],
                                 "verbs": ["get", "list"]}], "hyperpod-ns-ml")
    r = cli_here("cluster", "check", "--team", "ml", "--json", env=user)
    checks = {c["name"]: c for c in json.loads(r.stdout)["data"]["checks"]}
    assert checks["team ml"]["status"] == "unread"
    assert checks["team ml"]["detail"].startswith(
        "LocalQueue hyperpod-ns-ml/hyperpod-ns-ml-localqueue -> ClusterQueue hyperpod-ns-ml-clusterqueue; its quota "
        'not read (clusterqueues.kueue.x-k8s.io is forbidden: User "ml-dev" cannot list resource "clusterqueues"')
