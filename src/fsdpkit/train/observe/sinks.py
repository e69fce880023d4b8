"""Where a run's metric records go: metrics.jsonl, TensorBoard and the experiment trackers are all
sinks of one kind, fed the same rows and told how the run ended, under one error policy (Sinks):
the run's own record is required, so a failure to write it stops the run; any other sink that fails
(a tracker's server away, a full TensorBoard disk) is said once and training goes on."""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import Any, Protocol

log = logging.getLogger(__name__)


class Sink(Protocol):
    """One destination of the run's records: each row as it is made (`kind` is train, val or
    start; `metrics` holds its step), and how the run ended."""

    name: str

    def log(self, kind: str, metrics: dict[str, Any]) -> None: ...

    def close(self, ok: bool) -> None: ...


class JsonlSink:
    """RUN_DIR/metrics.jsonl, one row per line with its time and attempt (what report and
    summary.json read, across the run's attempts)."""

    name = "metrics.jsonl"

    def __init__(self, run_dir: Path, attempt: int):
        self.attempt = attempt
        self.file = (run_dir / "metrics.jsonl").open("a", buffering=1)

    def log(self, kind: str, metrics: dict[str, Any]) -> None:
        self.file.write(json.dumps({"kind": kind, "time": time.time(), "attempt": self.attempt, **metrics}) + "\n")

    def close(self, ok: bool) -> None:
        self.file.close()


class TensorBoardSink:
    """TensorBoard events: every number of a row as the scalar `kind/name` at the row's step."""

    name = "tensorboard"

    def __init__(self, log_dir: Path):
        from torch.utils.tensorboard import SummaryWriter  # imported with the sink: it loads TensorBoard

        self.writer = SummaryWriter(log_dir=str(log_dir))

    def log(self, kind: str, metrics: dict[str, Any]) -> None:
        for key, value in metrics.items():
            if key != "step" and isinstance(value, (int, float)):
                self.writer.add_scalar(f"{kind}/{key}", value, metrics["step"])

    def close(self, ok: bool) -> None:
        self.writer.close()


class Sinks:
    """The run's sinks under the one error policy: a required sink's failure is raised (the run
    cannot go on without its record); another's is said once, and that sink is skipped from then
    on, so one outage is one line, not one per step."""

    def __init__(self, required: list[Sink], optional: list[Sink]):
        self.required, self.optional = required, optional
        self.failed: set[str] = set()

    def _warn(self, sink: Sink, what: str, e: Exception) -> None:
        if sink.name in self.failed:
            return
        self.failed.add(sink.name)
        detail = str(e).splitlines()[0][:160] if str(e) else ""
        log.warning(f"{sink.name} did not take {what} ({type(e).__name__}: {detail}); training goes on without it")

    def log(self, kind: str, metrics: dict[str, Any]) -> None:
        for sink in self.required:
            sink.log(kind, metrics)
        for sink in self.optional:
            if sink.name in self.failed:
                continue
            try:
                sink.log(kind, metrics)
            except Exception as e:  # an outage of a side channel must not stop a training run
                self._warn(sink, f"step {metrics.get('step')}", e)

    def close(self, ok: bool) -> None:
        for sink in self.optional:
            try:
                sink.close(ok)
            except Exception as e:  # nor lose the run's end: the checkpoint and summary are written
                self._warn(sink, "the run's end", e)
        for sink in self.required:
            sink.close(ok)
