"""A run's record across its attempts. A run directory outlives attempts: a restart or a
resubmission resumes from the last checkpoint and redoes the steps after it, appending to the same
metrics.jsonl and sample logs. Each attempt starts with a `start` row naming the step it resumed
at; rows past that step from earlier attempts were rolled back. Readers keep what survived."""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any


def _resumptions(rows: list[dict[str, Any]]) -> Iterator[tuple[int, int, bool]]:
    """(row index, first step done again, is a start row) wherever an attempt began: at each start
    row (it resumed at step S, so S+1 comes again), and in files written without start rows where
    a `train` step goes back."""
    last = 0
    for i, row in enumerate(rows):
        kind, step = row.get("kind"), row.get("step", 0)
        if kind == "start":
            yield i, step + 1, True
        elif kind == "train" and step <= last:
            yield i, step, False
        if kind in ("start", "train"):
            last = step


def surviving(rows: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    """The rows the run's final history holds, in order: where an attempt began, every earlier row
    of a step it does again was rolled back."""
    rows = list(rows)
    redo_from = {i: first for i, first, _ in _resumptions(rows)}
    out: list[dict[str, Any]] = []
    for i, row in enumerate(rows):
        if i in redo_from:
            out = [r for r in out if r.get("kind") == "start" or r.get("step", 0) < redo_from[i]]
        out.append(row)
    return out


def restarts(rows: Iterable[dict[str, Any]]) -> list[int]:
    """The steps at which later attempts of the run began (the first start row is the run's own)."""
    marks = list(_resumptions(list(rows)))
    first_start = next((i for i, _, is_start in marks if is_start), None)
    return [first - 1 if is_start else first for i, first, is_start in marks if i != first_start]


def read_rows(path: Path) -> list[dict[str, Any]]:
    """Whole JSON lines of a record file (a line being written right now is skipped)."""
    rows = []
    for line in path.read_text().splitlines() if path.is_file() else []:
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return rows


def attempts(rows: Iterable[dict[str, Any]]) -> int:
    """How many attempts have started, by their start rows."""
    return sum(r.get("kind") == "start" for r in rows)
