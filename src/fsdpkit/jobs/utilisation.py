"""Each node as the cluster sees it while the job runs: GPU utilisation and memory (nvidia-smi) and
EFA traffic (the RDMA device's byte counters), read by one short script run in each pod, and what
they show: stragglers (a node far from the median) and EFA that stays flat while the job trains,
which is NCCL's fallback to TCP sockets. Plain functions over the script's output, so `job watch`
and tests share them."""

from __future__ import annotations

import statistics
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from fsdpkit.cluster.checks import EFA
from fsdpkit.jobs.health import Finding

GPU_QUERY = ["nvidia-smi", "--query-gpu=index,utilization.gpu,memory.used,memory.total",
             "--format=csv,noheader,nounits"]
# The EFA driver's byte counters (per device and port): sends and receives, and RDMA reads and
# writes, which aws-ofi-nccl uses for large messages where the instance supports them.
EFA_COUNTERS = ("tx_bytes", "rx_bytes", "rdma_read_bytes", "rdma_read_resp_bytes", "rdma_write_bytes",
                "rdma_write_recv_bytes")
SYS_IB = "/sys/class/infiniband"

# Below this a node moves no real NCCL traffic over EFA: a training step of any model exchanges
# megabytes per node (gradients or shards), so 1 MB/s over the window is as good as zero.
FLAT_BYTES_PER_S = 1e6
# A node this many points of GPU utilisation under the median, or this much slower per step, is a
# straggler: in synchronous training every other node waits for it.
UTIL_GAP_PCT = 25.0
STEP_TIME_RATIO = 1.25

STRAGGLER_FIX = ("a slow node holds back every other one: look at it (`nvidia-smi -q -d PERFORMANCE` for "
                 "throttling, `fsdpkit cluster validate nccl`), then cordon it (`kubectl cordon NODE`; on "
                 "HyperPod label it sagemaker.amazonaws.com/node-health-status=UnschedulablePendingReplacement) "
                 "and let the job resume from its last checkpoint")
EFA_FIX = ("NCCL is not moving data over EFA (TCP sockets instead): confirm with `fsdpkit job logs JOB "
           "--check-network`; the image needs aws-ofi-nccl and libfabric (`fsdpkit image check`) and the pod "
           "must request vpc.amazonaws.com/efa")


def sample_script(window: float) -> str:
    """The script `job watch` runs in each pod: counters, nvidia-smi, `window` seconds, counters
    again. POSIX sh with builtins only inside the loops, so 32 devices cost no forks per file."""
    counters = " ".join(EFA_COUNTERS)
    query = " ".join(GPU_QUERY)
    return (
        "snap() { echo \"t $(date +%s.%N)\"; "
        f"for d in {SYS_IB}/*/ports/*/hw_counters; do [ -d \"$d\" ] || continue; "
        f"dev=${{d#{SYS_IB}/}}; dev=${{dev%/hw_counters}}; "
        f"for c in {counters}; do [ -r \"$d/$c\" ] && read -r v < \"$d/$c\" && echo \"efa $dev $c $v\"; done; "
        "done; }; "
        "snap; "
        f"if command -v nvidia-smi >/dev/null 2>&1; then {query} | sed 's/^/gpu /'; fi; "
        f"sleep {window:g}; snap"
    )


def asks_for_efa(pod: dict[str, Any]) -> bool:
    """Whether a pod (as the API returns it) requests EFA devices: then its NCCL traffic belongs on EFA."""
    for c in (pod.get("spec") or {}).get("containers") or []:
        res = c.get("resources") or {}
        if any(str((res.get(part) or {}).get(EFA, "0")) not in ("0", "") for part in ("limits", "requests")):
            return True
    return False


def parse_gpu_util(text: str) -> list[dict[str, int]]:
    """`nvidia-smi --query-gpu=index,utilization.gpu,memory.used,memory.total --format=csv,noheader,nounits`."""
    out = []
    for line in text.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) == 4 and all(p.isdigit() for p in parts):
            i, util, used, total = map(int, parts)
            out.append({"gpu": i, "util_pct": util, "mem_used_mib": used, "mem_total_mib": total})
    return out


@dataclass
class NodeSample:
    """One node over one window: its GPUs and the EFA bytes per second its devices moved."""

    gpus: list[dict[str, int]] = field(default_factory=list)
    efa_devices: int = 0
    efa_bytes_per_s: float = 0.0
    window_s: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        utils = [g["util_pct"] for g in self.gpus]
        return {
            "gpu_util_pct": round(statistics.fmean(utils), 1) if utils else None,
            "gpu_mem_used_gib": round(sum(g["mem_used_mib"] for g in self.gpus) / 1024, 1) if self.gpus else None,
            "gpu_mem_total_gib": round(sum(g["mem_total_mib"] for g in self.gpus) / 1024, 1) if self.gpus else None,
            "gpus": self.gpus,
            "efa_devices": self.efa_devices,
            "efa_gbit_s": round(self.efa_bytes_per_s * 8 / 1e9, 3),
            "window_s": round(self.window_s, 2),
        }


