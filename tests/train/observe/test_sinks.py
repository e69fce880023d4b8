"""Every destination of a run's records is a sink under one error policy: the run's own record
(metrics.jsonl) is required, any other sink that fails is said once and skipped from then on."""

from __future__ import annotations

import json

import pytest

from fsdpkit.train.observe.metrics import MetricsWriter
from fsdpkit.train.observe.sinks import JsonlSink, Sinks


class Flaky:
    """A tracker whose server goes away after `ok_rows` rows (and stays away for the run's end)."""

    name = "flaky"

    def __init__(self, ok_rows: int):
        self.ok_rows, self.rows, self.closed = ok_rows, [], None

    def log(self, kind, metrics):
        if len(self.rows) >= self.ok_rows:
            raise ConnectionError("server unreachable\nsecond line")
        self.rows.append((kind, metrics["step"]))

    def close(self, ok):
        raise ConnectionError("still unreachable")


class Steady:
    name = "steady"

    def __init__(self):
        self.rows, self.closed = [], None

    def log(self, kind, metrics):
        self.rows.append((kind, metrics["step"]))

    def close(self, ok):
        self.closed = ok


def test_a_failing_side_sink_is_said_once_and_the_others_get_every_row(tmp_path, diagnostics):
    flaky, steady = Flaky(ok_rows=2), Steady()
    writer = MetricsWriter(tmp_path, None, progress=False, total_steps=5, attempt=1, trackers=[flaky, steady])
    writer.record("start", {"step": 0})
    for step in (1, 2, 3, 4):
        writer.record("train", {"step": step, "loss": 5.0 - step})
    writer.close(ok=True)
    assert flaky.rows == [("start", 0), ("train", 1)]
    assert steady.rows == [("start", 0), *[("train", s) for s in (1, 2, 3, 4)]] and steady.closed is True
    # One line for the outage (its first line only), none for the later rows or the failed close.
    assert diagnostics == ["warning: flaky did not take step 2 (ConnectionError: server unreachable); "
                           "training goes on without it"]
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [(r["kind"], r["step"], r["attempt"]) for r in rows] == [("start", 0, 1)] + [
        ("train", s, 1) for s in (1, 2, 3, 4)]


def test_the_runs_own_record_is_required(tmp_path):
    """A row metrics.jsonl cannot take stops the run: training without its record is not allowed to
    look like success."""
    jsonl = JsonlSink(tmp_path, 0)
    jsonl.file.close()   # as a full or vanished disk leaves it
    sinks = Sinks([jsonl], [])
    with pytest.raises(ValueError):
        sinks.log("train", {"step": 1})


def test_a_run_without_trackers_opens_none_and_writes_no_ids(tmp_path):
    from fsdpkit.train.observe.trackers import IDS, open_trackers

    assert open_trackers((), tmp_path, "p", {}, 0) == []
    assert not (tmp_path / IDS).exists()
