"""A run's record across its attempts. A run directory outlives attempts: a restart or a
resubmission resumes from the last checkpoint and redoes the steps after it, appending to the same
metrics.jsonl and sample logs. Each attempt starts with a `start` row naming the step it resumed
at; rows past that step from earlier attempts were rolled back. Readers keep what survived."""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path


def surviving(rows: Iterable[dict]) -> list[dict]:
    """The rows the run's final history holds, in order: a start row at step S drops every earlier
    row past S. Files written without start rows roll back when a `train` step goes back."""
    out: list[dict] = []
    last = 0
    for row in rows:
        kind, step = row.get("kind"), row.get("step", 0)
        if kind == "start":
            out = [r for r in out if r.get("kind") == "start" or r.get("step", 0) <= step]
        elif kind == "train" and step <= last:
            out = [r for r in out if r.get("kind") == "start" or r.get("step", 0) < step]
        if kind in ("start", "train"):
            last = step
        out.append(row)
    return out


def read_rows(path: Path) -> list[dict]:
    """Whole JSON lines of a record file (a line being written right now is skipped)."""
    rows = []
    for line in path.read_text().splitlines() if path.is_file() else []:
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return rows


def attempts(rows: Iterable[dict]) -> int:
    """How many attempts have started, by their start rows."""
    return sum(r.get("kind") == "start" for r in rows)
