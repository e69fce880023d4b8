"""The order the workers take the test files in (tests/worker_order.py): longest first, from the times
a junit report recorded, each file's tests together and in their order."""

from __future__ import annotations

import json
import subprocess
import sys
from types import SimpleNamespace

import worker_order
from conftest import ROOT


def test_the_longest_file_comes_first_and_each_file_keeps_its_tests_in_order():
    items = [SimpleNamespace(nodeid=n) for n in (
        "tests/a.py::test_1", "tests/b.py::test_1", "tests/a.py::test_2", "tests/c.py::T::test_1",
        "tests/new.py::test_1", "tests/b.py::test_2")]
    # a is the shortest by its record, b the longest; new.py has none (UNKNOWN_S, 5 s: between c and a).
    worker_order.order(items, {"tests/a.py": 1.5, "tests/b.py": 40.0, "tests/c.py": 6.0})
    assert [i.nodeid for i in items] == ["tests/b.py::test_1", "tests/b.py::test_2", "tests/c.py::T::test_1",
                                         "tests/new.py::test_1", "tests/a.py::test_1", "tests/a.py::test_2"]


def test_a_file_s_time_is_its_tests_summed_from_a_junit_report(tmp_path):
    report = tmp_path / "report.xml"
    report.write_text("""<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite name="pytest">
<testcase classname="tests.train.test_x" name="test_a" time="1.25" />
<testcase classname="tests.jobs.test_y" name="test_b" time="3.000" />
<testcase classname="tests.train.test_x.TestGroup" name="test_c" time="2.5" />
<testcase classname="tests.train.test_x" name="test_d[p]" time="0.05" />
</testsuite></testsuites>""")
    # test_x: 1.25 + 2.5 (its class's test) + 0.05 = 3.8, longer than test_y's 3.0: listed first.
    assert list(worker_order.seconds_per_file(report).items()) == [("tests/train/test_x.py", 3.8),
                                                               ("tests/jobs/test_y.py", 3.0)]


def test_every_file_timed_is_a_test_file_of_the_suite():
    """A file moved or removed leaves its time behind: written again from a report, it goes."""
    seconds = json.loads(worker_order.SECONDS.read_text())
    assert len(seconds) > 50
    assert [f for f in seconds if not (ROOT / f).is_file()] == []


def test_pytest_collects_the_longest_file_first_whatever_the_order_it_is_given():
    """The order xdist hands out with --no-loadscope-reorder is the collection's (the Makefile's line:
    tests/test_makefile.py): here two files, the shorter named first."""
    seconds = json.loads(worker_order.SECONDS.read_text())
    short, long = "tests/test_yamlfile.py", "tests/jobs/test_jobs_render.py"
    assert seconds[short] < seconds[long]
    r = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", short, long],
                       cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    files = [worker_order.file_of(line) for line in r.stdout.splitlines() if "::" in line]
    assert files[0] == long and files[-1] == short and set(files) == {short, long}
    assert files == sorted(files, key=lambda f: f != long)
