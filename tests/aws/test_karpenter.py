"""GPU capacity through Karpenter: the NodePool and EC2NodeClass `fsdpkit cluster nodepool` renders,
validated against Karpenter's own CRDs (strict, with their CEL rules evaluated as the API server
evaluates them) and read back by kubectl; the eksctl ClusterConfig that installs Karpenter, against
eksctl's schema; applied to a cluster (kmock) once, asked for first."""

from __future__ import annotations

import copy
import json

import pytest

from fsdpkit import yamlfile
from fsdpkit.aws.karpenter import NodePoolPlan, render
from fsdpkit.cluster import pod_rules
from fsdpkit.cluster.kueue import node_quota
from fsdpkit.errors import UserError
from fsdpkit.hardware.instances import INSTANCES, lookup
from fsdpkit.jobs.backends import get_backend
from fsdpkit.jobs.resolved import load_job

from conftest import cli_here, require
from job_specs import write_spec
from manifest_schemas import cel_errors, crd_schema, eksctl_validator, kubectl_reads, validate_object

CR = "cr-0123456789abcdef0"
GPU_TYPES = sorted(n for n, i in INSTANCES.items() if i.accelerators)


@pytest.mark.parametrize("capacity", ["on-demand", "reserved-id", "reserved-tag"])
def test_every_gpu_instance_type_s_pool_validates_against_karpenter_s_crds_with_their_cel_rules(capacity):
    """Every GPU instance type of the catalog, each way to buy it: both objects pass the CRD's
    structural schema (unknown fields refused) and every CEL rule of it (none left unevaluated), and
    kubectl reads them back as they were meant."""
    extra = {"on-demand": {}, "reserved-id": {"capacity_type": "reserved", "capacity_reservation": CR},
             "reserved-tag": {"capacity_type": "reserved", "capacity_reservation_tag": "team=llm"}}[capacity]
    for name in GPU_TYPES:
        objs = render(NodePoolPlan("llm", "us-west-2", name, 2, **extra))
        assert [o["kind"] for o in objs] == ["EC2NodeClass", "NodePool"]
        for obj in objs:
            assert validate_object(obj) == [], (name, obj["kind"])
        assert kubectl_reads(yamlfile.dump_all(objs)) == objs


def test_a_p5_pool_on_a_capacity_block_carries_the_accelerated_ami_every_efa_and_never_disrupts_training():
    node_class, pool = render(NodePoolPlan("llm", "us-west-2", "p5.48xlarge", 4, zone="us-west-2c",
                                           capacity_type="reserved", capacity_reservation=CR,
                                           placement_group="llm-gpu"))
    spec = node_class["spec"]
    assert spec["amiFamily"] == "AL2023" and spec["amiSelectorTerms"] == [
        {"ssmParameter": "/aws/service/eks/optimized-ami/1.33/amazon-linux-2023/x86_64/nvidia/recommended/image_id"}]
    assert spec["instanceProfile"] == "eksctl-KarpenterNodeInstanceProfile-llm"
    assert spec["subnetSelectorTerms"] == spec["securityGroupSelectorTerms"] == [
        {"tags": {"karpenter.sh/discovery": "llm"}}]
    assert spec["capacityReservationSelectorTerms"] == [{"id": CR}]
    assert spec["placementGroupSelector"] == {"name": "llm-gpu"}
    # 32 network cards, an EFA on each, as EC2's User Guide lays them out ("Maximize network bandwidth
    # on Amazon EC2 instances with multiple network cards": the primary ENA interface at card 0, device
    # 0; an EFA-only interface at card 0, device 1; an EFA-only interface at device 0 of every other
    # card; its example requests 32 EFA devices and one ENA device).
    interfaces = spec["networkInterfaces"]
    assert [(i["networkCardIndex"], i["deviceIndex"], i["interfaceType"]) for i in interfaces] == [
        (0, 0, "interface"), (0, 1, "efa-only"), *((card, 0, "efa-only") for card in range(1, 32))]
    assert spec["blockDeviceMappings"][0]["ebs"]["volumeSize"] == "500Gi"
    template = pool["spec"]["template"]
    assert template["spec"]["requirements"] == [
        {"key": "node.kubernetes.io/instance-type", "operator": "In", "values": ["p5.48xlarge"]},
        {"key": "karpenter.sh/capacity-type", "operator": "In", "values": ["reserved"]},
        {"key": "topology.kubernetes.io/zone", "operator": "In", "values": ["us-west-2c"]}]
    assert template["spec"]["taints"] == [{"key": "nvidia.com/gpu", "effect": "NoSchedule"}]
    assert template["spec"]["expireAfter"] == "Never"
    assert template["metadata"]["labels"] == {"fsdpkit.dev/pool": "gpu", "fsdpkit.dev/efa-interfaces": "32"}
    # Only empty nodes are consolidated; drift replaces none; 4 nodes x 8 GPUs at most.
    assert pool["spec"]["disruption"] == {"consolidationPolicy": "WhenEmpty", "consolidateAfter": "10m",
                                          "budgets": [{"nodes": "0", "reasons": ["Drifted"]}]}
    assert pool["spec"]["limits"] == {"nvidia.com/gpu": "32"}


