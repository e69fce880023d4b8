"""One run per checkpoint directory: a lock that dies with the process that holds it.

Two runs on one `checkpoint_dir` both resume from the same checkpoint, train side by side and
collide when both write the same step. The run's first process takes an exclusive `flock` on
`CHECKPOINT_DIR/.fsdpkit.lock` and keeps it for the run: the launcher with `--nproc`, the trainer
itself with one process, rank 0 under a launcher that is not fsdpkit's (a cluster's torchrun).
The kernel drops a `flock` when its holder exits in any way, `kill -9` included, so a lock is
never stale; the file itself stays and names the last holder. A file system without `flock`
(some Lustre mounts) gets a warning and no lock.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import socket
import sys
import time
from pathlib import Path
from typing import IO

from fsdpkit.errors import Conflict

LOCK_NAME = ".fsdpkit.lock"
# Set by a launcher that holds the lock, for its workers: they must not try to take it again.
HELD_ENV = "FSDPKIT_CHECKPOINT_LOCK_HELD"


class RunLock:
    def __init__(self, handle: IO[str] | None, made: list[Path] | None = None, new: bool = False):
        self._handle = handle
        self._made = made or []  # the directories hold() created, deepest first
        self._new = new          # hold() created the lock file

    def claim(self, run_dir: Path) -> None:
        """Name this run in the lock file, once its checks have passed: a refused run leaves the
        file as the last run that started left it."""
        if self._handle is not None:
            self._handle.seek(0)
            self._handle.truncate()
            self._handle.write(json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "run_dir": str(run_dir),
                                           "since": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}) + "\n")
            self._handle.flush()

    def release(self, undo: bool = False) -> None:
        """Drop the lock; with `undo` (the run never started), also remove what hold() created: the
        lock file and the directories it made."""
        if self._handle is not None:
            path = Path(self._handle.name)
            self._handle.close()  # closing the file drops the lock
            self._handle = None
            if undo and self._new:
                path.unlink(missing_ok=True)
                with contextlib.suppress(OSError):  # not empty: someone else put something there
                    for made in self._made:
                        made.rmdir()


def hold(checkpoint_dir: str | None) -> RunLock:
    """Take the checkpoint directory's lock for this run, or refuse in one line naming its holder
    (`claim` then names this run). Creates the directory if it does not exist yet (the run would
    create it anyway)."""
    if not checkpoint_dir or os.environ.get(HELD_ENV) or int(os.environ.get("RANK", "0")) != 0:
        return RunLock(None)
    directory = Path(checkpoint_dir)
    made = [p for p in (directory, *directory.parents) if not p.exists()]
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / LOCK_NAME
    new = not path.exists()
    handle = open(path, "a+")  # noqa: SIM115 (held for the run's lifetime, closed by release or exit)
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
        if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
            holder = _holder(handle)
            handle.close()
            raise Conflict(f"checkpoint_dir: {directory} is in use by another run ({holder}); wait for it to end, "
                           "or pass another --checkpoint-dir") from None
        handle.close()
        print(f"warning: checkpoint_dir: cannot lock {path} ({e.strerror}); nothing stops a second run from "
              "using the same directory", file=sys.stderr)
        return RunLock(None)
    return RunLock(handle, made, new)


def _holder(handle: IO[str]) -> str:
    """Who holds the lock, as the holder wrote it: 'pid 123 on host-a, run_dir runs/x, since ...'."""
    handle.seek(0)
    try:
        info = json.loads(handle.read() or "{}")
    except ValueError:
        info = {}
    if not info:
        return "its holder is still starting"
    return f"pid {info.get('pid')} on {info.get('host')}, run_dir {info.get('run_dir')}, since {info.get('since')}"
