"""Durations as people write them, one grammar for the CLI's waits and windows and for
checkpoint_every's wall time. A leaf: imports nothing of fsdpkit."""

from __future__ import annotations

import math
import re

DURATION_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400}
_WITH_UNIT = re.compile(r"^(\d+(?:\.\d*)?)([smhd])$")


def seconds(raw: str | float) -> float:
    """A duration in seconds: 90 (or 1e9: any finite number not below zero), 90s, 15m, 2h, 1d;
    ValueError naming the forms otherwise."""
    text = str(raw).strip().lower()
    if m := _WITH_UNIT.match(text):
        return float(m.group(1)) * DURATION_UNITS[m.group(2)]
    try:  # a plain number is seconds
        value = float(text)
    except ValueError:
        value = math.nan
    if not (0 <= value < math.inf):
        raise ValueError(f"expected seconds (90) or a duration (30s, 15m, 2h, 1d), got {raw!r}")
    return value
