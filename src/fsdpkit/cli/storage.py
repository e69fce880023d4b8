"""`fsdpkit storage fsx create|status|delete|storage-class`: FSx for Lustre for checkpoints and data,
and the Kubernetes volume that job specs name in `storage.claim`."""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING, Any

from fsdpkit import yamlfile
from fsdpkit.cli.output import Parser, add_namespace, confirmed, dispatch, emit_json, progress
from fsdpkit.effects import Effect, declare
from fsdpkit.envelope import duration
from fsdpkit.errors import UserError

if TYPE_CHECKING:  # imported when a verb runs, so that --help stays fast
    from fsdpkit.aws.fsx import FsxPlan
    from fsdpkit.aws.session import Aws


def _aws(args: argparse.Namespace) -> Aws:
    from fsdpkit.aws.session import connect

    return connect(args.region, args.profile)


def _kube(args: argparse.Namespace) -> Any:
    from fsdpkit.cluster.client import connect

    return connect(args.context, args.kubeconfig, None, None)


def _plan(args: argparse.Namespace) -> FsxPlan:
    from fsdpkit.aws.fsx import FsxPlan

    plan = FsxPlan(args.name, args.size, args.deployment_type, args.throughput, s3=args.s3 or "")
    plan.validate()
    return plan


def _network(args: argparse.Namespace, aws: Aws | None = None) -> tuple[str, list[str]]:
    """Subnet and security groups: from --eks-cluster (AWS is asked only then), or as given."""
    from fsdpkit.aws.fsx import cluster_network

    if args.eks_cluster:
        return cluster_network(aws or _aws(args), args.eks_cluster, args.subnet_id or "", args.security_group_id)
    if not (args.subnet_id and args.security_group_id):
        raise UserError("network: give --eks-cluster (its VPC, subnet and cluster security group are used), or "
                        "both --subnet-id and --security-group-id")
    return args.subnet_id, args.security_group_id


def cmd_create(args: argparse.Namespace) -> int:

    from fsdpkit.aws import fsx
    from fsdpkit.cluster.apply import describe, ensure
    from fsdpkit.cluster.storage import static_volume

    plan = _plan(args)
    say = progress(args)
    if args.dry_run:
        subnet = args.subnet_id or "<the cluster's first subnet>"
        groups = args.security_group_id or ["<the cluster security group>"]
        volume = static_volume(plan.name, args.namespace, "<fs-id>", "<dns-name>", "<mount-name>", plan.size_gib)
        dry: dict[str, Any] = {"create_file_system": plan.request(subnet, groups),
                               "kubernetes": [] if args.no_k8s else volume}
        if args.json:
            return emit_json(dry)
        print(yamlfile.dump(dry), end="")
        return 0
    aws = _aws(args)
    subnet, groups = _network(args, aws)
    fs, created = fsx.create(aws, plan, subnet, groups, say)
    if not args.no_wait:
        fs = fsx.wait_available(aws, fs["FileSystemId"], say, args.timeout, args.poll)
        if plan.s3 and plan.deployment_type == "PERSISTENT_2" and created:
            fsx.link_s3(aws, fs, plan.s3, say)
    info = fsx.summary(fs)
    out: dict[str, Any] = {"created": created, **info, "claim": None, "kubernetes": []}
    if not args.no_wait and not args.no_k8s:
        if not info["mount_name"]:
            raise UserError(f"FSx {info['file_system_id']} reports no mount name; cannot write its volume")
        api = _kube(args)
        for obj in static_volume(plan.name, args.namespace, info["file_system_id"], info["dns_name"],
                                 info["mount_name"], plan.size_gib):
            action = ensure(api, obj)
            say(f"{describe(obj)}: {action}")
            out["kubernetes"].append({"object": describe(obj), "action": action})
        out["claim"] = plan.name
        say(f"jobs use it with:  storage: {{claim: {plan.name}}}  (namespace {args.namespace})")
    if args.json:
        return emit_json(out)
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    from fsdpkit.aws import fsx

    fs = fsx.find(_aws(args), args.name)
    if fs is None:
        raise UserError(f"name: no FSx file system named {args.name!r} (fsdpkit storage fsx create {args.name} ...)")
    info = fsx.summary(fs)
    if args.json:
        return emit_json(info)
    for k, v in info.items():
        print(f"{k:20s} {v}")
    return 0


def cmd_delete(args: argparse.Namespace) -> int:
    from fsdpkit.aws import fsx
    from fsdpkit.cluster.apply import describe, remove
    from fsdpkit.cluster.storage import static_volume

    if args.dry_run:
        fs = fsx.find(_aws(args), args.name)
        summary = fsx.summary(fs) if fs else None
        objects = [] if args.no_k8s else [describe(o) for o in static_volume(args.name, args.namespace, "", "", "", 0)]
        if args.json:
            return emit_json({"file_system": summary, "kubernetes": objects})
        for what in objects:
            print(f"would delete {what} (if present)")
        print(f"would delete FSx {summary['file_system_id']}" if summary else f"no FSx named {args.name}")
        return 0
    if not confirmed(args, f"FSx {args.name} and every file on it",
                     f"delete FSx file system {args.name} and all its files?"):
        return 1
    say = progress(args)
    out: dict[str, Any] = {"kubernetes": []}
    if not args.no_k8s:  # the claim first, so no new pod mounts a file system on its way out
        api = _kube(args)
        for obj in reversed(static_volume(args.name, args.namespace, "", "", "", 0)):
            action = remove(api, obj)
            say(f"{describe(obj)}: {action}")
            out["kubernetes"].append({"object": describe(obj), "action": action})
    out["deleted"] = fsx.delete(_aws(args), args.name, say)
    return emit_json(out) if args.json else 0


