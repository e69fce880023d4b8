"""Fault injection for tests of recovery: a real SIGKILL of a real worker at a chosen point.

FSDPKIT_FAULT="kill:step=5:rank=1" kills rank 1 right after optimizer step 5;
FSDPKIT_FAULT="kill:save=6:rank=1" kills it while checkpoint 6 is being written (after its shards
are on disk, before the checkpoint is complete). Faults fire only in the first attempt
(TORCHELASTIC_RESTART_COUNT 0, and FSDPKIT_ATTEMPT 0 or unset: a job resubmitted by
`fsdpkit job wait` counts up), so a restarted run recovers. Unset: no effect.
"""

from __future__ import annotations

import os
import signal


def maybe_fail(point: str, step: int, rank: int) -> None:
    spec = os.environ.get("FSDPKIT_FAULT")
    if not spec or os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0" \
            or os.environ.get("FSDPKIT_ATTEMPT", "0") != "0":
        return
    action, *fields = spec.split(":")
    want = dict(f.split("=", 1) for f in fields)
    if action == "kill" and want.get(point) == str(step) and want.get("rank", "0") == str(rank):
        os.kill(os.getpid(), signal.SIGKILL)
