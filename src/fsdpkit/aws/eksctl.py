"""`fsdpkit cluster config|create|delete`: an eksctl ClusterConfig (eksctl.io/v1alpha5) for training,
rendered from a few choices, and eksctl run with it.

Two ways to GPU capacity. `nodegroup` (the default):
a small system node group (CoreDNS, operators, the Ray head) and one GPU node group:
EFA on where the instance has it (eksctl then makes every network card an EFA interface, adds the
EFA security group and installs the EFA device plugin), the whole group in one availability zone
and a cluster placement group (EFA traffic does not cross zones, and a placement group keeps the
nodes on one spine), an optional On-Demand Capacity Reservation or Capacity Block, a 500 GiB root
volume for multi-GB training images, and Amazon Linux 2023 (eksctl picks its NVIDIA/Neuron AMI
for accelerated instance types). EKS add-ons: VPC CNI, CoreDNS, kube-proxy, the EBS and FSx CSI
drivers; IAM OIDC for their service-account roles. `karpenter`: the system node group alone, with
Karpenter installed by eksctl (its `karpenter:` section: IAM role, instance profile, Helm chart) and
the cluster tagged for Karpenter's subnet and security-group discovery; the GPU capacity is then a
NodePool (`fsdpkit cluster nodepool`, aws/karpenter.py), which can take reserved capacity by tag
and scales to zero.

eksctl itself does not create the placement group a node group names, so `create` makes it first
(EC2 CreatePlacementGroup, strategy cluster) and `delete` removes it after the cluster is gone.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from fsdpkit.aws.session import AwsError
from fsdpkit.errors import UserError
from fsdpkit.hardware.instances import INSTANCES, Instance, lookup
from fsdpkit.yamlfile import describe_yaml_error

API_VERSION = "eksctl.io/v1alpha5"
DEFAULT_K8S = "1.33"
CAPACITY_RESERVATION = re.compile(r"^cr-[0-9a-f]{17}$")
# EKS: 1-100 characters, letters, digits and hyphens, starting with a letter or digit.
CLUSTER_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9-]{0,99}$")
ZONE = re.compile(r"^[a-z]{2}(-gov)?-[a-z]+-\d[a-z]$")
TAG = {"fsdpkit:managed": "true"}
GPU_POOL_LABEL = "fsdpkit.dev/pool"
EFA_LABEL = "fsdpkit.dev/efa-interfaces"
PROVISIONERS = ("nodegroup", "karpenter")
DISCOVERY = "karpenter.sh/discovery"   # the tag Karpenter's EC2NodeClass selects subnets and groups by
KARPENTER_VERSION = "1.8.1"            # the Karpenter release eksctl installs (its Helm chart's version)
ADDONS = ("vpc-cni", "coredns", "kube-proxy", "aws-ebs-csi-driver", "aws-fsx-csi-driver")
# The FSx CSI controller creates file systems for dynamic provisioning; AWS's managed policy for it.
FSX_POLICY = "arn:aws:iam::aws:policy/AmazonFSxFullAccess"


@dataclass
class ClusterPlan:
    name: str
    region: str
    instance_type: str
    nodes: int
    zone: str = ""                      # default: the region's "a" zone
    efa: str = "auto"                   # auto (on where the instance has it) | on | off
    capacity_reservation: str = ""      # cr-... (On-Demand Capacity Reservation or Capacity Block)
    capacity_block: bool = False        # the reservation is an EC2 Capacity Block for ML
    placement_group: str = ""           # default: <name>-gpu when EFA is on
    k8s_version: str = DEFAULT_K8S
    volume_size: int = 500
    system_instance_type: str = "m6i.xlarge"
    system_nodes: int = 2
    provisioner: str = "nodegroup"      # nodegroup | karpenter (GPU nodes from a NodePool)

    def validate(self) -> Instance:
        """The instance row; a UserError naming the field for anything eksctl or EC2 would refuse later."""
        self._check_names_and_sizes()
        inst = lookup(self.instance_type)
        if self.instance_type.startswith("ml."):
            raise UserError(f"instance_type: {self.instance_type!r} is a SageMaker HyperPod type; EKS node groups "
                            f"take the EC2 name ({self.instance_type.removeprefix('ml.')})")
        self._check_placement(inst)
        if self.provisioner not in PROVISIONERS:
            raise UserError(f"provisioner: {self.provisioner!r} is not one of {', '.join(PROVISIONERS)}")
        if self.provisioner == "karpenter" and (self.capacity_reservation or self.placement_group):
            flag = "--capacity-reservation" if self.capacity_reservation else "--placement-group"
            raise UserError(f"{flag}: with --provisioner karpenter the GPU nodes' capacity is the NodePool's: give it "
                            f"to `fsdpkit cluster nodepool {flag} ...`")
        return inst

    def _check_names_and_sizes(self) -> None:
        if not CLUSTER_NAME.match(self.name):
            raise UserError(f"name: {self.name!r} is not a valid EKS cluster name (1-100 letters, digits and "
                            "hyphens, starting with a letter or digit)")
        if not re.match(r"^[a-z]{2}(-gov)?-[a-z]+-\d$", self.region):
            raise UserError(f"region: {self.region!r} is not an AWS region (for example us-west-2)")
        if self.nodes < 1:
            raise UserError(f"nodes: {self.nodes} is out of range (at least 1)")
        if self.system_nodes < 1:
            raise UserError(f"system_nodes: {self.system_nodes} is out of range (at least 1)")
        if not 20 <= self.volume_size <= 16384:
            raise UserError(f"volume_size: {self.volume_size} GiB is out of range (20-16384)")
        if not re.match(r"^1\.\d{2}$", self.k8s_version):
            raise UserError(f"k8s_version: {self.k8s_version!r} is not a Kubernetes minor version (for example 1.33)")

    def _check_placement(self, inst: Instance) -> None:
        """EFA, zone and capacity reservation against the instance type and region."""
        if self.efa not in ("auto", "on", "off"):
            raise UserError(f"efa: {self.efa!r} is not one of auto, on, off")
        if self.efa == "on" and inst.efa == 0:
            with_efa = ", ".join(sorted(n for n, i in INSTANCES.items() if i.efa and i.family == inst.family))
            raise UserError(f"efa: {self.instance_type} has no EFA interface"
                            + (f" (in its family: {with_efa})" if with_efa else ""))
        if self.zone and not (ZONE.match(self.zone) and self.zone.startswith(self.region)):
            raise UserError(f"zone: {self.zone!r} is not an availability zone of {self.region} "
                            f"(for example {self.region}a)")
        if self.capacity_reservation and not CAPACITY_RESERVATION.match(self.capacity_reservation):
            raise UserError(f"capacity_reservation: {self.capacity_reservation!r} is not a reservation id "
                            "(cr- and 17 hex digits, as `aws ec2 describe-capacity-reservations` lists them)")
        if self.capacity_block and not self.capacity_reservation:
            raise UserError("capacity_block: needs --capacity-reservation (the Capacity Block's cr- id)")
        if self.capacity_reservation and not self.zone:
            raise UserError("zone: a capacity reservation lives in one availability zone; give it with --zone")

    def uses_efa(self, inst: Instance) -> bool:
        return self.efa == "on" or (self.efa == "auto" and inst.efa > 0)


def render(plan: ClusterPlan) -> dict[str, Any]:
    """The ClusterConfig as a dict (dump it with yaml.safe_dump for eksctl -f)."""
    inst = plan.validate()
    zone = plan.zone or f"{plan.region}a"
    # The control plane needs subnets in two zones; the GPU group uses only the first.
    other = f"{plan.region}{'b' if zone[-1] != 'b' else 'a'}"
    efa = plan.uses_efa(inst)
    gpu: dict[str, Any] = {
        "name": "gpu",
        "instanceType": plan.instance_type,
        "desiredCapacity": plan.nodes, "minSize": plan.nodes, "maxSize": plan.nodes,
        "availabilityZones": [zone],
        "amiFamily": "AmazonLinux2023",
        "volumeSize": plan.volume_size, "volumeType": "gp3",
        "labels": {GPU_POOL_LABEL: "gpu"},
        "iam": {"withAddonPolicies": {"fsx": True, "ebs": True, "cloudWatch": True}},
        "tags": dict(TAG),
    }
    if efa:
        gpu["efaEnabled"] = True
        gpu["labels"][EFA_LABEL] = str(inst.efa)
        gpu["placement"] = {"groupName": placement_group_name(plan)}
    if plan.capacity_reservation:
        gpu["capacityReservation"] = {"capacityReservationTarget": {
            "capacityReservationID": plan.capacity_reservation}}
        if plan.capacity_block:
            gpu["instanceMarketOptions"] = {"marketType": "capacity-block"}
    system = {
        "name": "system", "instanceType": plan.system_instance_type,
        "desiredCapacity": plan.system_nodes, "minSize": plan.system_nodes, "maxSize": plan.system_nodes + 2,
        "amiFamily": "AmazonLinux2023", "volumeSize": 100, "volumeType": "gp3",
        "labels": {GPU_POOL_LABEL: "system"}, "tags": dict(TAG),
    }
    karpenter = plan.provisioner == "karpenter"
    addons: list[dict[str, Any]] = []
    for name in ADDONS:
        addon: dict[str, Any] = {"name": name}
        if name == "aws-ebs-csi-driver":
            addon["wellKnownPolicies"] = {"ebsCSIController": True}
        if name == "aws-fsx-csi-driver":
            addon["attachPolicyARNs"] = [FSX_POLICY]
        addons.append(addon)
    config: dict[str, Any] = {
        "apiVersion": API_VERSION,
        "kind": "ClusterConfig",
        "metadata": {"name": plan.name, "region": plan.region, "version": plan.k8s_version,
                     "tags": {**TAG, **({DISCOVERY: plan.name} if karpenter else {})}},
        "availabilityZones": sorted({zone, other}),
        "iam": {"withOIDC": True},
        "addons": addons,
        "managedNodeGroups": [system] if karpenter else [system, gpu],
    }
    if karpenter:
        config["karpenter"] = {"version": KARPENTER_VERSION}
    return config


def placement_group_name(plan: ClusterPlan) -> str:
    return plan.placement_group or f"{plan.name}-gpu"


def placement_groups(config: dict[str, Any]) -> list[str]:
    return [g["placement"]["groupName"] for g in config.get("managedNodeGroups", []) if g.get("placement")]


def load_config(path: str) -> dict[str, Any]:
    import yaml

    try:
        with open(path) as f:
            config = yaml.safe_load(f)
    except OSError as e:
        raise UserError(f"--config: cannot read {path}: {e.strerror}") from None
    except yaml.YAMLError as e:
        raise UserError(f"--config: {path} is not YAML ({describe_yaml_error(e)})") from None
    if not isinstance(config, dict) or config.get("kind") != "ClusterConfig" or \
            not (config.get("metadata") or {}).get("name") or not (config.get("metadata") or {}).get("region"):
        raise UserError(f"--config: {path} is not an eksctl ClusterConfig with metadata.name and metadata.region "
                        "(write one with `fsdpkit cluster config`)")
    return config


def eksctl_command(verb: str, path: str) -> list[str]:
    cmd = ["eksctl", verb, "cluster", "-f", path]
    return cmd + (["--wait"] if verb == "delete" else [])


def ensure_placement_groups(ec2: Any, names: list[str], say: Callable[[str], None]) -> list[str]:
    """Create each missing cluster placement group (tagged as fsdpkit's); return the ones created."""
    import botocore.exceptions as bx

    created = []
    for name in names:
        try:
            ec2.describe_placement_groups(GroupNames=[name])
            say(f"placement group {name}: exists")
            continue
        except bx.ClientError as e:
            if e.response.get("Error", {}).get("Code") != "InvalidPlacementGroup.Unknown":
                raise
        ec2.create_placement_group(GroupName=name, Strategy="cluster", TagSpecifications=[{
            "ResourceType": "placement-group", "Tags": [{"Key": k, "Value": v} for k, v in TAG.items()]}])
        say(f"placement group {name}: created (strategy cluster)")
        created.append(name)
    return created


def delete_placement_groups(ec2: Any, names: list[str], say: Callable[[str], None]) -> list[str]:
    """Delete the named groups that carry fsdpkit's tag; leave a user's own group alone."""
    import botocore.exceptions as bx

    removed = []
    for name in names:
        try:
            groups = ec2.describe_placement_groups(GroupNames=[name])["PlacementGroups"]
        except bx.ClientError as e:
            if e.response.get("Error", {}).get("Code") == "InvalidPlacementGroup.Unknown":
                continue
            raise
        tags = {t["Key"]: t["Value"] for g in groups for t in g.get("Tags", [])}
        if any(tags.get(k) != v for k, v in TAG.items()):
            say(f"placement group {name}: not created by fsdpkit, kept")
            continue
        ec2.delete_placement_group(GroupName=name)
        say(f"placement group {name}: deleted")
        removed.append(name)
    return removed


def run_eksctl(verb: str, path: str, say: Callable[[str], None]) -> dict[str, Any]:
    """Run eksctl (its own progress streams to stderr); without eksctl, the exact command to run."""
    cmd = eksctl_command(verb, path)
    if shutil.which("eksctl") is None:
        say(f"eksctl is not installed (https://eksctl.io/installation/); run:\n  {' '.join(cmd)}")
        return {"ran": False, "command": cmd}
    say(f"running: {' '.join(cmd)}")
    import sys

    rc = subprocess.run(cmd, stdout=sys.stderr).returncode
    if rc != 0:
        raise AwsError(f"eksctl {verb} cluster failed (exit {rc}); its output is above")
    return {"ran": True, "command": cmd}