def cmd_storage_class(args: argparse.Namespace) -> int:

    from fsdpkit.cluster.apply import ensure
    from fsdpkit.cluster.storage import storage_class

    plan = _plan(args)
    if plan.s3 and plan.deployment_type == "PERSISTENT_2":
        raise UserError("s3: PERSISTENT_2 links S3 only through a data repository association; use "
                        "`fsdpkit storage fsx create`, or PERSISTENT_1 / SCRATCH_2 here")
    if args.dry_run and not args.eks_cluster and not (args.subnet_id and args.security_group_id):
        subnet, groups = "<subnet-id>", ["<security-group-id>"]
    else:
        subnet, groups = _network(args)
    obj = storage_class(plan.name, subnet, groups, plan.deployment_type, plan.throughput, plan.s3)
    if args.dry_run:
        if args.json:
            return emit_json({"object": obj})
        print(yamlfile.dump(obj), end="")
        return 0
    action = ensure(_kube(args), obj)
    progress(args)(f"StorageClass/{plan.name}: {action}; claims with storageClassName: {plan.name} get their own FSx")
    return emit_json({"object": f"StorageClass/{plan.name}", "action": action}) if args.json else 0


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="fsdpkit storage", description="Shared storage for checkpoints and data.")
    sub = parser.add_subparsers(dest="kind", required=True, metavar="KIND", parser_class=Parser)
    fsx_p = sub.add_parser("fsx", help="FSx for Lustre: create|status|delete|storage-class")
    verbs = fsx_p.add_subparsers(dest="cmd", required=True, metavar="VERB", parser_class=Parser)

    def common(p: argparse.ArgumentParser, aws: bool = True, kube: bool = True) -> None:
        p.add_argument("name", help="the file system's name (also its PersistentVolumeClaim's)")
        if aws:
            p.add_argument("--region", help="default: your AWS session's (AWS_REGION, profile)")
            p.add_argument("--profile")
        if kube:
            add_namespace(p, "the claim's")
            p.add_argument("--context", help="kubeconfig context")
            p.add_argument("--kubeconfig", help="kubeconfig file")
        p.add_argument("--json", action="store_true")

    def shape(p: argparse.ArgumentParser) -> None:
        p.add_argument("--size", type=int, default=1200, help="GiB: 1200, 2400 or a multiple of 2400")
        p.add_argument("--deployment-type", default="PERSISTENT_2", choices=("PERSISTENT_2", "PERSISTENT_1",
                                                                             "SCRATCH_2"))
        p.add_argument("--throughput", type=int, help="MB/s per TiB (PERSISTENT_2: 125, 250, 500, 1000; "
                       "PERSISTENT_1: 50, 100, 200)")
        p.add_argument("--s3", help="s3://bucket[/prefix] to import from and export to")
        p.add_argument("--eks-cluster", help="take VPC subnet and cluster security group from this EKS cluster")
        p.add_argument("--subnet-id", help="subnet (must be in the cluster's VPC)")
        p.add_argument("--security-group-id", action="append", help="security group (repeatable)")
        p.add_argument("--dry-run", action="store_true", help="print what would be created")

    p = verbs.add_parser("create", help="create the file system, wait until AVAILABLE, then its PV and PVC")
    common(p)
    shape(p)
    p.add_argument("--no-wait", action="store_true", help="return once creation has started (no PV/PVC yet)")
    p.add_argument("--no-k8s", action="store_true", help="do not create the PersistentVolume and claim")
    p.add_argument("--timeout", type=duration, default=3600, help="how long to wait for AVAILABLE: seconds, or 1h")
    p.add_argument("--poll", type=duration, default=15, help=argparse.SUPPRESS)
    p.set_defaults(func=cmd_create)
    declare(p, Effect.REMOTE | Effect.CREATES | Effect.COSTS | Effect.LONG)

    p = verbs.add_parser("status", help="lifecycle, DNS and mount name, size, throughput")
    common(p, kube=False)
    p.set_defaults(func=cmd_status)
    declare(p, Effect.REMOTE)

    p = verbs.add_parser("delete", help="delete the claim and volume, then the file system (asks first)")
    common(p)
    p.add_argument("--yes", action="store_true", help="do not ask for confirmation")
    p.add_argument("--no-k8s", action="store_true", help="leave the PersistentVolume and claim alone")
    p.add_argument("--dry-run", action="store_true", help="print what would be deleted")
    p.set_defaults(func=cmd_delete)
    declare(p, Effect.REMOTE | Effect.DELETES | Effect.LONG)

    p = verbs.add_parser("storage-class", help="dynamic provisioning: a StorageClass whose claims each get an FSx")
    common(p)
    shape(p)
    p.set_defaults(func=cmd_storage_class)
    declare(p, Effect.REMOTE | Effect.CREATES)
    return parser


def main(argv: list[str] | None = None) -> int:
    return dispatch(build_parser(), list(sys.argv[1:] if argv is None else argv))
