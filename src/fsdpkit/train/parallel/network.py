"""EFA proven, not assumed: before the first training step every rank reads which network NCCL
chose from NCCL's own INFO log, rank 0 prints one line, and a run that fell back to TCP sockets
where EFA was expected stops (one line, exit 2) instead of training 10-50x slower between nodes.

NCCL writes that log to RUN_DIR/nccl/HOST-PID.log (set up here before NCCL starts, unless the user
chose NCCL_DEBUG_FILE), so it is kept with the run on shared storage rather than in the container.
"""

from __future__ import annotations

import contextlib
import os
import socket
from pathlib import Path
from typing import Any

import torch.distributed as tdist

from fsdpkit.errors import UserError
from fsdpkit.train.observe import nccl_log
from fsdpkit.train.observe.nccl_log import NetworkVerdict
from fsdpkit.train.runtime.dist import Runtime

INFINIBAND = Path("/sys/class/infiniband")   # EFA devices appear here, with driver "efa"


def efa_expected(sysfs: Path = INFINIBAND) -> bool:
    """This node has EFA: the job asked for it (FI_PROVIDER=efa, set by fsdpkit's manifests on EFA
    instance types) or the kernel shows an EFA device."""
    if os.environ.get("FI_PROVIDER") == "efa":
        return True
    return any((d / "device" / "driver").resolve().name == "efa" for d in sysfs.glob("*")
               if (d / "device" / "driver").exists())


def _expand(pattern: str) -> Path:
    """NCCL_DEBUG_FILE's %h (host name) and %p (process id)."""
    return Path(pattern.replace("%h", socket.gethostname().split(".")[0]).replace("%p", str(os.getpid())))


def capture_nccl_log(run_dir: Path, device_type: str) -> Path | None:
    """Where this process's NCCL INFO log will be; call before NCCL starts. The user's own
    NCCL_DEBUG_FILE is read where set. None for a run without NCCL (CPU, one process).
    Also makes the directory of NCCL's flight-recorder dumps, which torch writes but does not create."""
    if dump := os.environ.get("TORCH_NCCL_DEBUG_INFO_TEMP_FILE"):
        with contextlib.suppress(OSError):   # a dump that cannot be written must not stop training
            Path(dump).parent.mkdir(parents=True, exist_ok=True)
    if os.environ.get("NCCL_DEBUG_FILE"):
        return _expand(os.environ["NCCL_DEBUG_FILE"])
    if device_type != "cuda" or "RANK" not in os.environ:
        return None
    path = run_dir / "nccl" / f"{socket.gethostname().split('.')[0]}-{os.getpid()}.log"
    path.parent.mkdir(parents=True, exist_ok=True)
    os.environ["NCCL_DEBUG_FILE"] = str(path)
    if os.environ.get("NCCL_DEBUG", "").upper() not in ("INFO", "TRACE"):
        os.environ["NCCL_DEBUG"] = "INFO"
        os.environ.setdefault("NCCL_DEBUG_SUBSYS", "INIT,NET")
    return path


def decide(verdicts: list[NetworkVerdict], require: str, nodes: int, expected: bool) -> NetworkVerdict:
    """The run's verdict (the first rank that is not on EFA, else rank 0's), or a UserError where
    EFA is required: `require` on, or auto on a multi-node run of nodes that have EFA."""
    worst = next((v for v in verdicts if v.transport != "efa"), verdicts[0])
    required = require == "on" or (require == "auto" and nodes > 1 and expected)
    if required and worst.transport != "efa":
        rank, why = verdicts.index(worst), worst.detail or "see RUN_DIR/nccl"
        raise UserError(f"require_efa: NCCL chose {worst.transport}, not EFA, on rank {rank} ({why}): the image needs "
                        "aws-ofi-nccl and libfabric on its library path, and the pod vpc.amazonaws.com/efa devices "
                        "(fsdpkit cluster validate nccl); --require-efa off runs anyway")
    return worst


def check(rt: Runtime, require: str, log: Path | None) -> NetworkVerdict | None:
    """Every rank reads its NCCL log (after the process group has started NCCL); the verdicts meet on
    every rank, so all stop together. None where there is nothing to read and nothing required."""
    if require == "off":
        return None
    if log is None or not log.is_file():
        if require == "on":
            raise UserError("require_efa: on, but this run has no NCCL log to verify (NCCL runs on GPUs across "
                            "processes; a CPU run uses gloo)")
        return None
    if rt.distributed:
        tdist.barrier()  # NCCL's communicator, and so its network choice, exists after a first collective
    mine = nccl_log.read(log.read_text(errors="replace"))
    verdicts = [mine]
    if rt.distributed and rt.world_size > 1:
        gathered: list[dict[str, Any] | None] = [None] * rt.world_size
        tdist.all_gather_object(gathered, mine.to_dict())
        verdicts = [NetworkVerdict(**v) for v in gathered if v is not None]
    return decide(verdicts, require, rt.num_nodes, efa_expected())
