"""Process and device setup: one process per device, under torchrun or alone.

Alone (no RANK in the environment) no process group is created and the model is not sharded.
Under torchrun each process takes the device of its LOCAL_RANK (never cuda:0 for everyone) and
joins a process group: nccl on GPUs, gloo on CPUs.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import signal
import sys
from dataclasses import dataclass
from typing import NoReturn

import torch
import torch.distributed as dist

from fsdpkit.errors import UserError
from fsdpkit.train.runtime.supervisor import under_torchrun
from fsdpkit.train.sections import check_context_group, check_expert_group


@dataclass(frozen=True)
class Runtime:
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    device: torch.device
    context_parallel: int = 1   # ranks that share each sequence (consecutive ranks of one node)
    expert_parallel: int = 1    # ranks each MoE layer's experts are split over (consecutive ranks)

    @property
    def distributed(self) -> bool:
        return bool(dist.is_available() and dist.is_initialized())

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def num_nodes(self) -> int:
        return max(1, self.world_size // self.local_world_size)

    @property
    def data_rank(self) -> int:
        """Which share of the data this rank reads: the ranks of a context-parallel group read the same."""
        return self.rank // self.context_parallel

    @property
    def data_ranks(self) -> int:
        """How many shares the data is read in (the world over the context-parallel degree)."""
        return self.world_size // self.context_parallel


def resolve_device_type(device: str) -> str:
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise UserError("device: 'cuda' was asked for but no CUDA device is visible; use --device cpu")
    return device


def available_devices(device_type: str) -> int:
    return torch.cuda.device_count() if device_type == "cuda" else (os.cpu_count() or 1)


def check_nproc(nproc: int, device: str) -> None:
    """Refuse more processes than this machine has devices (GPUs, or CPU cores on CPU)."""
    kind = resolve_device_type(device)
    have = available_devices(kind)
    if nproc > have:
        what = "GPUs" if kind == "cuda" else "CPU cores"
        raise UserError(f"nproc: {nproc} is more than the {have} {what} on this machine; use 1..{have}")


def setup(device: str = "auto", context_parallel: int = 1, expert_parallel: int = 1) -> Runtime:
    kind = resolve_device_type(device)
    if not under_torchrun():
        dev = torch.device("cuda", torch.cuda.current_device()) if kind == "cuda" else torch.device("cpu")
        return Runtime(0, 1, 0, 1, dev)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    check_context_group(context_parallel, local_world)
    check_expert_group(expert_parallel, world)
    if kind == "cuda":
        torch.cuda.set_device(local_rank)
        dev = torch.device("cuda", local_rank)
    else:
        dev = torch.device("cpu")
    if not dist.is_initialized():
        backend = "nccl" if kind == "cuda" else "gloo"
        dist.init_process_group(backend, store=_attempt_store(rank, world), rank=rank, world_size=world,
                                device_id=dev if kind == "cuda" else None)
    return Runtime(rank, world, local_rank, local_world, dev, context_parallel, expert_parallel)


def _attempt_store(rank: int, world: int) -> dist.Store:
    """torchrun's store, with keys private to this restart attempt.

    After a restart, the store can still hold the addresses the previous attempt's ranks
    published; a rank that reads one before its peer republishes connects to a dead port
    (seen with gloo: "connectFullMesh failed ... Connection refused"). A prefix per attempt
    makes every read wait for the current attempt's value.
    """
    agent_hosts = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    store = dist.TCPStore(
        os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world,
        is_master=(rank == 0 and not agent_hosts), multi_tenant=True,
    )
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return dist.PrefixStore(f"fsdpkit/attempt-{attempt}/", store)


def teardown() -> None:
    if dist.is_available() and dist.is_initialized():
        # Leave together: a rank that destroys its group while a peer is still using the
        # connections can make gloo abort the peer at exit ("terminate called ...").
        with contextlib.suppress(Exception):  # a peer already failed: nothing left to wait for
            dist.barrier()
        dist.destroy_process_group()


def leave(code: int) -> NoReturn:
    """End a worker process with `code`, running its exit handlers but not interpreter finalization.

    gloo's worker threads outlive destroy_process_group (FSDP's DTensor specs keep the group
    alive), and the thread that drops its last reference to a collective's tensor takes the GIL
    to release the Python object. If it is still waiting for the GIL when Python starts
    finalizing, CPython ends it with pthread_exit inside a noexcept C++ destructor and the whole
    process aborts ("terminate called without an active exception", SIGABRT) after a run that
    finished. Exit handlers run while the interpreter is whole; then the process leaves at once.
    """
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def broadcast_int(value: int, rt: Runtime) -> int:
    """Rank 0's `value` on every rank."""
    if not rt.distributed:
        return value
    t = torch.tensor([value], dtype=torch.int64, device=rt.device)
    dist.broadcast(t, src=0)
    return int(t.item())


def all_reduce_max(value: float, rt: Runtime) -> float:
    """The largest of every rank's `value`, on every rank."""
    if not rt.distributed:
        return value
    t = torch.tensor([value], dtype=torch.float64, device=rt.device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def all_reduce_mean(t: torch.Tensor, rt: Runtime) -> torch.Tensor:
    if rt.distributed and rt.world_size > 1:
        t = t.clone()
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
        t /= rt.world_size
    return t


# What asks a worker to stop after its step: SIGTERM (Kubernetes, torchrun, Slurm, hyperpodrun with
# --shutdown-signal=SIGTERM) and SIGUSR1 (HyperPod's elastic agent when the operator stops workers
# gracefully; its default action would end the process with no checkpoint).
STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


class StopRequest:
    """Turns SIGTERM (what Kubernetes and torchrun send before killing) into a stop all ranks agree on.

    The handler only sets a flag; `agreed()` combines the flags of all ranks, so every rank stops
    after the same step and can write one consistent checkpoint. On GPUs the vote goes over a
    separate gloo group so it never waits on the CUDA stream.
    """

    def __init__(self, rt: Runtime):
        self.rt, self.requested = rt, False
        self.group = None
        if rt.distributed and rt.device.type == "cuda":
            self.group = dist.new_group(backend="gloo")
        self._previous = {s: signal.signal(s, self._handle) for s in STOP_SIGNALS}

    def _handle(self, signum: int, frame: object) -> None:
        self.requested = True

    def agreed(self, save_due: bool = False) -> tuple[bool, bool]:
        """(stop, save): whether any rank was asked to stop, and whether any rank's clock says a
        time-based checkpoint is due (clocks differ; the vote makes every rank save together)."""
        if not (self.rt.distributed and self.rt.world_size > 1):
            return self.requested, save_due
        flags = torch.tensor([int(self.requested), int(save_due)])
        dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self.group)
        return bool(flags[0].item()), bool(flags[1].item())

    def close(self) -> None:
        # Under fsdpkit's supervisor a late SIGTERM (training over, the process leaving) is moot:
        # dying of it would turn a finished run into a failed one.
        for s, previous in self._previous.items():
            signal.signal(s, signal.SIG_IGN if os.environ.get("FSDPKIT_SUPERVISED") else previous)
