"""`fsdpkit cluster check`: a pass / warn / fail line per readiness check, with what to do."""

from __future__ import annotations

import argparse
import sys

from fsdpkit.cli.output import Parser, dispatch, emit_json
from fsdpkit.errors import UserError

_MARK = {"pass": "PASS", "warn": "WARN", "fail": "FAIL"}


def cmd_check(args: argparse.Namespace) -> int:
    from fsdpkit.cluster.checks import node_table, run_checks
    from fsdpkit.cluster.client import connect

    report = run_checks(connect(args.context, args.kubeconfig, args.eks_cluster, args.region))
    if args.json:
        emit_json(report.to_dict())
        return 1 if report.failed else 0
    for row in node_table(report.nodes):
        print(row)
    print()
    for c in report.checks:
        print(f"{_MARK[c.status]}  {c.name}: {c.detail}")
        if c.fix and c.status != "pass":
            print(f"      fix: {c.fix}")
    fails = sum(c.status == "fail" for c in report.checks)
    warns = sum(c.status == "warn" for c in report.checks)
    print(f"\n{'not ready' if fails else 'ready'}: {fails} failed, {warns} warning(s)")
    if args.fix:
        _fix([c for c in report.checks if c.status != "pass" and c.remedy], args.yes)
    return 1 if fails else 0


def _fix(checks: list, assume_yes: bool) -> None:
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
        answer = "y" if assume_yes else input("  run this now? [y/N] ").strip().lower()
        if answer not in ("y", "yes"):
            print("  skipped")
            continue
        rc = subprocess.run(["/bin/sh", "-c", c.remedy]).returncode
        print(f"  {'done' if rc == 0 else f'failed (exit {rc})'}; run `fsdpkit cluster check` again to confirm")


def cmd_validate(args: argparse.Namespace) -> int:
    from fsdpkit.cluster import validate
    from fsdpkit.cluster.client import connect

    api = connect(args.context, args.kubeconfig, args.eks_cluster, args.region)
    if args.what == "gpu":
        rows = validate.validate_gpu(api, args.namespace, args.image or validate.CUDA_IMAGE, poll=args.poll)
        failed = any(r["status"] == "fail" for r in rows)
        if args.json:
            emit_json(rows)
        else:
            for r in rows:
                print(f"{_MARK[r['status']]}  {r['node']}: {r['detail']}")
        return 1 if failed else 0
    if not args.instance_type:
        raise UserError("validate nccl needs --instance-type (for example p5.48xlarge)")
    out = validate.validate_nccl(api, args.nodes, args.instance_type, args.namespace,
                                 args.image or validate.NCCL_TESTS_IMAGE, poll=args.poll)
    if args.json:
        emit_json(out)
    else:
        for row in out["rows"]:
            print(f"{row['size']:>14} B  busbw {row['busbw']:8.2f} GB/s  in-place {row['busbw_inplace']:8.2f} GB/s")
        print(f"{_MARK[out['status']]}  NCCL all-reduce over {out['network']}: {out['detail']}")
    return 1 if out["status"] == "fail" else 0


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="fsdpkit cluster", description="Check that a Kubernetes cluster is ready to train.")
    sub = parser.add_subparsers(dest="cmd", required=True, metavar="VERB", parser_class=Parser)
    p = sub.add_parser("check", help="nodes, GPUs, EFA, device plugins, operators, storage: pass/warn/fail")
    p.add_argument("--context", help="kubeconfig context (default: the current one)")
    p.add_argument("--kubeconfig", help="kubeconfig file (default: $KUBECONFIG or ~/.kube/config)")
    p.add_argument("--fix", action="store_true", help="offer the known remedy for each missing component, "
                   "and run it when you confirm")
    p.add_argument("--yes", action="store_true", help="with --fix: run the remedies without asking")
    p.add_argument("--eks-cluster", help="an EKS cluster by name (builds its own token; no kubeconfig needed)")
    p.add_argument("--region", help="AWS region of --eks-cluster")
    p.add_argument("--json", action="store_true", help="one JSON envelope on stdout")
    p.set_defaults(func=cmd_check)

    p = sub.add_parser("validate", help="run validation workloads: gpu (nvidia-smi per GPU node) or nccl "
                       "(nccl-tests all_reduce_perf across nodes)")
    p.add_argument("what", choices=("gpu", "nccl"))
    p.add_argument("--nodes", type=int, default=2, help="nccl: nodes to test across")
    p.add_argument("--instance-type", help="nccl: the instance type of those nodes (p5.48xlarge, ...)")
    p.add_argument("--image", help="gpu: a CUDA base image; nccl: an image with nccl-tests, aws-ofi-nccl, MPI")
    p.add_argument("-n", "--namespace", default="default")
    p.add_argument("--poll", type=float, default=5.0, help=argparse.SUPPRESS)
    for flag in ("--context", "--kubeconfig", "--eks-cluster", "--region"):
        p.add_argument(flag)
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_validate)
    return parser


def main(argv: list[str] | None = None) -> int:
    return dispatch(build_parser(), list(sys.argv[1:] if argv is None else argv))