def parse_sample(text: str, window: float) -> NodeSample:
    """The sample script's output: two counter snapshots (`t SECONDS`, then `efa DEV/ports/N COUNTER
    VALUE` lines) around nvidia-smi's `gpu ...` lines. Counters that went backwards (a device reset)
    count as zero; without two timestamps the nominal window is the divisor."""
    snaps: list[tuple[float | None, dict[tuple[str, str], int]]] = []
    gpu_lines = []
    for line in text.splitlines():
        kind, _, rest = line.partition(" ")
        if kind == "t":
            try:
                stamp: float | None = float(rest)
            except ValueError:  # a `date` without %N
                stamp = None
            snaps.append((stamp, {}))
        elif kind == "efa" and snaps:
            parts = rest.split()
            if len(parts) == 3 and parts[2].isdigit():
                snaps[-1][1][(parts[0], parts[1])] = int(parts[2])
        elif kind == "gpu":
            gpu_lines.append(rest)
    sample = NodeSample(gpus=parse_gpu_util("\n".join(gpu_lines)))
    if len(snaps) < 2:
        return sample
    (t0, before), (t1, after) = snaps[0], snaps[-1]
    elapsed = t1 - t0 if t0 is not None and t1 is not None and t1 > t0 else window
    moved = sum(max(0, after[k] - before[k]) for k in after.keys() & before.keys())
    sample.efa_devices = len({dev for dev, _ in after})
    sample.efa_bytes_per_s, sample.window_s = moved / elapsed, elapsed
    return sample


def stragglers(nodes: list[dict[str, Any]]) -> list[Finding]:
    """Nodes whose GPU utilisation or step time lies far from the median of the job's nodes."""
    out: list[Finding] = []
    checks: tuple[tuple[str, Callable[[float, float], bool], str], ...] = (
        ("gpu_util_pct", lambda v, med: med - v >= UTIL_GAP_PCT, "GPU utilisation {v:.0f}% against a median of "
                                                                  "{med:.0f}%"),
        ("step_time_s", lambda v, med: v >= STEP_TIME_RATIO * med, "step time {v:.2f} s against a median of "
                                                                    "{med:.2f} s"),
    )
    for key, far, what in checks:
        values = [n[key] for n in nodes if n.get(key) is not None]
        if len(values) < 2:
            continue
        med = statistics.median(values)
        for n in nodes:
            v = n.get(key)
            if v is not None and far(v, med):
                where = f" on node {n['node']}" if n.get("node") else ""
                out.append(Finding("straggler", n["pod"], what.format(v=v, med=med) + f" across {len(values)} "
                                   f"nodes{where}", STRAGGLER_FIX))
    return out


def efa_flat(nodes: list[dict[str, Any]], job: str) -> list[Finding]:
    """Nodes of a multi-node job that asked for EFA whose EFA counters stayed flat over the window;
    call it only while the job trains (new steps), when NCCL must be moving data."""
    sampled = [n for n in nodes if n.get("efa_gbit_s") is not None]
    if len(sampled) < 2:
        return []
    out = []
    for n in sampled:
        if n["efa_gbit_s"] * 1e9 / 8 >= FLAT_BYTES_PER_S:
            continue
        detail = (f"no EFA device visible in the pod ({SYS_IB} is empty)" if not n["efa_devices"] else
                  f"EFA counters flat over {n['window_s']:g} s on {n['efa_devices']} devices while the job trains")
        out.append(Finding("efa_flat", n["pod"], detail, EFA_FIX.replace("JOB", job)))
    return out


class WatchHistory:
    """Per-node figures since the watch began (one sample per look): utilisation over time, so a
    node that is slow now and then shows as well as one slow now."""

    def __init__(self) -> None:
        self._seen: dict[str, dict[str, list[float]]] = {}

    def add(self, nodes: list[dict[str, Any]]) -> None:
        for n in nodes:
            seen = self._seen.setdefault(n["pod"], {"gpu_util_pct": [], "efa_gbit_s": []})
            for key, values in seen.items():
                if n.get(key) is not None:
                    values.append(float(n[key]))
            n["over_watch"] = {"samples": max(len(v) for v in seen.values()),
                               **{f"{k}_mean": round(statistics.fmean(v), 2) for k, v in seen.items() if v},
                               **{f"{k}_min": min(v) for k, v in seen.items() if v}}
