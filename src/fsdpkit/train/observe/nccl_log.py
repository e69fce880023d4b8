"""Which network NCCL really chose, read from its own INFO log (NCCL_DEBUG=INFO, subsystems INIT
and NET): one verdict, and the one line the trainer prints it as. No torch here: `job logs`,
`job watch` and `cluster validate nccl` read the same lines on the submitting machine.

The lines it reads (NCCL's and aws-ofi-nccl's own, stable across their releases):
  NCCL INFO NCCL version 2.21.5+cuda12.4
  NCCL INFO NET/OFI Initializing aws-ofi-nccl 1.14.0
  NCCL INFO NET/OFI Selected provider is efa, fabric is efa (found 32 nics)     (1.14 and later)
  NCCL INFO NET/OFI Selected Provider is efa (found 4 nics)                     (earlier)
  NCCL INFO Using network Libfabric           ("AWS Libfabric" before aws-ofi-nccl 1.13, or "OFI")
  NCCL INFO NET/Socket : Using [0]eth0:10.0.0.1<0> [1]eth1:10.0.0.2<0>
  NCCL INFO Using network Socket
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass
from typing import Any

_NETWORK = re.compile(r"NCCL INFO Using network (.+?)\s*$", re.M)
_PROVIDER = re.compile(r"NET/OFI Selected [Pp]rovider is ([\w;-]+)(?:, fabric is \S+)?(?: \(found (\d+) nics\))?")
_PLUGIN = re.compile(r"NET/OFI Initializing aws-ofi-nccl (\S+)")
_NCCL = re.compile(r"NCCL version (\S+)")
_SOCKET_IFS = re.compile(r"NET/Socket : Using ((?:\[\d+\]\S+\s*)+)")
_PLUGIN_MISSING = re.compile(r"NET/Plugin ?: ?.*(?:No plugin found|Could not find|Failed to load|dlerror)[^\n]*?"
                             r"(libnccl-net[\w.-]*\.so)")
_OFI_NAMES = ("aws libfabric", "libfabric", "ofi")
# The line the trainer prints (rank 0, before the first step); watchers parse it back.
VERDICT_LINE = re.compile(r"fsdpkit: network: (\w+)(?: \((.*)\))?")


@dataclass(frozen=True)
class NetworkVerdict:
    transport: str                 # efa | socket | ib | ofi (a non-EFA libfabric provider) | unknown
    provider: str | None = None    # libfabric provider (efa) when NCCL went through aws-ofi-nccl
    nics: int | None = None        # network devices NCCL found (EFA interfaces, or socket interfaces)
    plugin: str | None = None      # aws-ofi-nccl version
    nccl: str | None = None        # NCCL version
    detail: str = ""               # why, when it is not EFA

    def line(self) -> str:
        """`fsdpkit: network: efa (NCCL 2.21.5, aws-ofi-nccl 1.14.0, provider efa, 32 NICs)`."""
        parts = [f"NCCL {self.nccl}" if self.nccl else None,
                 f"aws-ofi-nccl {self.plugin}" if self.plugin else None,
                 f"provider {self.provider}" if self.provider else None,
                 f"{self.nics} NICs" if self.nics is not None else None, self.detail or None]
        shown = ", ".join(p for p in parts if p)
        return f"fsdpkit: network: {self.transport}" + (f" ({shown})" if shown else "")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def read(text: str) -> NetworkVerdict:
    """The verdict of one NCCL INFO log (one process's, or several interleaved: any socket wins)."""
    names = [n.strip().lower() for n in _NETWORK.findall(text)]
    provider_m = _PROVIDER.search(text)
    plugin_m, nccl_m = _PLUGIN.search(text), _NCCL.search(text)
    plugin, nccl = (plugin_m.group(1) if plugin_m else None), (nccl_m.group(1) if nccl_m else None)
    ifs = _SOCKET_IFS.search(text)
    # NCCL sets up its socket transport only when no plugin or IB device took the job.
    if "socket" in names or (ifs and not names):
        count = len(re.findall(r"\[\d+\]", ifs.group(1))) if ifs else None
        missing = _PLUGIN_MISSING.search(text)
        why = (f"net plugin {missing.group(1)} not found" if missing else
               "aws-ofi-nccl loaded but not used" if plugin else "no aws-ofi-nccl plugin loaded")
        return NetworkVerdict("socket", None, count, plugin, nccl, f"TCP sockets; {why}")
    if any(n in _OFI_NAMES for n in names) or (provider_m and not names):
        provider = provider_m.group(1) if provider_m else None
        nics = int(provider_m.group(2)) if provider_m and provider_m.group(2) else None
        transport = "efa" if provider in (None, "efa") else "ofi"
        return NetworkVerdict(transport, provider, nics, plugin, nccl)
    if "ib" in names:
        return NetworkVerdict("ib", None, None, plugin, nccl)
    return NetworkVerdict("unknown", None, None, plugin, nccl,
                          "no 'Using network' line: NCCL_DEBUG=INFO with NCCL_DEBUG_SUBSYS including INIT,NET")


def from_trainer_log(text: str) -> NetworkVerdict | None:
    """The verdict the trainer printed (`fsdpkit: network: ...`), if the log holds one."""
    m = VERDICT_LINE.search(text)
    if not m:
        return None
    fields = dict.fromkeys(("provider", "nics", "plugin", "nccl"))
    detail = []
    for part in (m.group(2) or "").split(", "):
        if part.startswith("NCCL "):
            fields["nccl"] = part[5:]
        elif part.startswith("aws-ofi-nccl "):
            fields["plugin"] = part[13:]
        elif part.startswith("provider "):
            fields["provider"] = part[9:]
        elif part.endswith(" NICs") and part[:-5].isdigit():
            fields["nics"] = int(part[:-5])
        elif part:
            detail.append(part)
    return NetworkVerdict(m.group(1), detail=", ".join(detail), **fields)
