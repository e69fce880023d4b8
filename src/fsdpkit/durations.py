"""Durations as people write them, one grammar for the CLI's waits and windows and for
checkpoint_every's wall time. A leaf: imports nothing of fsdpkit."""

from __future__ import annotations

import re

DURATION_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400}
_DURATION = re.compile(r"^(\d+(?:\.\d*)?)([smhd])?$")


def seconds(raw: str | float) -> float:
    """A duration in seconds: 90 or 90s, 15m, 2h, 1d; ValueError naming the forms otherwise."""
    m = _DURATION.match(str(raw).strip().lower())
    if not m:
        raise ValueError(f"expected seconds (90) or a duration (30s, 15m, 2h, 1d), got {raw!r}")
    return float(m.group(1)) * DURATION_UNITS[m.group(2) or "s"]
