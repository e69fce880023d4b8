"""Shared helpers: run the real CLI in a subprocess and read what a run wrote."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# Small, fast settings shared by the training tests (tiny preset, short sequences).
FAST = ["--seq_len", "64", "--validation_freq", "0", "--validation_batches", "2", "--progress", "off"]


def run_cli(*args: str, timeout: float = 300, env: dict | None = None) -> subprocess.CompletedProcess:
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    return subprocess.run([sys.executable, "-m", "fsdpkit", *args], capture_output=True, text=True,
                          timeout=timeout, env=full_env, cwd=ROOT)


def read_metrics(run_dir: Path, kind: str = "train") -> list[dict]:
    lines = (Path(run_dir) / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["kind"] == kind]


def losses(run_dir: Path) -> list[float]:
    return [r["loss"] for r in read_metrics(run_dir)]


@pytest.fixture
def cli():
    return run_cli
