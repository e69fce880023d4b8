"""The skill walks in a clone with nothing beside it (no ../shared): a skill whose lines install
operators skips and says why, as the schema tests do, instead of failing on an install it cannot
make; under CI=true, where ../shared must be present, the same skip is a failure."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from conftest import copy_of_the_suite

INSTALLING = ("fsdpkit-provision-cluster", "fsdpkit-validate-nccl-efa")


@pytest.fixture(scope="module")
def clone(tmp_path_factory):
    """The suite copied into a folder with no ../shared beside it."""
    root = copy_of_the_suite(tmp_path_factory.mktemp("clone") / "fsdpkit")
    assert not (root.parent / "shared").exists()
    return root


def walk(clone, ci: bool) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("CI", "PYTEST_XDIST_WORKER", "PYTEST_XDIST_WORKER_COUNT")}
    if ci:
        env["CI"] = "true"
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-rsf", "-p", "no:cacheprovider",
                           "tests/skills/test_skill_commands.py", "-k", " or ".join(INSTALLING)],
                          cwd=clone, env=env, capture_output=True, text=True, timeout=300)


def test_without_shared_a_skill_that_installs_operators_skips_and_says_why(clone):
    r = walk(clone, ci=False)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "2 skipped" in r.stdout and "failed" not in r.stdout, r.stdout[-3000:]
    for skill in INSTALLING:
        assert f"{skill} installs operators whose CRDs are in {clone.parent / 'shared' / 'schemas'}, absent here" \
            in r.stdout, r.stdout[-3000:]


def test_under_ci_the_same_absence_fails(clone):
    r = walk(clone, ci=True)
    assert r.returncode == 1 and "2 failed" in r.stdout, r.stdout[-3000:]
    assert "CI=true, where it must be present" in r.stdout
