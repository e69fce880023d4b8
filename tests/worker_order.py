"""The order in which the xdist workers are handed the test files: the longest first.

`make test` runs two workers with `--dist loadfile`: a file's tests stay on one worker (module
fixtures, one Slurm), each worker taking the next file as it finishes one. Left to itself xdist
orders the files by their number of tests, which hands out last the files of a few long tests
(context and expert parallel, NF4: a minute or more each) while the other worker has nothing left.
Longest first, the files that come last are short and both workers finish together.

How long a file takes is read from file_seconds.json beside this module: each file's tests' own
times summed, as a junit report of a whole pass records them. After adding or moving heavy tests,
write it again from such a report:

    python tests/worker_order.py report.xml     # the report of `make pytest PYTEST_ARGS=--junitxml=report.xml`

A file it does not list counts as UNKNOWN_S.
"""

from __future__ import annotations

import json
import sys
import xml.etree.ElementTree as ET
from collections import defaultdict
from collections.abc import MutableSequence
from pathlib import Path
from typing import Protocol

SECONDS = Path(__file__).with_name("file_seconds.json")
UNKNOWN_S = 5.0   # a file of no record: in the middle of the order, neither first nor among the last


class _Item(Protocol):
    nodeid: str


def file_of(nodeid: str) -> str:
    return nodeid.split("::", 1)[0]


def order(items: MutableSequence[_Item], seconds: dict[str, float] | None = None) -> None:
    """Sort the collected tests, in place, by their file's time, longest first; the tests of a file
    stay together and in their order."""
    took = json.loads(SECONDS.read_text()) if seconds is None else seconds
    items[:] = sorted(items, key=lambda item: -took.get(file_of(item.nodeid), UNKNOWN_S))


def seconds_per_file(junit_xml: str | Path) -> dict[str, float]:
    """Each test file's tests' times summed (setup, call and teardown, as junit records them),
    longest first, from a junit report whose test classes are dotted paths (tests.train.test_x)."""
    took: dict[str, float] = defaultdict(float)
    for case in ET.parse(junit_xml).iter("testcase"):
        parts = case.get("classname", "").split(".")
        while parts and parts[-1][:1].isupper():   # a test class inside the module
            parts.pop()
        took["/".join(parts) + ".py"] += float(case.get("time", 0))
    return {f: round(s, 1) for f, s in sorted(took.items(), key=lambda kv: (-kv[1], kv[0]))}


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python tests/worker_order.py JUNIT_XML (writes tests/file_seconds.json)", file=sys.stderr)
        return 2
    SECONDS.write_text(json.dumps(seconds_per_file(argv[0]), indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
