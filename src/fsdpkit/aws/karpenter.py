"""GPU capacity through Karpenter (`fsdpkit cluster nodepool`): a NodePool and its EC2NodeClass per
GPU instance type, the alternative to an eksctl managed node group. Training capacity is bought as
reserved capacity (an On-Demand Capacity Reservation or an EC2 Capacity Block for ML), which a
node group cannot target by tag and Karpenter can (`capacityReservationSelectorTerms`), and which
Karpenter brings up when a job's pods are pending and lets go when they are gone (scale to zero).

What a training node needs, and each part's reason:
- the EKS-optimized accelerated AMI: AL2023's NVIDIA (or Neuron) variant for the cluster's
  Kubernetes version, by its public SSM parameter, so drivers, the container toolkit and the EFA
  software come with the image;
- an EFA on every network card, as EC2 lays them out for instances with several cards (EC2 User
  Guide, "Maximize network bandwidth on Amazon EC2 instances with multiple network cards"): card 0
  the primary ENA interface at device index 0 and an EFA-only interface beside it at device index 1
  (an EFA-only interface cannot be the primary), each other card an EFA-only interface at device
  index 0; so a p5.48xlarge node has 32 EFA devices, the count its label, the team's quota and
  every job's pods ask for;
- one availability zone (EFA traffic does not cross zones; a reservation lives in one) and, where
  given, a cluster placement group;
- disruption that never takes a node a training pod runs on: consolidation only of empty nodes,
  no replacement on drift (a new AMI in the SSM parameter would otherwise recycle busy nodes), and
  no expiry; fsdpkit's pods also carry `karpenter.sh/do-not-disrupt`;
- a GPU taint the job's pods tolerate, and a limit of nodes x GPUs, so a stray pod cannot buy a p5.

eksctl's `karpenter:` section installs Karpenter with an instance profile named for the cluster and
tags the cluster's subnets and security groups for discovery; the EC2NodeClass selects by those."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from fsdpkit.aws.eksctl import CAPACITY_RESERVATION, DISCOVERY, EFA_LABEL, GPU_POOL_LABEL, TAG, ClusterPlan
from fsdpkit.errors import UserError
from fsdpkit.hardware.instances import Instance

NODEPOOL_API = "karpenter.sh/v1"
NODECLASS_API = "karpenter.k8s.aws/v1"
CAPACITY_TYPES = ("on-demand", "reserved")
_TAG_SELECTOR = re.compile(r"^([^=]{1,128})=(.{0,256})$")


def instance_profile(cluster: str) -> str:
    """The node instance profile eksctl's Karpenter installation creates for a cluster."""
    return f"eksctl-KarpenterNodeInstanceProfile-{cluster}"


def pool_name(instance_type: str) -> str:
    """The NodePool (and EC2NodeClass) of one GPU instance type: `gpu-p5-48xlarge`."""
    return "gpu-" + instance_type.replace(".", "-")


@dataclass
class NodePoolPlan:
    cluster: str
    region: str
    instance_type: str
    nodes: int                        # the most nodes the pool may hold (its GPU limit)
    zone: str = ""                    # default: the region's "a" zone
    capacity_type: str = "on-demand"  # on-demand | reserved
    capacity_reservation: str = ""    # cr-...: one reservation (an ODCR or a Capacity Block)
    capacity_reservation_tag: str = ""   # KEY=VALUE: the reservations that carry this tag
    efa: str = "auto"
    placement_group: str = ""         # an existing cluster placement group, by name
    k8s_version: str = "1.33"
    volume_size: int = 500
    instance_profile: str = ""        # default: eksctl's for the cluster

    def _as_cluster(self) -> ClusterPlan:
        """The node-group plan of the same nodes: its checks (names, sizes, instance, EFA, zone) and
        its EFA rule are the pool's too."""
        return ClusterPlan(self.cluster, self.region, self.instance_type, self.nodes, zone=self.zone, efa=self.efa,
                           k8s_version=self.k8s_version, volume_size=self.volume_size)

    def validate(self) -> Instance:
        """The instance row; a UserError naming the field for anything Karpenter or EC2 would refuse."""
        inst = self._as_cluster().validate()
        if self.capacity_type not in CAPACITY_TYPES:
            raise UserError(f"capacity_type: {self.capacity_type!r} is not one of {', '.join(CAPACITY_TYPES)}")
        if self.capacity_reservation and not CAPACITY_RESERVATION.match(self.capacity_reservation):
            raise UserError(f"capacity_reservation: {self.capacity_reservation!r} is not a reservation id (cr- and "
                            "17 hex digits, as `aws ec2 describe-capacity-reservations` lists them)")
        if self.capacity_reservation_tag and not _TAG_SELECTOR.match(self.capacity_reservation_tag):
            raise UserError(f"capacity_reservation_tag: {self.capacity_reservation_tag!r} is not KEY=VALUE")
        if self.capacity_reservation and self.capacity_reservation_tag:
            raise UserError("capacity_reservation_tag: give a reservation by id or by tag, not both")
        reserved = bool(self.capacity_reservation or self.capacity_reservation_tag)
        if self.capacity_type == "reserved" and not reserved:
            raise UserError("capacity_type: reserved needs --capacity-reservation (cr-...) or "
                            "--capacity-reservation-tag KEY=VALUE")
        if reserved and self.capacity_type != "reserved":
            raise UserError("capacity_type: a capacity reservation is used by reserved capacity: add "
                            "--capacity-type reserved")
        return inst

    def uses_efa(self, inst: Instance) -> bool:
        return self._as_cluster().uses_efa(inst)


