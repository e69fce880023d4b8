"""What is wrong with a running job, read from its pods and its rank-0 log: a stall (no new step
for too long), OOMKilled, crash loops, pods pending with the scheduler's reason, NCCL timeouts, a
tiered checkpoint falling back to shared storage.
Plain functions over API dicts and log lines, so `fsdpkit job watch` and tests share them."""

from __future__ import annotations

import datetime as dt
import re
from dataclasses import asdict, dataclass
from typing import Any

from fsdpkit.train.observe import nccl_log
from fsdpkit.train.observe.log_lines import PROGRESS, STEP, TIERED_OFF

_NCCL_TIMEOUT = re.compile(r"Watchdog caught collective operation timeout|NCCL communicator was aborted|"
                           r"ProcessGroupNCCL.*[Tt]imeout|NCCL timeout", re.S)
_TIERED_FIX = ("the grace period was planned for node memory; a stop's checkpoint to shared storage may not finish "
               "in it: build the image with `fsdpkit image init --hyperpod --tiered` and enable tiered storage on "
               "the cluster, or drop train.tiered (the grace is then planned for shared storage)")
_PENDING = [
    (re.compile(r"Insufficient nvidia\.com/gpu"), "not enough free GPUs",
     "wait for running jobs, lower nodes/gpus_per_node, or scale the GPU node group"),
    (re.compile(r"Insufficient vpc\.amazonaws\.com/efa"), "not enough free EFA devices",
     "check the EFA device plugin (fsdpkit cluster check) or lower efa_per_node"),
    (re.compile(r"Insufficient (cpu|memory)"), "not enough CPU or memory", "lower cpu/memory in the spec"),
    (re.compile(r"untolerated taint"), "the nodes carry a taint the pod does not tolerate",
     "add the taint to tolerations: in the spec"),
    (re.compile(r"didn't match Pod's node affinity/selector|node\(s\) didn't match"),
     "no node matches the pod's node selector / affinity", "check instance_type and node_selector"),
]


@dataclass
class Finding:
    kind: str        # stall | oom | crashloop | pending | cannot_create | nccl_timeout | tiered_off
    pod: str
    detail: str
    fix: str = ""

    def to_dict(self) -> dict[str, str]:
        return asdict(self)


def _ts(line: str) -> tuple[dt.datetime | None, str]:
    """Split a `timestamps=true` log line into its time and text."""
    stamp, _, text = line.partition(" ")
    try:
        # Kubernetes writes nanoseconds; Python takes microseconds.
        stamp = re.sub(r"(\.\d{6})\d+", r"\1", stamp).replace("Z", "+00:00")
        return dt.datetime.fromisoformat(stamp), text
    except ValueError:
        return None, line


def log_progress(lines: list[str], pod: str, now: dt.datetime,
                 stall_after: float) -> tuple[dict[str, Any], list[Finding]]:
    """Latest step, loss and tokens/s from the trainer's log, and stall / NCCL-timeout findings."""
    progress: dict[str, Any] = {}
    findings: list[Finding] = []
    first_ts = last_step_ts = None
    for line in lines:
        ts, text = _ts(line)
        first_ts = first_ts or ts
        if m := PROGRESS.search(text):
            progress.update(step=int(m.group(1)), loss=float(m.group(2)), tokens_per_s=int(m.group(3)))
            last_step_ts = ts
        if _NCCL_TIMEOUT.search(text):
            findings.append(Finding("nccl_timeout", pod, text.strip()[:200],
                                    "a rank stopped answering collectives: look for a crashed or slow rank, "
                                    "and run `fsdpkit cluster validate nccl`"))
        if TIERED_OFF in text and not any(f.kind == "tiered_off" for f in findings):
            findings.append(Finding("tiered_off", pod, text.strip()[:300], _TIERED_FIX))
    since = last_step_ts or first_ts
    if since is not None:
        age = (now - since).total_seconds()
        progress["last_step_age_s"] = round(age, 1)
        if age > stall_after:
            what = f"no new step for {age:.0f} s" if last_step_ts else f"no step logged in {age:.0f} s since start"
            findings.append(Finding("stall", pod, f"{what} (limit {stall_after:.0f} s)",
                                    "the job may be hung (NCCL, data loading, storage): see the logs of every "
                                    "replica (--replica all); py-spy dump shows where it waits"))
    return progress, findings


def step_time(lines: list[str]) -> float | None:
    """Seconds per step from the last two step lines of a `timestamps=true` log (rank 0's progress
    line or a node's own line); None with fewer than two."""
    seen = []
    for line in lines:
        ts, text = _ts(line)
        if ts is not None and (m := STEP.search(text)):
            seen.append((int(m.group(1)), ts))
    if len(seen) < 2 or seen[-1][0] <= seen[-2][0]:
        return None
    (s0, t0), (s1, t1) = seen[-2], seen[-1]
    return round((t1 - t0).total_seconds() / (s1 - s0), 3)


