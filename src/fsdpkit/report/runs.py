"""Reading a run directory's metrics, including one that is still being written."""

from __future__ import annotations

import json
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fsdpkit.errors import UserError
from fsdpkit.train.observe.records import read_rows, restarts, surviving


@dataclass
class Run:
    name: str
    path: Path
    train: list[dict[str, Any]] = field(default_factory=list)  # metric lines of kind "train", in file order
    val: list[dict[str, Any]] = field(default_factory=list)
    restarts: list[int] = field(default_factory=list)  # steps at which a later attempt of the run began
    finished: bool = False  # summary.json exists: the run ended (a live or killed run has none)
    eval: dict[str, dict[str, float]] = field(default_factory=dict)  # `fsdpkit eval`'s scores: task -> metric

    def summary(self) -> dict[str, Any]:
        t = self.train

        def median(key: str) -> float | None:
            values = [r[key] for r in t if plottable(r, key)]
            return statistics.median(values) if values else None

        return {
            "name": self.name, "path": str(self.path), "finished": self.finished,
            "steps": t[-1]["step"] if t else 0,
            "first_loss": t[0]["loss"] if t else None, "final_loss": t[-1]["loss"] if t else None,
            "final_val_loss": self.val[-1]["val_loss"] if self.val else None,
            "median_tokens_per_s": median("tokens_per_s"), "median_mfu": median("mfu"),
            "peak_memory_gib": max((r["peak_memory_gib"] for r in t if "peak_memory_gib" in r), default=None),
            "restarts": len(self.restarts), "eval": self.eval,
        }


def plottable(row: dict[str, Any], key: str) -> bool:
    """A value to plot and summarise: present, and for MFU not above 100% (a wrong denominator)."""
    value = row.get(key)
    return value is not None and not (key == "mfu" and value > 1)


def load_run(path: Path) -> Run:
    """A run from RUN_DIR/metrics.jsonl. A line that is not (yet) whole JSON is skipped: the trainer
    may be writing it right now."""
    metrics = path / "metrics.jsonl"
    if not metrics.is_file():
        raise UserError(f"{path}: no metrics.jsonl here; pass a run directory (what `fsdpkit train` wrote)")
    run = Run(name=path.resolve().name, path=path, finished=(path / "summary.json").is_file())
    rows = read_rows(metrics)
    run.restarts = restarts(rows)
    kept = surviving(rows)  # one row per step: the attempt that survived
    run.train = [r for r in kept if r.get("kind") == "train"]
    run.val = [r for r in kept if r.get("kind") == "val"]
    if run.finished:
        try:
            summary = json.loads((path / "summary.json").read_text())
        except (OSError, ValueError):
            summary = {}
        run.eval = ((summary.get("eval") or {}).get("tasks") or {}) if isinstance(summary, dict) else {}
    return run


def load_runs(paths: list[Path]) -> list[Run]:
    runs = [load_run(p) for p in paths]
    names = [r.name for r in runs]
    for r in runs:  # two runs with the same folder name get their parent's name too
        if names.count(r.name) > 1:
            r.name = f"{r.path.resolve().parent.name}/{r.name}"
    return runs
