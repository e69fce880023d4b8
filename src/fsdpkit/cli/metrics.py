"""`fsdpkit metrics JOB --prometheus URL`: each node's GPU utilisation and memory over the job's
lifetime from Prometheus (DCGM exporter series), signed with SigV4 for Amazon Managed Prometheus;
`--out FILE` keeps the series for `fsdpkit report RUN_DIR --cluster-metrics FILE`."""

from __future__ import annotations

import argparse
import datetime as dt
import json
import math
import os
from pathlib import Path

from fsdpkit.aws.sigv4 import amp_region, sigv4_auth
from fsdpkit.cli.output import (
    Parser,
    add_namespace,
    check_new,
    dispatch,
    emit_json,
    finding_message,
    print_findings,
    write_new,
)
from fsdpkit.effects import Effect, declare
from fsdpkit.envelope import duration
from fsdpkit.errors import UserError
from fsdpkit.jobs.backends.base import Target
from fsdpkit.jobs.backends.kube_observe import KubeObserver
from fsdpkit.jobs.prometheus import job_utilisation

_BARS = "▁▂▃▄▅▆▇█"


def _time(value: str) -> dt.datetime:
    return dt.datetime.fromisoformat(value.replace("Z", "+00:00"))


def _window(args: argparse.Namespace) -> tuple[dt.datetime, dt.datetime]:
    """--since, else the job's lifetime as its operator recorded it (start to completion, or now)."""
    now = dt.datetime.now(dt.timezone.utc)
    if args.since:
        return now - dt.timedelta(seconds=args.since), now
    details = KubeObserver(Target(args.context, args.kubeconfig, args.namespace)).status(args.job).details
    if not details.get("startTime"):
        raise UserError(f"job {args.job} has no start time yet (not started); pass --since 2h for a window")
    end = _time(details["completionTime"]) if details.get("completionTime") else now
    return _time(details["startTime"]), end


def _spark(points: list[list[float]], width: int = 40) -> str:
    """Utilisation (0-100) over time as one line of block characters, `width` buckets."""
    if not points:
        return ""
    per = max(1, math.ceil(len(points) / width))
    means = [sum(v for _, v in points[i:i + per]) / len(points[i:i + per]) for i in range(0, len(points), per)]
    return "".join(_BARS[min(len(_BARS) - 1, int(v / 100 * len(_BARS)))] for v in means)


def run(args: argparse.Namespace) -> int:
    if args.out:   # before the cluster and Prometheus are asked: a refusal costs nothing
        check_new(Path(args.out), args.force)
    url = args.prometheus or os.environ.get("FSDPKIT_PROMETHEUS_URL")
    if not url:
        raise UserError("no Prometheus to ask: pass --prometheus URL (an AMP workspace's URL, "
                        "https://aps-workspaces.REGION.amazonaws.com/workspaces/ws-ID) or set FSDPKIT_PROMETHEUS_URL")
    amp = amp_region(url)
    auth = sigv4_auth("aps", args.region or amp, args.profile) if (args.sigv4 or amp) else None
    start, end = _window(args)
    if args.step is not None and args.step < 1:
        raise UserError(f"--step {args.step}: seconds between points, at least 1")
    step = args.step or max(15, math.ceil((end - start).total_seconds() / 250))
    data = job_utilisation(url.rstrip("/"), args.job, args.namespace, start, end, step, auth)
    if args.out:
        write_new(Path(args.out), json.dumps(data) + "\n", args.force)
    found = data["findings"]
    code = 1 if found else 0
    if args.json:
        first = found[0] if found else {}
        return emit_json(data, code, finding_message(first) if found else "", hint=first.get("fix"))
    print(f"{args.job}: {len(data['nodes'])} pods on {len({n['node'] for n in data['nodes']})} nodes, "
          f"{data['start'][:19]} to {data['end'][:19]} every {step} s")
    for n in data["nodes"]:
        util, mem = n.get("gpu_util_pct"), n.get("gpu_mem_used_mib")
        gpu = f"GPU {util['mean']:.0f}% (min {util['min']:.0f}, max {util['max']:.0f})" if util else "no GPU series"
        memory = f", memory up to {mem['max'] / 1024:.1f} GiB per GPU" if mem else ""
        print(f"  {n['pod']} on {n['node']}: {gpu}{memory}  {_spark(n['series'].get('gpu_util_pct', []))}")
    print_findings(found)
    if args.out:
        print(f"series in {args.out} (plot them: fsdpkit report RUN_DIR --cluster-metrics {args.out})")
    return code


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="fsdpkit metrics", description="Each node's GPU utilisation and memory over a job's "
                    "lifetime, from Prometheus (the DCGM exporter's series, as HyperPod's observability add-on or "
                    "the GPU operator scrape them). Amazon Managed Prometheus is queried with SigV4 from the "
                    "standard AWS credential chain. Exit 1 when a node lies far from the others (a straggler).")
    parser.add_argument("job", metavar="NAME", help="the job (its pods are NAME-...)")
    parser.add_argument("--prometheus", metavar="URL", help="Prometheus or AMP workspace URL (default: "
                        "$FSDPKIT_PROMETHEUS_URL)")
    add_namespace(parser)
    parser.add_argument("--since", type=duration, help="a window ending now (90m, 6h, 2d) instead of the job's "
                        "lifetime, which is read from the cluster")
    parser.add_argument("--step", type=int, help="seconds between points (default: about 250 points)")
    parser.add_argument("--sigv4", action="store_true", help="sign with SigV4 for a URL that does not look like "
                        "AMP (a proxy or VPC endpoint); AMP workspace URLs are always signed")
    parser.add_argument("--region", help="the region to sign for (default: the AMP URL's, else your session's)")
    parser.add_argument("--profile", help="AWS profile (default: the standard credential chain)")
    parser.add_argument("--out", help="also write the series as JSON (for fsdpkit report --cluster-metrics)")
    parser.add_argument("--force", action="store_true", help="overwrite --out where it exists")
    parser.add_argument("--context", help="kubeconfig context, to read the job's lifetime")
    parser.add_argument("--kubeconfig", help="kubeconfig file")
    parser.add_argument("--json", action="store_true", help="one JSON envelope on stdout")
    parser.set_defaults(func=run)
    declare(parser, Effect.REMOTE | Effect.LONG, out=Effect.WRITES, force=Effect.OVERWRITES)
    return parser


def main(argv: list[str]) -> int:
    return dispatch(build_parser(), argv)
