"""`fsdpkit storage fsx`: an FSx for Lustre file system for checkpoints and data, in the cluster's
VPC, found again by its name tag; create waits until it is AVAILABLE.

Sizes and throughput follow the FSx API's rules for SSD Lustre, checked before any call: capacity
1200 GiB, 2400 GiB or a multiple of 2400 GiB; throughput per TiB 50/100/200 for PERSISTENT_1 and
125/250/500/1000 for PERSISTENT_2, none for SCRATCH_2. An S3 bucket is linked at creation
(import/export paths) for SCRATCH_2 and PERSISTENT_1, and by a data repository association once
the file system is up for PERSISTENT_2 (the only way that type offers)."""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, cast

from fsdpkit.aws.session import Aws, AwsError, aws_errors
from fsdpkit.errors import TimedOut, UserError
from fsdpkit.polling import poll_until

THROUGHPUT = {"SCRATCH_2": (), "PERSISTENT_1": (50, 100, 200), "PERSISTENT_2": (125, 250, 500, 1000)}
NAME_TAG = "fsdpkit:fsx"
MANAGED = {"fsdpkit:managed": "true"}
FAILED = ("FAILED", "MISCONFIGURED", "MISCONFIGURED_UNAVAILABLE")


@dataclass
class FsxPlan:
    name: str
    size_gib: int = 1200
    deployment_type: str = "PERSISTENT_2"
    throughput: int | None = None          # MB/s per TiB; default: the type's lowest
    subnet_id: str = ""
    security_group_ids: list[str] = field(default_factory=list)
    s3: str = ""                           # s3://bucket[/prefix]

    def validate(self) -> None:
        if not re.match(r"^[a-z0-9][a-z0-9-]{0,62}$", self.name):
            raise UserError(f"name: {self.name!r} must be 1-63 lowercase letters, digits and hyphens (it also "
                            "names the PersistentVolumeClaim)")
        if self.deployment_type not in THROUGHPUT:
            raise UserError(f"deployment_type: {self.deployment_type!r} is not one of {', '.join(THROUGHPUT)}")
        if not (self.size_gib in (1200, 2400) or (self.size_gib > 0 and self.size_gib % 2400 == 0)):
            below = max(1200, self.size_gib // 2400 * 2400)
            raise UserError(f"size: {self.size_gib} GiB is not a valid {self.deployment_type} size (1200, 2400 or a "
                            f"multiple of 2400; nearest: {below} or {below + 2400 if below > 1200 else 2400})")
        allowed = THROUGHPUT[self.deployment_type]
        if self.throughput is None:
            self.throughput = allowed[0] if allowed else None
        elif self.throughput not in allowed:
            raise UserError(f"throughput: {self.deployment_type} takes " + (
                f"{', '.join(map(str, allowed))} MB/s per TiB, not {self.throughput}" if allowed else
                "no throughput setting (its throughput is fixed at 200 MB/s per TiB)"))
        if self.s3 and not re.match(r"^s3://[a-z0-9][a-z0-9.-]{1,61}[a-z0-9](/.*)?$", self.s3):
            raise UserError(f"s3: {self.s3!r} is not an S3 URL (s3://bucket or s3://bucket/prefix)")

    def request(self, subnet_id: str, security_group_ids: list[str]) -> dict[str, Any]:
        """The CreateFileSystem parameters."""
        lustre: dict[str, Any] = {"DeploymentType": self.deployment_type, "DataCompressionType": "LZ4"}
        if self.throughput:
            lustre["PerUnitStorageThroughput"] = self.throughput
        if self.s3 and self.deployment_type != "PERSISTENT_2":
            lustre["ImportPath"] = self.s3
            lustre["ExportPath"] = self.s3.rstrip("/") + "/fsx-export"
        return {
            "FileSystemType": "LUSTRE", "StorageCapacity": self.size_gib, "StorageType": "SSD",
            "SubnetIds": [subnet_id], "SecurityGroupIds": security_group_ids,
            "FileSystemTypeVersion": "2.15",
            "LustreConfiguration": lustre,
            "Tags": [{"Key": "Name", "Value": f"fsdpkit-{self.name}"}, {"Key": NAME_TAG, "Value": self.name},
                     *({"Key": k, "Value": v} for k, v in MANAGED.items())],
        }


def cluster_network(aws: Aws, eks_cluster: str, subnet_id: str = "",
                    security_group_ids: list[str] | None = None) -> tuple[str, list[str]]:
    """The subnet and security groups for the file system: the user's, checked to lie in the
    cluster's VPC, else the cluster's first subnet and its cluster security group (which every
    managed node carries, so nodes reach Lustre's ports 988 and 1018-1023)."""
    eks = aws.client("eks")
    with aws_errors(f"reading EKS cluster {eks_cluster}", "eks"):
        try:
            vpc_cfg = eks.describe_cluster(name=eks_cluster)["cluster"]["resourcesVpcConfig"]
        except eks.exceptions.ResourceNotFoundException:
            raise UserError(f"eks_cluster: no EKS cluster {eks_cluster!r} in {aws.region}") from None
    cluster_subnets = list(vpc_cfg.get("subnetIds") or [])
    if not cluster_subnets:
        raise UserError(f"eks_cluster: {eks_cluster} lists no subnets; give --subnet-id")
    subnet = subnet_id or cluster_subnets[0]
    if subnet_id:
        vpc = vpc_cfg.get("vpcId") or _vpc_of(aws, cluster_subnets[0])
        mine = _vpc_of(aws, subnet_id)
        if mine != vpc:
            raise UserError(f"subnet_id: {subnet_id} is in {mine}, but cluster {eks_cluster} is in {vpc}; nodes "
                            f"could not reach the file system (pick one of: {', '.join(cluster_subnets)})")
    groups = list(security_group_ids or []) or [g for g in [vpc_cfg.get("clusterSecurityGroupId")] if g] \
        or list(vpc_cfg.get("securityGroupIds", []))
    if not groups:
        raise UserError(f"eks_cluster: {eks_cluster} has no cluster security group; give --security-group-id")
    return subnet, groups


def _vpc_of(aws: Aws, subnet_id: str) -> str:
    with aws_errors(f"reading subnet {subnet_id}", "ec2"):
        found = aws.client("ec2").describe_subnets(Filters=[{"Name": "subnet-id", "Values": [subnet_id]}])
    if not found.get("Subnets"):
        raise UserError(f"subnet_id: {subnet_id} does not exist in {aws.region}")
    return cast("str", found["Subnets"][0]["VpcId"])


def find(aws: Aws, name: str) -> dict[str, Any] | None:
    """fsdpkit's file system of this name (by tag), or None."""
    fsx = aws.client("fsx")
    with aws_errors("listing FSx file systems", "fsx"):
        for page in fsx.get_paginator("describe_file_systems").paginate():
            for fs in page.get("FileSystems", []):
                tags = {t["Key"]: t["Value"] for t in fs.get("Tags", [])}
                if tags.get(NAME_TAG) == name and fs.get("Lifecycle") != "DELETING":
                    return cast("dict[str, Any] | None", fs)
    return None


def create(aws: Aws, plan: FsxPlan, subnet_id: str, security_group_ids: list[str],
           say: Callable[[str], None]) -> tuple[dict[str, Any], bool]:
    """(file system, created?): an existing one of the same name is reused, not duplicated."""
    existing = find(aws, plan.name)
    if existing:
        say(f"FSx {plan.name}: exists ({existing['FileSystemId']}, {existing.get('Lifecycle', '?')})")
        return existing, False
    with aws_errors(f"creating FSx file system {plan.name}", "fsx"):
        fs = aws.client("fsx").create_file_system(ClientRequestToken=f"fsdpkit-{plan.name}",
                                                  **plan.request(subnet_id, security_group_ids))["FileSystem"]
    say(f"FSx {plan.name}: creating {fs['FileSystemId']} ({plan.size_gib} GiB {plan.deployment_type}"
        + (f", {plan.throughput} MB/s/TiB" if plan.throughput else "") + f", subnet {subnet_id})")
    return fs, True


def wait_available(aws: Aws, file_system_id: str, say: Callable[[str], None], timeout: float = 3600,
                   poll: float = 15) -> dict[str, Any]:
    """Poll until AVAILABLE, reporting each lifecycle change and the time so far (creation takes
    5-15 minutes); a FAILED / MISCONFIGURED file system is an error with FSx's own reason."""
    fsx = aws.client("fsx")
    start = time.monotonic()

    def look() -> dict[str, Any]:
        with aws_errors(f"reading FSx file system {file_system_id}", "fsx"):
            found = fsx.describe_file_systems(FileSystemIds=[file_system_id]).get("FileSystems", [])
        if not found:
            raise AwsError(f"FSx file system {file_system_id} disappeared while waiting (deleted elsewhere?)")
        return dict(found[0])

    def changed(fs: dict[str, Any]) -> None:
        elapsed = int(time.monotonic() - start)
        say(f"FSx {file_system_id}: {_lifecycle(fs)} after {elapsed // 60}m{elapsed % 60:02d}s")

    fs = poll_until(look, lambda fs: _lifecycle(fs) == "AVAILABLE" or _lifecycle(fs) in FAILED, timeout, poll,
                    changed, key=_lifecycle)
    state = _lifecycle(fs)
    if state == "AVAILABLE":
        return fs
    if state in FAILED:
        reason = (fs.get("FailureDetails") or {}).get("Message", "no reason given")
        raise AwsError(f"FSx file system {file_system_id} is {state}: {reason}")
    raise TimedOut(f"FSx file system {file_system_id} still {state} after {int(timeout)} s; it keeps going: "
                   "`fsdpkit storage fsx status` shows when it is ready")


def _lifecycle(fs: dict[str, Any]) -> str:
    return str(fs.get("Lifecycle", "UNKNOWN"))


def link_s3(aws: Aws, fs: dict[str, Any], s3: str, say: Callable[[str], None]) -> str:
    """PERSISTENT_2: a data repository association at /, importing and exporting automatically."""
    with aws_errors("linking the S3 bucket (data repository association)", "fsx"):
        dra = aws.client("fsx").create_data_repository_association(
            FileSystemId=fs["FileSystemId"], FileSystemPath="/", DataRepositoryPath=s3,
            BatchImportMetaDataOnCreate=True,
            S3={"AutoImportPolicy": {"Events": ["NEW", "CHANGED", "DELETED"]},
                "AutoExportPolicy": {"Events": ["NEW", "CHANGED", "DELETED"]}})["Association"]
    say(f"FSx {fs['FileSystemId']}: linked to {s3} ({dra['AssociationId']})")
    return cast("str", dra["AssociationId"])


def delete(aws: Aws, name: str, say: Callable[[str], None]) -> str | None:
    """Delete fsdpkit's file system of this name; its id, or None when there was none."""
    fs = find(aws, name)
    if fs is None:
        say(f"FSx {name}: none found (nothing to delete)")
        return None
    with aws_errors(f"deleting FSx file system {fs['FileSystemId']}", "fsx"):
        aws.client("fsx").delete_file_system(FileSystemId=fs["FileSystemId"])
    say(f"FSx {name}: deleting {fs['FileSystemId']}")
    return cast("str | None", fs["FileSystemId"])


def summary(fs: dict[str, Any]) -> dict[str, Any]:
    lustre = fs.get("LustreConfiguration") or {}
    return {"file_system_id": fs["FileSystemId"], "lifecycle": fs.get("Lifecycle", "UNKNOWN"),
            "dns_name": fs.get("DNSName", ""), "mount_name": lustre.get("MountName", ""),
            "size_gib": fs.get("StorageCapacity"), "deployment_type": lustre.get("DeploymentType", ""),
            "throughput_per_tib": lustre.get("PerUnitStorageThroughput"),
            "subnet_ids": fs.get("SubnetIds", []), "s3_import": (lustre.get("DataRepositoryConfiguration") or {})
            .get("ImportPath", lustre.get("ImportPath", ""))}
