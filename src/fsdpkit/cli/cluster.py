"""`fsdpkit cluster config|create|delete|addons|check|validate`: provision an EKS cluster with eksctl,
install what training needs on it, and check that it is ready (pass / warn / fail with what to do)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from fsdpkit import kube_names as names
from fsdpkit import yamlfile
from fsdpkit.aws.session import pick_region
from fsdpkit.cli.output import Parser, add_namespace, confirmed, dispatch, emit_json, progress, write_new
from fsdpkit.effects import Effect, declare
from fsdpkit.envelope import duration
from fsdpkit.errors import UserError

_MARK = {"pass": "PASS", "warn": "WARN", "fail": "FAIL", "unread": "GAP "}


def cmd_check(args: argparse.Namespace) -> int:
    from fsdpkit.cluster.checks import node_table, run_checks
    from fsdpkit.cluster.client import connect

    report = run_checks(connect(args.context, args.kubeconfig, args.eks_cluster, args.region), args.team)
    if args.json:
        return emit_json(report.to_dict(), 1 if report.failed else 0, *_failure(report.checks))
    for row in node_table(report.nodes):
        print(row)
    print()
    for c in report.checks:
        print(f"{_MARK[c.status]}  {c.name}: {c.detail}")
        if c.fix and c.status != "pass":
            print(f"      fix: {c.fix}")
    fails = sum(c.status == "fail" for c in report.checks)
    warns = sum(c.status == "warn" for c in report.checks)
    gaps = sum(c.status == "unread" for c in report.checks)
    verdict = "not ready" if fails else "ready as far as this user can read" if gaps else "ready"
    print(f"\n{verdict}: {fails} failed, {warns} warning(s)" + (f", {gaps} not read" if gaps else ""))
    if args.fix:
        _fix([c for c in report.checks if c.status != "pass" and c.remedy], args.yes)
    return 1 if fails else 0


def cmd_rbac(args: argparse.Namespace) -> int:
    from fsdpkit.cluster.rbac import role_manifests
    from fsdpkit.jobs.backends.kube_api import KINDS

    names.check("--namespace", args.namespace, "label")
    names.check("--name", args.name, "subdomain")
    if args.service_account is not None:
        if args.service_account.count(":") > 1:
            raise UserError(f"--service-account: {args.service_account!r} is not NAME or NAMESPACE:NAME")
        sa_namespace, colon, sa = args.service_account.rpartition(":")
        if colon:
            names.check("--service-account's namespace", sa_namespace, "label")
        names.check("--service-account", sa, "subdomain")
    backends = args.backend or ["trainjob", "pytorchjob", "hyperpod"]
    kinds = [(k.group, k.plural) for k in KINDS.values() if k.backend in backends]
    objs = role_manifests(args.namespace, args.name, kinds, args.user, args.service_account, args.group)
    if args.json:
        return emit_json({"manifests": objs})
    print(yamlfile.dump_all(objs), end="")
    return 0


def cmd_team(args: argparse.Namespace) -> int:
    from fsdpkit.cluster.kueue import TeamPlan, node_quota, team_objects
    from fsdpkit.hardware.instances import lookup

    inst = lookup(args.instance_type)
    priorities = []
    for given in args.priority or []:
        name, sep, value = given.partition("=")
        if not sep or not value.lstrip("-").isdigit():
            raise UserError(f"--priority: {given!r} is not NAME=VALUE (an integer; higher runs first)")
        priorities.append((name, int(value)))
    objs = team_objects(TeamPlan(args.name, inst.name, args.nodes, args.cohort, args.borrow_nodes, args.lend_nodes,
                                 tuple(priorities)), node_quota(inst))
    if not args.apply:
        if args.json:
            return emit_json({"manifests": objs})
        print(yamlfile.dump_all(objs), end="")
        return 0
    return _apply(args, objs, "install Kueue: fsdpkit cluster addons install --only kueue (HyperPod: turn on task "
                              "governance)")


def _apply(args: argparse.Namespace, objs: list[dict[str, Any]], installs: str, update: bool = False) -> int:
    """Create each object that is not there yet (their APIs served first, else one line naming
    `installs`), each said; an existing one is left as it is, or with `update` made ours."""
    from fsdpkit.cluster.apply import describe, ensure, require_api
    from fsdpkit.cluster.client import connect

    api = connect(args.context, args.kubeconfig, args.eks_cluster, args.region)
    require_api(api, objs, installs)
    say = progress(args)
    done = []
    for obj in objs:
        action = ensure(api, obj, update)
        say(f"{describe(obj)}: {action}" + (" (left as it is: delete it to apply another)" if action == "exists"
                                            else ""))
        done.append({"object": describe(obj), "action": action})
    return emit_json({"applied": done, "manifests": objs}) if args.json else 0


def _failure(checks: list[Any]) -> tuple[str | None, str, str | None]:
    """The envelope's message, code and hint for checks (Check objects or dicts with status,
    detail, fix and name or node) of which some failed: the first failure and how many."""
    rows = [c if isinstance(c, dict) else vars(c) for c in checks]
    failed = [c for c in rows if c["status"] == "fail"]
    if not failed:
        return None, "failed", None
    first = failed[0]
    return (f"{len(failed)} check(s) failed; first: {first.get('name') or first.get('node')}: {first['detail']}",
            "failed", first.get("fix") or None)


def _fix(checks: list[Any], assume_yes: bool) -> None:
    """Offer each known remedy; run it only after the user says yes (or --yes). Never silently."""
    import shutil
    import subprocess

    if not checks:
        print("--fix: nothing fsdpkit knows how to fix")
    for c in checks:
        print(f"\n--fix {c.name}:\n  {c.remedy}")
        tools = {w for w in ("kubectl", "helm") if w in c.remedy.split()}
        missing = [t for t in sorted(tools) if shutil.which(t) is None]
        if missing:
            print(f"  cannot run it here: {', '.join(missing)} is not installed")
            continue
        try:
            answer = "y" if assume_yes else input("  run this now? [y/N] ").strip().lower()
        except EOFError:   # stdin closed or empty (a script, an agent): nobody answered
            print("\n  not run: no answer on stdin; add --yes to run the remedies without asking")
            continue
        if answer not in ("y", "yes"):
            print("  skipped")
            continue
        rc = subprocess.run(["/bin/sh", "-c", c.remedy]).returncode
        print(f"  {'done' if rc == 0 else f'failed (exit {rc})'}; run `fsdpkit cluster check` again to confirm")


def cmd_validate(args: argparse.Namespace) -> int:
    from fsdpkit.cluster import validate
    from fsdpkit.cluster.client import connect

    if args.dry_run:  # what would run, from the flags alone: no cluster asked
        if args.what != "nccl" or not args.instance_type:
            raise UserError("--dry-run prints the nccl-tests MPIJob: use it with `validate nccl --instance-type ...`")
        job = validate.nccl_mpijob("fsdpkit-nccl-dry-run", args.namespace, args.nodes, args.instance_type,
                                   args.image or validate.NCCL_TESTS_IMAGE)
        if args.json:
            return emit_json({"dry_run": True, "manifest": job})
        print(yamlfile.dump(job), end="")
        return 0
    api = connect(args.context, args.kubeconfig, args.eks_cluster, args.region)
    if args.what == "gpu":
        rows = validate.validate_gpu(api, args.namespace, args.image or validate.CUDA_IMAGE, poll=args.poll)
        failed = any(r["status"] == "fail" for r in rows)
        if args.json:
            return emit_json(rows, 1 if failed else 0, *_failure(rows))
        for r in rows:
            print(f"{_MARK[r['status']]}  {r['node']}: {r['detail']}")
        return 1 if failed else 0
    if not args.instance_type:
        raise UserError("validate nccl needs --instance-type (for example p5.48xlarge)")
    out = validate.validate_nccl(api, args.nodes, args.instance_type, args.namespace,
                                 args.image or validate.NCCL_TESTS_IMAGE, poll=args.poll)
    if args.json:
        return emit_json(out, 1 if out["status"] == "fail" else 0, *_failure([{"name": "nccl", **out}]))
    else:
        for row in out["rows"]:
            print(f"{row['size']:>14} B  busbw {row['busbw']:8.2f} GB/s  in-place {row['busbw_inplace']:8.2f} GB/s")
        print(f"{_MARK[out['status']]}  NCCL all-reduce over {out['network']}: {out['detail']}")
    return 1 if out["status"] == "fail" else 0


def cmd_config(args: argparse.Namespace) -> int:
    from fsdpkit.aws.eksctl import ClusterPlan, render

    region = pick_region(args.region)
    plan = ClusterPlan(args.name, region, args.instance_type, args.nodes, zone=args.zone or "", efa=args.efa,
                       capacity_reservation=args.capacity_reservation or "", capacity_block=args.capacity_block,
                       placement_group=args.placement_group or "", k8s_version=args.k8s_version,
                       volume_size=args.volume_size, system_instance_type=args.system_instance_type,
                       system_nodes=args.system_nodes, provisioner=args.provisioner)
    config = render(plan)
    text = yamlfile.dump(config)
    if args.out:
        write_new(Path(args.out), text, args.force)
        progress(args)(f"wrote {args.out}; next: fsdpkit cluster create --config {args.out}" + (
            f", then the GPU NodePool: fsdpkit cluster nodepool --name {plan.name} --region {region} --instance-type "
            f"{plan.instance_type} --nodes {plan.nodes}" if plan.provisioner == "karpenter" else ""))
    if args.json:
        return emit_json({"config": config, "path": args.out})
    if not args.out:
        print(text, end="")
    return 0


def cmd_nodepool(args: argparse.Namespace) -> int:
    from fsdpkit.aws.karpenter import NodePoolPlan, render

    region = pick_region(args.region)
    plan = NodePoolPlan(args.name, region, args.instance_type, args.nodes, zone=args.zone or "",
                        capacity_type=args.capacity_type, capacity_reservation=args.capacity_reservation or "",
                        capacity_reservation_tag=args.capacity_reservation_tag or "", efa=args.efa,
                        placement_group=args.placement_group or "", k8s_version=args.k8s_version,
                        volume_size=args.volume_size, instance_profile=args.instance_profile or "")
    objs = render(plan)
    if args.dry_run:
        if args.json:
            return emit_json({"dry_run": True, "manifests": objs})
        print(yamlfile.dump_all(objs), end="")
        return 0
    names = ", ".join(f"{o['kind']}/{o['metadata']['name']}" for o in objs)
    if not confirmed(args, names, f"create {names} (or update them where they differ)? Karpenter then launches up "
                                  f"to {plan.nodes} {plan.instance_type} (billed while they run) when GPU pods are "
                                  "pending", verb="create"):
        return 1
    # Asked again with another size (or after fsdpkit's layout changed): the pool becomes this one, never
    # "exists" with the old limit.
    return _apply(args, objs, "Karpenter is not installed: make the cluster with `fsdpkit cluster config "
                              "--provisioner karpenter` and `fsdpkit cluster create`, or install Karpenter",
                  update=True)


def cmd_create_delete(args: argparse.Namespace) -> int:
    from fsdpkit.aws import eksctl

    config = eksctl.load_config(args.config)
    groups = eksctl.placement_groups(config)
    region, name = config["metadata"]["region"], config["metadata"]["name"]
    say = progress(args)
    command = eksctl.eksctl_command(args.cmd, args.config)
    if args.dry_run:
        if args.json:
            return emit_json({"cluster": name, "region": region, "placement_groups": groups, "command": command,
                              "ran": False})
        verb = "create" if args.cmd == "create" else "delete (fsdpkit's own only)"
        for g in groups:
            print(f"would {verb} placement group {g}")
        print(f"would run: {' '.join(command)}")
        return 0
    if args.cmd == "delete" and not confirmed(args, f"cluster {name} and everything on it",
                                              f"delete EKS cluster {name} in {region} and its nodes?"):
        return 1
    from fsdpkit.aws.session import aws_errors, connect

    aws = connect(region, args.profile)
    ec2 = aws.client("ec2")
    out: dict[str, Any] = {"cluster": name, "region": region}
    if args.cmd == "create":
        with aws_errors("creating the placement group", "ec2"):
            out["placement_groups_created"] = eksctl.ensure_placement_groups(ec2, groups, say)
        out.update(eksctl.run_eksctl("create", args.config, say))
    else:
        out.update(eksctl.run_eksctl("delete", args.config, say))
        removed: list[str] = []
        if out["ran"]:  # the nodes are gone only once eksctl has finished
            with aws_errors("deleting the placement group", "ec2"):
                removed = eksctl.delete_placement_groups(ec2, groups, say)
        elif groups:
            say("once the cluster is gone, run this command again to remove the placement group(s) "
                + ", ".join(groups))
        out["placement_groups_deleted"] = removed
    return emit_json(out) if args.json else 0


def cmd_addons(args: argparse.Namespace) -> int:
    from fsdpkit.cluster import addons

    components = [c.strip() for c in args.only.split(",")] if args.only else list(addons.DEFAULT_COMPONENTS)
    unknown = [c for c in components if c not in addons.COMPONENTS]
    if unknown:
        raise UserError(f"--only: {', '.join(unknown)} is not one of {', '.join(addons.COMPONENTS)}")
    steps = addons.plan(components, args.etcd, args.namespace)
    if args.dry_run:
        if args.json:
            return emit_json({"steps": steps})

        for s in steps:
            if "object" in s:
                print("---\n" + yamlfile.dump(s["object"]), end="")
            else:
                print(f"# {s['component']}: {s['command']}")
        return 0
    from fsdpkit.cluster.client import connect

    api = connect(args.context, args.kubeconfig, args.eks_cluster, args.region)
    out = addons.install(api, steps, progress(args))
    # A step that failed (an upstream installer's exit code) fails the command, as a failed check does.
    steps = [{"name": s["component"], "status": "fail", "detail": s["action"]} for s in out["steps"]
             if s["action"].startswith("failed")]
    failed = steps + [c for c in out["checks"] if c["status"] == "fail"]
    if args.json:
        return emit_json(out, 1 if failed else 0, *_failure(failed))
    return 1 if failed else 0


def _kube_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--context", help="kubeconfig context (default: the current one)")
    p.add_argument("--kubeconfig", help="kubeconfig file (default: $KUBECONFIG or ~/.kube/config)")
    p.add_argument("--eks-cluster", help="an EKS cluster by name (builds its own token; no kubeconfig needed)")
    p.add_argument("--region", help="AWS region of --eks-cluster")


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="fsdpkit cluster", description="Check that a Kubernetes cluster is ready to train.")
    sub = parser.add_subparsers(dest="cmd", required=True, metavar="VERB", parser_class=Parser)
    p = sub.add_parser("config", help="write an eksctl ClusterConfig: system + GPU node group (EFA, one zone, "
                       "placement group, capacity reservation), add-ons, IAM OIDC")
    p.add_argument("--name", required=True, help="EKS cluster name")
    p.add_argument("--region", help="AWS region (default: $AWS_REGION)")
    p.add_argument("--instance-type", required=True, help="GPU node type (p5.48xlarge, g6e.12xlarge, ...)")
    p.add_argument("--nodes", type=int, required=True, help="GPU nodes (at least 1)")
    p.add_argument("--zone", help="availability zone of the GPU nodes (default: the region's a zone; required with "
                   "--capacity-reservation)")
    p.add_argument("--efa", choices=("auto", "on", "off"), default="auto", help="EFA interfaces (auto: where the "
                   "instance type has them)")
    p.add_argument("--capacity-reservation", help="On-Demand Capacity Reservation or Capacity Block id (cr-...)")
    p.add_argument("--capacity-block", action="store_true", help="the reservation is an EC2 Capacity Block for ML")
    p.add_argument("--placement-group", help="an existing cluster placement group (default: <name>-gpu, created "
                   "by `cluster create`)")
    p.add_argument("--k8s-version", default="1.33", help="Kubernetes minor version")
    p.add_argument("--volume-size", type=int, default=500, help="GPU node root volume, GiB")
    p.add_argument("--system-instance-type", default="m6i.xlarge")
    p.add_argument("--system-nodes", type=int, default=2)
    p.add_argument("--provisioner", choices=("nodegroup", "karpenter"), default="nodegroup",
                   help="how GPU nodes come: an eksctl managed node group of --nodes, or Karpenter installed by "
                   "eksctl with the GPU nodes from `fsdpkit cluster nodepool` (reserved capacity by id or tag, "
                   "scale to zero)")
    p.add_argument("--out", help="write the config to this file (default: print it)")
    p.add_argument("--force", action="store_true", help="overwrite --out where it exists")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_config)
    declare(p, Effect.REMOTE, out=Effect.WRITES, force=Effect.OVERWRITES)

    for verb, text in (("create", "create the placement group, then run `eksctl create cluster -f` (or print "
                                  "the command when eksctl is not installed)"),
                       ("delete", "run `eksctl delete cluster -f --wait`, then remove fsdpkit's placement group")):
        p = sub.add_parser(verb, help=text)
        p.add_argument("--config", required=True, help="the ClusterConfig from `fsdpkit cluster config --out`")
        p.add_argument("--profile", help="AWS profile")
        p.add_argument("--dry-run", action="store_true", help="print what would be created or run")
        if verb == "delete":
            p.add_argument("--yes", action="store_true", help="do not ask for confirmation")
        p.add_argument("--json", action="store_true")
        p.set_defaults(func=cmd_create_delete)
        declare(p, Effect.REMOTE | Effect.LONG | (Effect.CREATES | Effect.COSTS if verb == "create"
                                                  else Effect.DELETES))

    p = sub.add_parser("nodepool", help="a Karpenter NodePool and EC2NodeClass for one GPU instance type: "
                       "the accelerated AMI, every EFA interface, one zone, on-demand or reserved capacity (an ODCR "
                       "or Capacity Block by id or tag), never disrupting a node a training pod runs on")
    p.add_argument("--name", required=True, help="the EKS cluster's name (Karpenter's discovery tags, the "
                   "instance profile eksctl made)")
    p.add_argument("--instance-type", required=True, help="GPU node type (p5.48xlarge, ...)")
    p.add_argument("--nodes", type=int, required=True, help="the most GPU nodes the pool may hold (its GPU limit)")
    p.add_argument("--zone", help="availability zone (default: the region's a zone; a reservation's own)")
    p.add_argument("--capacity-type", choices=("on-demand", "reserved"), default="on-demand",
                   help="reserved: only from --capacity-reservation or --capacity-reservation-tag")
    p.add_argument("--capacity-reservation", help="an On-Demand Capacity Reservation or Capacity Block id (cr-...)")
    p.add_argument("--capacity-reservation-tag", help="KEY=VALUE: every reservation carrying this tag")
    p.add_argument("--efa", choices=("auto", "on", "off"), default="auto", help="EFA interfaces (auto: where the "
                   "instance type has them)")
    p.add_argument("--placement-group", help="an existing cluster placement group by name")
    p.add_argument("--k8s-version", default="1.33", help="the cluster's Kubernetes minor version (the AMI's)")
    p.add_argument("--volume-size", type=int, default=500, help="root volume, GiB")
    p.add_argument("--instance-profile", help="the nodes' instance profile (default: the one eksctl's Karpenter "
                   "install made, eksctl-KarpenterNodeInstanceProfile-NAME)")
    p.add_argument("--dry-run", action="store_true", help="print the NodePool and EC2NodeClass, apply nothing")
    p.add_argument("--yes", action="store_true", help="do not ask for confirmation")
    _kube_flags(p)
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_nodepool)
    declare(p, Effect.REMOTE | Effect.CREATES | Effect.COSTS)

    addons_p = sub.add_parser("addons", help="install the device plugins and operators training needs")
    addons_sub = addons_p.add_subparsers(dest="addons_cmd", required=True, metavar="VERB", parser_class=Parser)
    p = addons_sub.add_parser("install", help="NVIDIA and EFA device plugins, Kubeflow Trainer v2 with fsdpkit's "
                              "runtime, KubeRay (pinned, each once), then the readiness checks")
    p.add_argument("--only", help="comma-separated subset of: nvidia, efa, trainer, training-operator (legacy v1, "
                   "only when named), kuberay, mpi (the MPI operator, for `cluster validate nccl`; only when named), "
                   "kueue (teams' quotas, `cluster team`; only when named)")
    p.add_argument("--etcd", action="store_true", help="also one etcd member + Service for etcd rendezvous")
    add_namespace(p, "with --etcd: etcd's", when="etcd")
    p.add_argument("--dry-run", action="store_true", help="print the manifests and commands, apply nothing")
    _kube_flags(p)
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_addons)
    declare(p, Effect.REMOTE | Effect.CREATES | Effect.LONG)

    p = sub.add_parser("rbac", help="the Role (and RoleBinding) a team needs in its namespace to run fsdpkit's job "
                       "verbs, for the cluster's admin to apply")
    p.add_argument("--namespace", "-n", required=True, help="the team's namespace")
    p.add_argument("--backend", action="append", choices=("trainjob", "pytorchjob", "hyperpod"),
                   help="the job backends the team uses (repeatable; default: all three)")
    p.add_argument("--user", help="bind it to this user (as the cluster's authenticator names them)")
    p.add_argument("--group", help="bind it to this group")
    p.add_argument("--service-account", help="bind it to this ServiceAccount: NAME in the namespace, or NS:NAME")
    p.add_argument("--name", default="fsdpkit", help="the Role's and RoleBinding's name")
    p.add_argument("--json", action="store_true", help="one JSON envelope on stdout")
    p.set_defaults(func=cmd_rbac)
    declare(p, Effect.NONE)

    p = sub.add_parser("team", help="a team's Kueue quota, for the cluster's admin to apply: its namespace, "
                       "LocalQueue and ClusterQueue (named as HyperPod task governance names them), the instance "
                       "type's ResourceFlavor, priorities; borrowing and lending within a cohort")
    p.add_argument("--name", required=True, help="the team (namespace hyperpod-ns-NAME)")
    p.add_argument("--instance-type", required=True, help="the GPU instance type of the quota (p5.48xlarge, ...)")
    p.add_argument("--nodes", type=int, required=True, help="the team's nominal quota, in whole nodes")
    p.add_argument("--cohort", help="the cohort the team lends to and borrows from")
    p.add_argument("--borrow-nodes", type=int, help="the most it may borrow, in nodes (default: no limit)")
    p.add_argument("--lend-nodes", type=int, help="the most of its own it lends, in nodes (default: all)")
    p.add_argument("--priority", action="append", help="a WorkloadPriorityClass NAME=VALUE (repeatable; higher "
                   "runs first and preempts lower)")
    p.add_argument("--apply", action="store_true", help="create them on the cluster (each left as it is where it "
                   "exists; needs Kueue: `fsdpkit cluster addons install --only kueue`); default: print them")
    _kube_flags(p)
    p.add_argument("--json", action="store_true", help="one JSON envelope on stdout")
    p.set_defaults(func=cmd_team)
    declare(p, Effect.NONE, apply=Effect.REMOTE | Effect.CREATES)

    p = sub.add_parser("check", help="nodes, GPUs and how they are provisioned, EFA, device plugins, operators, "
                       "storage: pass/warn/fail")
    _kube_flags(p)
    p.add_argument("--team", help="also the team's Kueue quota (HyperPod task governance): its LocalQueue in "
                   "hyperpod-ns-TEAM, its ClusterQueue's nominal quota, use, borrowing and lending")
    p.add_argument("--fix", action="store_true", help="offer the known remedy for each missing component, "
                   "and run it when you confirm")
    p.add_argument("--yes", action="store_true", help="with --fix: run the remedies without asking")
    p.add_argument("--json", action="store_true", help="one JSON envelope on stdout")
    p.set_defaults(func=cmd_check)
    declare(p, Effect.REMOTE, fix=Effect.CREATES)

    p = sub.add_parser("validate", help="run validation workloads: gpu (nvidia-smi per GPU node) or nccl "
                       "(nccl-tests all_reduce_perf across nodes)")
    p.add_argument("what", choices=("gpu", "nccl"))
    p.add_argument("--nodes", type=int, default=2, help="nccl: nodes to test across")
    p.add_argument("--instance-type", help="nccl: the instance type of those nodes (p5.48xlarge, ...)")
    p.add_argument("--image", help="gpu: a CUDA base image; nccl: an image with nccl-tests, aws-ofi-nccl, MPI")
    add_namespace(p, "the validation workloads'")
    p.add_argument("--poll", type=duration, default=5.0, help=argparse.SUPPRESS)
    p.add_argument("--dry-run", action="store_true", help="nccl: print the MPIJob it would run; no cluster needed")
    _kube_flags(p)
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_validate)
    declare(p, Effect.REMOTE | Effect.CREATES | Effect.LONG)   # workloads on the GPU nodes
    return parser


def main(argv: list[str] | None = None) -> int:
    return dispatch(build_parser(), list(sys.argv[1:] if argv is None else argv))