def ami_parameter(inst: Instance, k8s_version: str) -> str:
    """The public SSM parameter of the EKS-optimized accelerated AL2023 AMI for this instance."""
    variant = "neuron" if inst.resource.startswith("aws.amazon.com/neuron") else "nvidia"
    return f"/aws/service/eks/optimized-ami/{k8s_version}/amazon-linux-2023/x86_64/{variant}/recommended/image_id"


def network_interfaces(inst: Instance) -> list[dict[str, Any]]:
    """Card 0's primary interface and an EFA-only interface beside it, and an EFA-only interface on
    every other card: one EFA per card (p5: 32). One card (g5, g6): nothing to say beyond the default."""
    if inst.efa <= 1:
        return []
    return [{"networkCardIndex": 0, "deviceIndex": 0, "interfaceType": "interface"},
            {"networkCardIndex": 0, "deviceIndex": 1, "interfaceType": "efa-only"}] + \
        [{"networkCardIndex": card, "deviceIndex": 0, "interfaceType": "efa-only"} for card in range(1, inst.efa)]


def render(plan: NodePoolPlan) -> list[dict[str, Any]]:
    """[EC2NodeClass, NodePool] for the plan, in the order they are applied."""
    inst = plan.validate()
    name = pool_name(plan.instance_type)
    zone = plan.zone or f"{plan.region}a"
    efa = plan.uses_efa(inst)
    discovery = [{"tags": {DISCOVERY: plan.cluster}}]
    node_class: dict[str, Any] = {
        "amiFamily": "AL2023",
        "amiSelectorTerms": [{"ssmParameter": ami_parameter(inst, plan.k8s_version)}],
        "instanceProfile": plan.instance_profile or instance_profile(plan.cluster),
        "subnetSelectorTerms": discovery,
        "securityGroupSelectorTerms": discovery,
        "blockDeviceMappings": [{"deviceName": "/dev/xvda", "rootVolume": True,
                                 "ebs": {"volumeSize": f"{plan.volume_size}Gi", "volumeType": "gp3",
                                         "encrypted": True, "deleteOnTermination": True}}],
        "metadataOptions": {"httpTokens": "required", "httpPutResponseHopLimit": 2},
        "tags": dict(TAG),
    }
    if efa and (interfaces := network_interfaces(inst)):
        node_class["networkInterfaces"] = interfaces
    if plan.placement_group:
        node_class["placementGroupSelector"] = {"name": plan.placement_group}
    if plan.capacity_reservation:
        node_class["capacityReservationSelectorTerms"] = [{"id": plan.capacity_reservation}]
    elif plan.capacity_reservation_tag:
        key, _, value = plan.capacity_reservation_tag.partition("=")
        node_class["capacityReservationSelectorTerms"] = [{"tags": {key: value}}]
    labels = {GPU_POOL_LABEL: "gpu", **({EFA_LABEL: str(inst.efa)} if efa else {})}
    pool = {
        "template": {
            "metadata": {"labels": labels},
            "spec": {
                "nodeClassRef": {"group": "karpenter.k8s.aws", "kind": "EC2NodeClass", "name": name},
                "requirements": [
                    {"key": "node.kubernetes.io/instance-type", "operator": "In", "values": [plan.instance_type]},
                    {"key": "karpenter.sh/capacity-type", "operator": "In", "values": [plan.capacity_type]},
                    {"key": "topology.kubernetes.io/zone", "operator": "In", "values": [zone]},
                ],
                "taints": [{"key": inst.resource, "effect": "NoSchedule"}],
                "expireAfter": "Never",
            },
        },
        # Only empty nodes are consolidated, and drift never replaces one: a node with a training
        # pod stays until the pod is gone.
        "disruption": {"consolidationPolicy": "WhenEmpty", "consolidateAfter": "10m",
                       "budgets": [{"nodes": "0", "reasons": ["Drifted"]}]},
        "limits": {inst.resource: str(plan.nodes * inst.accelerators)},
    }
    meta = {"labels": {"app.kubernetes.io/managed-by": "fsdpkit"}}
    return [{"apiVersion": NODECLASS_API, "kind": "EC2NodeClass", "metadata": {"name": name, **meta},
             "spec": node_class},
            {"apiVersion": NODEPOOL_API, "kind": "NodePool", "metadata": {"name": name, **meta}, "spec": pool}]
