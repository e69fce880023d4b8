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


def wait_saying(look: Callable[[], T], done: Callable[[T], bool], timeout: float, poll: float,
                what: Callable[[T, str], str | None], say: Callable[[str], None], every: float = 30.0) -> T:
    """`poll_until` that says what it waits for: `what(seen, waited)` (waited: "N s of T") is said
    when it changes and every `every` seconds while it does not; None says nothing."""
    started = time.monotonic()

    def told(seen: T) -> None:
        if (text := what(seen, f"{time.monotonic() - started:.0f} s of {timeout:.0f}")) is not None:
            say(text)

    return poll_until(look, done, timeout, poll, told,
                      key=lambda seen: (what(seen, ""), int((time.monotonic() - started) // every)))
