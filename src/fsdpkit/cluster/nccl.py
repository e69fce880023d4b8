"""nccl-tests `all_reduce_perf` output: bus bandwidth per message size, which network NCCL used,
and a verdict against what the instance type's network should carry."""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass, field
from typing import Any

from fsdpkit.hardware.instances import Instance
from fsdpkit.train.observe import nccl_log

_ROW = re.compile(r"^\s*(\d+)\s+(\d+)\s+(\w+)\s+(\w+)\s+(-?\d+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)\s+(\S+)"
                  r"\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)\s+(\S+)\s*$")
_AVG = re.compile(r"#\s*Avg bus bandwidth\s*:\s*([\d.]+)")
_RANKS = re.compile(r"#\s+Rank\s+\d+ .* on\s+(\S+)\s+device")


@dataclass
class NcclResult:
    rows: list[dict[str, float]] = field(default_factory=list)  # size, busbw (out-of-place), busbw_inplace
    avg_busbw: float | None = None
    hosts: int = 0
    network: str = "unknown"       # efa | socket | unknown (fsdpkit.train.observe.nccl_log)
    provider: str | None = None    # libfabric provider NCCL selected
    nics: int | None = None        # network devices NCCL found
    wrong: int = 0                 # rows with data errors (#wrong > 0)

    @property
    def peak_busbw(self) -> float:
        return max((max(r["busbw"], r["busbw_inplace"]) for r in self.rows), default=0.0)

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "peak_busbw": self.peak_busbw}


def parse_all_reduce(text: str) -> NcclResult:
    res = NcclResult()
    hosts = set()
    for line in text.splitlines():
        if m := _ROW.match(line):
            g = m.groups()
            res.rows.append({"size": int(g[0]), "busbw": float(g[7]), "busbw_inplace": float(g[11])})
            res.wrong += sum(1 for w in (g[8], g[12]) if w not in ("0", "N/A"))
        elif m := _AVG.search(line):
            res.avg_busbw = float(m.group(1))
        elif m := _RANKS.search(line):
            hosts.add(m.group(1))
    res.hosts = len(hosts)
    verdict = nccl_log.read(text)
    res.network = verdict.transport if verdict.transport in ("efa", "socket") else "unknown"
    res.provider, res.nics = verdict.provider, verdict.nics
    return res


def verdict(res: NcclResult, inst: Instance | None, nodes: int) -> tuple[str, str]:
    """("pass" | "warn" | "fail", why)."""
    if not res.rows:
        return "fail", "no all_reduce_perf results in the log (did the job start? see its logs)"
    if res.wrong:
        return "fail", f"{res.wrong} result rows report wrong data (#wrong > 0): a faulty GPU or link"
    if nodes > 1 and res.network == "socket":
        return "fail", (f"EFA not used: NCCL fell back to sockets (NET/Socket); peak bus bandwidth "
                        f"{res.peak_busbw:.1f} GB/s. Check aws-ofi-nccl in the image and the EFA device plugin")
    if nodes > 1 and inst is not None and inst.net_gbps:
        expected = inst.net_gbps / 8  # GB/s of network per node bounds a multi-node all-reduce's bus bandwidth
        ratio = res.peak_busbw / expected
        why = (f"peak bus bandwidth {res.peak_busbw:.1f} GB/s = {ratio:.0%} of {inst.name}'s "
               f"{inst.net_gbps} Gbit/s network ({expected:.0f} GB/s)")
        return ("pass" if ratio >= 0.5 else "warn"), why
    return "pass", f"peak bus bandwidth {res.peak_busbw:.1f} GB/s"