def test_a_node_has_the_efa_devices_its_label_its_team_s_quota_and_a_job_s_pods_count(tmp_path):
    """For every instance type with several network cards: the EFA devices its EC2NodeClass gives a
    node (one per card) are what the NodePool's label says, what a team's Kueue quota counts per
    node and what a job's pods ask for; a pod asking for one more than the node has never fits."""
    several = [n for n in GPU_TYPES if INSTANCES[n].efa > 1]
    assert "p5.48xlarge" in several
    for name in several:
        node_class, pool = render(NodePoolPlan("llm", "us-west-2", name, 2))
        devices = sum(i["interfaceType"] == "efa-only" for i in node_class["spec"]["networkInterfaces"])
        label = int(pool["spec"]["template"]["metadata"]["labels"]["fsdpkit.dev/efa-interfaces"])
        quota = node_quota(lookup(name))["vpc.amazonaws.com/efa"]
        job = load_job(write_spec(tmp_path, instance_type=name, devices="extended"))
        pods = {int(c["resources"]["requests"]["vpc.amazonaws.com/efa"])
                for _, t in pod_rules.templates(get_backend("pytorchjob").render(job).objects()[-1])
                for c in t["spec"]["containers"]}
        assert (devices, label, quota, pods) == (INSTANCES[name].efa,) * 3 + ({INSTANCES[name].efa},), name
    assert INSTANCES["p5.48xlarge"].efa == 32


def test_single_card_and_trainium_pools():
    (g6, _), (trn, trn_pool) = (render(NodePoolPlan("llm", "us-west-2", t, 1)) for t in ("g6e.12xlarge",
                                                                                       "trn1.32xlarge"))
    assert "networkInterfaces" not in g6["spec"]          # one card: the default interface carries EFA
    assert trn["spec"]["amiSelectorTerms"][0]["ssmParameter"].endswith("/neuron/recommended/image_id")
    assert trn_pool["spec"]["limits"] == {"aws.amazon.com/neuron": "16"}
    assert trn_pool["spec"]["template"]["spec"]["taints"] == [{"key": "aws.amazon.com/neuron", "effect": "NoSchedule"}]


