"""The one wait loop: it looks until done or out of time, reports each change once, and backs off."""

from __future__ import annotations

import time

from fsdpkit.polling import poll_until


def test_it_looks_until_done_and_reports_each_change_once():
    looks, seen = iter(["Pending", "Pending", "Running", "Running", "Succeeded", "never looked at"]), []
    last = poll_until(lambda: next(looks), lambda s: s == "Succeeded", None, 0.01, seen.append)
    assert last == "Succeeded" and seen == ["Pending", "Running", "Succeeded"]
    assert next(looks) == "never looked at"


def test_out_of_time_it_returns_the_last_look():
    count = iter(range(10**6))
    started = time.monotonic()
    last = poll_until(lambda: next(count), lambda n: False, 0.3, 0.05)
    assert 0.3 <= time.monotonic() - started < 2 and 3 <= last < 20


def test_a_timeout_of_zero_looks_once():
    assert poll_until(lambda: "Running", lambda s: False, 0, 10) == "Running"


def test_its_delay_starts_at_a_second_and_doubles_up_to_poll(monkeypatch):
    slept: list[float] = []
    monkeypatch.setattr(time, "sleep", slept.append)   # the delays asked for, none waited
    looks = iter(range(8))
    poll_until(lambda: next(looks), lambda n: n == 7, None, 10)
    assert slept == [1, 2, 4, 8, 10, 10, 10]


def test_changes_are_told_by_key():
    seen = []
    looks = iter([("Running", 0), ("Running", 0), ("Running", 1), ("Succeeded", 1)])
    poll_until(lambda: next(looks), lambda s: s[0] == "Succeeded", None, 0.01, seen.append, key=lambda s: s)
    assert seen == [("Running", 0), ("Running", 1), ("Succeeded", 1)]
