"""`fsdpkit cluster check`: a pass / warn / fail line per readiness check, with what to do."""

from __future__ import annotations

import argparse
import sys

from fsdpkit.cli.output import Parser, dispatch, emit_json

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
    return 1 if fails else 0


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="fsdpkit cluster", description="Check that a Kubernetes cluster is ready to train.")
    sub = parser.add_subparsers(dest="cmd", required=True, metavar="VERB", parser_class=Parser)
    p = sub.add_parser("check", help="nodes, GPUs, EFA, device plugins, operators, storage: pass/warn/fail")
    p.add_argument("--context", help="kubeconfig context (default: the current one)")
    p.add_argument("--kubeconfig", help="kubeconfig file (default: $KUBECONFIG or ~/.kube/config)")
    p.add_argument("--eks-cluster", help="an EKS cluster by name (builds its own token; no kubeconfig needed)")
    p.add_argument("--region", help="AWS region of --eks-cluster")
    p.add_argument("--json", action="store_true", help="one JSON envelope on stdout")
    p.set_defaults(func=cmd_check)
    return parser


def main(argv: list[str] | None = None) -> int:
    return dispatch(build_parser(), list(sys.argv[1:] if argv is None else argv))