def test_the_cel_rules_are_evaluated_so_a_broken_node_class_fails():
    """The rules are really run: a node class naming both a role and an instance profile, or no
    primary interface, is what the API server refuses."""
    node_class, _ = render(NodePoolPlan("llm", "us-west-2", "p5.48xlarge", 1))
    schema = crd_schema("karpenter.k8s.aws_ec2nodeclasses.yaml")
    both = copy.deepcopy(node_class)
    both["spec"]["role"] = "KarpenterNodeRole-llm"
    assert cel_errors(schema, both) == [".spec: must specify exactly one of ['role', 'instanceProfile']"]
    no_primary = copy.deepcopy(node_class)
    no_primary["spec"]["networkInterfaces"][0]["interfaceType"] = "efa-only"
    assert cel_errors(schema, no_primary)[0] == (
        ".spec.networkInterfaces: networkInterfaces must include a primary interface with interfaceType='interface'")


@pytest.mark.parametrize(("extra", "message"), [
    ({"capacity_type": "reserved"}, "capacity_type: reserved needs --capacity-reservation"),
    ({"capacity_reservation": CR}, "capacity_type: a capacity reservation is used by reserved capacity"),
    ({"capacity_type": "reserved", "capacity_reservation": CR, "capacity_reservation_tag": "a=b"},
     "capacity_reservation_tag: give a reservation by id or by tag, not both"),
    ({"capacity_type": "reserved", "capacity_reservation_tag": "novalue"}, "capacity_reservation_tag: 'novalue' is "
                                                                           "not KEY=VALUE"),
    ({"capacity_type": "reserved", "capacity_reservation": "cr-1"}, "capacity_reservation: 'cr-1' is not a "
                                                                    "reservation id"),
    ({"capacity_type": "spot"}, "capacity_type: 'spot' is not one of on-demand, reserved"),
    ({"zone": "eu-west-1a"}, "zone: 'eu-west-1a' is not an availability zone of us-west-2"),
    ({"instance_type": "ml.p5.48xlarge"}, "instance_type: 'ml.p5.48xlarge' is a SageMaker HyperPod type"),
])
def test_a_pool_karpenter_or_ec2_would_refuse_is_refused_naming_the_field(extra, message):
    plan = {"cluster": "llm", "region": "us-west-2", "instance_type": "p5.48xlarge", "nodes": 2, **extra}
    with pytest.raises(UserError, match="^" + message.replace("(", r"\(").replace(")", r"\)")):
        render(NodePoolPlan(**plan))


def test_the_karpenter_cluster_config_installs_karpenter_and_leaves_gpu_nodes_to_the_pool(tmp_path):
    out = tmp_path / "cluster.yaml"
    r = cli_here("cluster", "config", "--name", "llm", "--region", "us-west-2", "--instance-type", "p5.48xlarge",
                 "--nodes", "2", "--provisioner", "karpenter", "--out", str(out))
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == (f"wrote {out}; next: fsdpkit cluster create --config {out}, then the GPU NodePool: "
                                "fsdpkit cluster nodepool --name llm --region us-west-2 --instance-type p5.48xlarge "
                                "--nodes 2")
    config = yamlfile.load(out.read_text())
    assert not list(eksctl_validator().iter_errors(config))
    assert config["karpenter"] == {"version": "1.8.1"}
    assert config["metadata"]["tags"]["karpenter.sh/discovery"] == "llm"
    assert [g["name"] for g in config["managedNodeGroups"]] == ["system"]
    r = cli_here("cluster", "config", "--name", "llm", "--region", "us-west-2", "--instance-type", "p5.48xlarge",
                 "--nodes", "2", "--provisioner", "karpenter", "--capacity-reservation", CR, "--zone", "us-west-2a")
    assert (r.returncode, r.stderr) == (2, "error: --capacity-reservation: with --provisioner karpenter the GPU nodes' "
                                           "capacity is the NodePool's: give it to `fsdpkit cluster nodepool "
                                           "--capacity-reservation ...`\n")


NODEPOOL = ["cluster", "nodepool", "--name", "llm", "--region", "us-west-2", "--instance-type", "p5.48xlarge",
            "--nodes", "2", "--capacity-type", "reserved", "--capacity-reservation-tag", "team=llm"]


