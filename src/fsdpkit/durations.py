"""Durations as people write them, one grammar for the CLI's waits and windows and for
checkpoint_every's wall time. A leaf: imports nothing of fsdpkit."""

from __future__ import annotations

import math
import re

DURATION_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400}
# The longest duration taken: a century, far past any wait or window, and inside what a datetime
# can subtract (`--since 1000000000d` would overflow one) and what `time.monotonic() + t` keeps exact.
MAX_SECONDS = 100 * 365 * 86400
_WITH_UNIT = re.compile(r"^(-?\d+(?:\.\d*)?)([smhd])$")


def seconds(raw: str | float) -> float:
    """A duration in seconds: 90 (or 1e9: any number from zero up to a century), 90s, 15m, 2h, 1d;
    ValueError naming the forms, or the bound, otherwise."""
    text = str(raw).strip().lower()
    shown = repr(text if len(text) <= 40 else text[:37] + "...")
    m = _WITH_UNIT.match(text)
    try:  # a plain number is seconds
        value = float(m.group(1)) * DURATION_UNITS[m.group(2)] if m else float(text)
    except ValueError:
        value = math.nan
    if value < 0:
        raise ValueError(f"a duration is at least 0, got {shown}")
    if not value >= 0 or "inf" in text:  # not a number, or the word inf(inity)
        raise ValueError(f"expected seconds (90) or a duration (30s, 15m, 2h, 1d), got {shown}")
    if value > MAX_SECONDS:  # a number too long for a float comes as infinity: refused here too
        raise ValueError(f"a duration is at most 100 years ({MAX_SECONDS} s), got {shown}")
    return value
