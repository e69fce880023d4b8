"""What the `fsdpkit job` commands print for a person: a job's state, its pods, nodes and network,
what a submit made, what `--explain` derives, a watch's look (their `--json` is the data itself)."""

from __future__ import annotations

import logging
from typing import Any, cast

from fsdpkit.cli.output import print_findings
from fsdpkit.jobs.backends.base import Snapshot, Submitted
from fsdpkit.jobs.resolved import ResolvedJob
from fsdpkit.jobs.spec import CLUSTER_BACKENDS
from fsdpkit.jobs.status import JobStatus

log = logging.getLogger(__name__)


def span(seconds: int) -> str:
    """1h 05m, 12m 30s, 40s."""
    h, rest = divmod(int(seconds), 3600)
    m, s = divmod(rest, 60)
    return f"{h}h {m:02d}m" if h else f"{m}m {s:02d}s" if m else f"{s}s"


def print_status(st: JobStatus) -> None:
    where = f" ({st.namespace})" if st.namespace else ""
    attempt = f", resubmission {st.attempt}" if st.attempt else ""
    msg = f": {st.message}" if st.message else ""
    print(f"{st.name}{where}: {st.state}{attempt}{msg}")
    for rtype, counts in (st.replicas or {}).items():
        pretty = ", ".join(f"{k} {v}" for k, v in counts.items() if k in ("active", "succeeded", "failed"))
        print(f"  {rtype}: {pretty}")
    if p := st.progress:
        left = f", about {span(p['remaining_s'])} left" if p.get("remaining_s") else ""
        figures = ", ".join(f"{k} {v}" for k, v in p["metrics"].items())
        print(f"  progress: {p['percent']}%{left}; {figures} (posted {p['updated']})")


def print_sources(job: ResolvedJob) -> None:
    width = max(len(s.name) for s in job.sources)
    print(f"{job.spec.name} ({job.spec.backend}) runs with:")
    for s in job.sources:
        value = f"{s.value:,}" if isinstance(s.value, int) else str(s.value)
        print(f"  {s.name:<{width}}  {value:>14}  {s.source}: {s.why}")


def print_submitted(job: ResolvedJob, result: Submitted) -> None:
    """What a submit made (or a dry run would make), as a person reads it."""
    spec = job.spec
    cluster = spec.backend in CLUSTER_BACKENDS
    if result.dry_run:
        checked = " (the API server accepted each)" if result.accepted else ""
        where = f" in namespace {spec.namespace}" if cluster else ""
        print(f"dry run: would create {', '.join(result.made())}{where}{checked}; -o yaml prints them")
        return
    where = f", namespace {spec.namespace}" if cluster else ""
    print(f"submitted {spec.name} ({spec.backend}{where}): {', '.join(result.made())}")
    for r in result.reused or []:
        print(f"  reusing {r} (holds this job's earlier checkpoints)")
    if result.hint:
        print(result.hint)


def ended(st: dict[str, Any]) -> str:
    return f"job {st['name']} ended {st['state']}" + (f": {st['message']}" if st.get("message") else "")


def read_why(name: str) -> str:
    return f"read why with `fsdpkit job logs {name} --previous` and `fsdpkit job status {name}`"


def pods_text(pods: list[dict[str, Any]]) -> str:
    return ", ".join(f"{x['name']} {x['phase']}" + (f" on {x['node']}" if x.get("node") else "") +
                     (f" ({x['reason']})" if x["reason"] else "") +
                     (f" restarts {x['restarts']}" if x["restarts"] else "") for x in pods)


def print_unreachable(nodes: list[dict[str, Any]]) -> None:
    """Nodes that are not ready or whose kubelet does not answer: part of the answer, not an error."""
    for n in nodes:
        since = f" since {n['since']}" if n.get("since") else ""
        print(f"  node {n['node']}{since}: {n['detail']}; its pods: {', '.join(n['pods']) or 'none'}", flush=True)


def network_text(v: dict[str, Any]) -> str:
    """efa (32 NICs, provider efa), from the verdict the trainer reported."""
    parts = (f"{v['nics']} NICs" if v.get("nics") is not None else "",
             f"provider {v['provider']}" if v.get("provider") else "", v.get("detail") or "")
    extra = ", ".join(x for x in parts if x)
    return cast("str", v["transport"] + (f" ({extra})" if extra else ""))


def node_text(n: dict[str, Any]) -> str:
    if n.get("error"):
        return f"  {n['pod']}: not sampled ({n['error']})"
    gpu = (f"GPU {n['gpu_util_pct']:.0f}% {n['gpu_mem_used_gib']:.0f}/{n['gpu_mem_total_gib']:.0f} GiB"
           if n.get("gpu_util_pct") is not None else "no GPUs seen")
    efa = f"EFA {n['efa_gbit_s']:.1f} Gbit/s ({n['efa_devices']} devices)" if n.get("efa_devices") else "no EFA"
    step = f", {n['step_time_s']:.2f} s/step" if n.get("step_time_s") else ""
    seen = n.get("over_watch") or {}
    since = (f" | since watch began: GPU mean {seen['gpu_util_pct_mean']:.0f}% min {seen['gpu_util_pct_min']:.0f}%"
             if seen.get("samples", 0) > 1 and "gpu_util_pct_mean" in seen else "")
    return f"  {n['pod']}" + (f" on {n['node']}" if n.get("node") else "") + f": {gpu}, {efa}{step}{since}"


def print_snapshot(snap: Snapshot) -> None:
    p = snap.progress
    prog = (f" step {p['step']} loss {p['loss']:.4f} {p['tokens_per_s']} tok/s" if "step" in p else "")
    pods = pods_text(snap.pods)
    net = f" | network {network_text(snap.network)}" if snap.network else ""
    waiting = f"no pods yet: {snap.message}" if snap.event else "no pods yet"
    print(f"{snap.name}: {snap.state}{prog}{net} | {pods or waiting}", flush=True)
    for n in snap.nodes:
        print(node_text(n), flush=True)
    print_unreachable(snap.unreachable)
    print_findings(snap.findings)


def print_jobs(rows: list[JobStatus], unread: dict[str, str], listed: bool) -> None:
    """`job list`'s table, and what could not be read (a warning each); `listed`: every backend
    answered, so no row means no job."""
    if not rows and listed:
        print("no jobs" + (" that this user may read" if unread else ""))
    for r in rows:
        print(f"{r.name:40s} {r.backend:11s} {r.state:11s} {r.message}")
    for what, why in unread.items():
        log.warning(f"{what} not listed: {why}")