def test_nodepool_asks_first_applies_once_and_its_dry_run_sends_nothing(kube):
    require("kmock")
    kube.serve("karpenter.sh/v1/nodepools")
    kube.serve("karpenter.k8s.aws/v1/ec2nodeclasses")
    dry = cli_here(*NODEPOOL, "--dry-run", env=kube.env)
    assert dry.returncode == 0 and [o["kind"] for o in kubectl_reads(dry.stdout)] == ["EC2NodeClass", "NodePool"]
    unasked = cli_here(*NODEPOOL, env=kube.env)
    assert (unasked.returncode, unasked.stderr) == (
        2, "error: create: makes EC2NodeClass/gpu-p5-48xlarge, NodePool/gpu-p5-48xlarge, which can cost money; add "
           "--yes to confirm\n")
    assert [m for m, _, _ in kube.requests() if m == "POST"] == []
    r = cli_here(*NODEPOOL, "--yes", "--json", env=kube.env)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["data"]["applied"] == [
        {"object": "EC2NodeClass/gpu-p5-48xlarge", "action": "created"},
        {"object": "NodePool/gpu-p5-48xlarge", "action": "created"}]
    posts = [(p.split("?")[0], body) for m, p, body in kube.requests() if m == "POST"]
    assert [p for p, _ in posts] == ["/apis/karpenter.k8s.aws/v1/ec2nodeclasses", "/apis/karpenter.sh/v1/nodepools"]
    assert posts[0][1]["spec"]["capacityReservationSelectorTerms"] == [{"tags": {"team": "llm"}}]
    again = cli_here(*NODEPOOL, "--yes", env=kube.env)
    assert again.returncode == 0
    assert again.stdout.splitlines() == ["EC2NodeClass/gpu-p5-48xlarge: unchanged",
                                         "NodePool/gpu-p5-48xlarge: unchanged"]
    assert len([m for m, _, _ in kube.requests() if m == "POST"]) == 2
    assert not [m for m, _, _ in kube.requests() if m == "PATCH"]
    # Asked again with 4 nodes: the pool's GPU limit becomes 32 (it once stayed at 16, "exists"); its
    # node class, the same, is left alone.
    more = [*NODEPOOL[:NODEPOOL.index("--nodes") + 1], "4", *NODEPOOL[NODEPOOL.index("--nodes") + 2:]]
    r = cli_here(*more, "--yes", env=kube.env)
    assert r.returncode == 0 and r.stdout.splitlines() == ["EC2NodeClass/gpu-p5-48xlarge: unchanged",
                                                           "NodePool/gpu-p5-48xlarge: updated"], r.stderr
    assert [p.split("?")[0] for m, p, _ in kube.requests() if m == "PATCH"] == [
        "/apis/karpenter.sh/v1/nodepools/gpu-p5-48xlarge"]
    from kubernetes import client

    stored = client.CustomObjectsApi(kube.api()).get_cluster_custom_object("karpenter.sh", "v1", "nodepools",
                                                                           "gpu-p5-48xlarge")
    assert stored["spec"]["limits"] == {"nvidia.com/gpu": "32"}
    asked = NodePoolPlan("llm", "us-west-2", "p5.48xlarge", 4, capacity_type="reserved",
                         capacity_reservation_tag="team=llm")
    assert stored["spec"]["template"] == render(asked)[1]["spec"]["template"]


def test_nodepool_on_a_cluster_without_karpenter_is_one_line_and_creates_nothing(kube):
    require("kmock")
    r = cli_here(*NODEPOOL, "--yes", env=kube.env)
    assert (r.returncode, r.stderr) == (
        3, "error: EC2NodeClass: this cluster has no karpenter.k8s.aws/v1 API; Karpenter is not installed: make the "
           "cluster with `fsdpkit cluster config --provisioner karpenter` and `fsdpkit cluster create`, or install "
           "Karpenter\n")
    assert [m for m, _, _ in kube.requests() if m == "POST"] == []
