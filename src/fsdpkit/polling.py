"""The one way fsdpkit waits on something another system does (a job to end, a RayCluster to be
ready, a deleted job to be gone, a job's pods to appear, an FSx file system to be available):
look, then look again after a delay that starts at a second and doubles up to `poll`, so what
fails at once (an image that cannot be pulled, a bad flag) is seen in seconds and a long wait
costs few API calls."""

from __future__ import annotations

import time
from collections.abc import Callable, Hashable
from typing import TypeVar

T = TypeVar("T")


def poll_until(look: Callable[[], T], done: Callable[[T], bool], timeout: float | None, poll: float,
               on_change: Callable[[T], None] | None = None, key: Callable[[T], Hashable] | None = None) -> T:
    """Call `look` until `done` holds for what it returns, or `timeout` seconds (None: no limit)
    have passed; returns the last look. `on_change` sees each look whose `key` differs from the one
    before (the first included)."""
    deadline = None if timeout is None else time.monotonic() + timeout
    delay, last = min(1.0, poll), object()
    while True:
        seen = look()
        if on_change is not None and (now := key(seen) if key else seen) != last:
            on_change(seen)
            last = now
        left = None if deadline is None else deadline - time.monotonic()
        if done(seen) or (left is not None and left <= 0):
            return seen
        time.sleep(delay if left is None else min(delay, left))
        delay = min(poll, delay * 2)
