"""Reading a job's log file, once or following it while the job runs (local and Slurm backends)."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path

# The trainer reports its network before the first step: within this many lines of a job's log.
NETWORK_LINES = 2000


def read_lines(path: Path, follow: bool, finished: Callable[[], bool], poll: float) -> Iterator[str]:
    """The file's lines; with `follow`, also those written until the job finishes. A job that has not
    started yet has no file: following waits for it, a plain read has nothing to show."""
    while not path.exists():
        if not follow or finished():
            return
        time.sleep(poll)
    with open(path, errors="replace") as f:
        while True:
            line = f.readline()
            if line:
                yield line.rstrip("\n")
            elif follow and not finished():
                time.sleep(poll)
            else:
                # The job may have written its last lines between the read and the check.
                yield from f.read().splitlines()
                return