def network_verdict(lines: list[str]) -> nccl_log.NetworkVerdict | None:
    """The network the trainer reported before its first step (`fsdpkit: network: efa (...)`:
    transport, provider, NIC count, plugin and NCCL versions); None where the lines do not hold it."""
    return nccl_log.from_trainer_log("\n".join(lines))


def pod_findings(pods: list[dict[str, Any]]) -> list[Finding]:
    """Each pod's trouble as its status shows it: unschedulable, OOMKilled, crash-looping."""
    out: list[Finding] = []
    for pod in pods:
        name = (pod.get("metadata") or {}).get("name", "?")
        status = pod.get("status") or {}
        if status.get("phase") == "Pending":
            out += _unschedulable(name, status)
        for cs in status.get("containerStatuses") or []:
            out += _container_findings(name, cs)
    return out


def _unschedulable(name: str, status: dict[str, Any]) -> list[Finding]:
    """A Pending pod's PodScheduled=False condition, with the reason it names and its fix."""
    out = []
    for c in status.get("conditions") or []:
        if c.get("type") == "PodScheduled" and c.get("status") == "False":
            msg = c.get("message") or c.get("reason") or ""
            why, fix = next(((w, f) for rx, w, f in _PENDING if rx.search(msg)), ("cannot be scheduled", ""))
            out.append(Finding("pending", name, f"{why}: {msg}", fix))
    return out


def _container_findings(name: str, cs: dict[str, Any]) -> list[Finding]:
    """One container's OOMKilled (now or as it last ended) and crash loop."""
    out = []
    state, last = cs.get("state") or {}, cs.get("lastState") or {}
    terminated = (state.get("terminated") or {}).get("reason") or (last.get("terminated") or {}).get("reason")
    if terminated == "OOMKilled":
        out.append(Finding("oom", name, f"container {cs.get('name')} was OOMKilled "
                           f"(restarts {cs.get('restartCount', 0)})",
                           "raise memory in the spec, or lower train_batch_size / turn on "
                           "activation_checkpointing / cpu_offload"))
    if (state.get("waiting") or {}).get("reason") == "CrashLoopBackOff":
        out.append(Finding("crashloop", name, f"container {cs.get('name')} is crash-looping "
                           f"(restarts {cs.get('restartCount', 0)})",
                           f"fsdpkit job logs JOB --replica ... --previous  (pod {name})"))
    return out


def pod_summary(pod: dict[str, Any]) -> dict[str, Any]:
    status = pod.get("status") or {}
    restarts = sum(int(cs.get("restartCount") or 0) for cs in status.get("containerStatuses") or [])
    reasons = [((cs.get("state") or {}).get("waiting") or {}).get("reason") for cs in
               status.get("containerStatuses") or []]
    return {"name": (pod.get("metadata") or {}).get("name"), "phase": status.get("phase"), "restarts": restarts,
            "reason": next((r for r in reasons if r), None), "node": (pod.get("spec") or {}).get("nodeName")}


def check_network_log(text: str) -> tuple[str, str]:
    """A job's log: ("pass", why) only when NCCL used EFA (aws-ofi-nccl over libfabric's efa
    provider), ("fail", why) when it fell back to sockets or went through another provider (the
    plugin over libfabric's tcp or sockets providers is TCP too), ("unknown", why) when the log
    does not say. The trainer's own verdict line wins; otherwise NCCL's INFO lines
    (diagnose_network: true) are read."""
    v = nccl_log.from_trainer_log(text) or nccl_log.read(text)
    if v.transport == "efa":
        return "pass", f"NCCL is using EFA through aws-ofi-nccl ({v.line().split(': ', 2)[-1]})"
    if v.transport == "socket":
        return "fail", (f"NCCL fell back to TCP sockets ({v.detail}): check that the image has aws-ofi-nccl and "
                        "libfabric on LD_LIBRARY_PATH and that the pod requested vpc.amazonaws.com/efa")
    if v.transport == "unknown":
        return "unknown", "no network verdict in the log: it is printed before the first step of a multi-process "\
                          "GPU run (or run with diagnose_network: true for NCCL's own lines)"
    if v.transport == "ofi":
        return "fail", (f"NCCL went through aws-ofi-nccl over libfabric's {v.provider} provider, not efa: EFA is not "
                        "in use; check that the pod requested vpc.amazonaws.com/efa and that FI_PROVIDER is efa")
    return "fail", f"NCCL is using {v.transport}, not EFA"
