"""Shared helpers: run the real CLI in a subprocess and read what a run wrote."""

from __future__ import annotations

import gzip
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


DOCS = [f"document {i}: " + " ".join(f"w{(i * 7 + j) % 50}" for j in range(5 + i % 13)) for i in range(500)]


def write_fixture(root, fmt: str):
    root.mkdir(parents=True, exist_ok=True)
    records = [{"text": d, "id": i} for i, d in enumerate(DOCS)]
    if fmt == "jsonl":
        (root / "a.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records[:60]))
        (root / "b.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records[60:]))
    elif fmt == "jsonl.gz":
        with gzip.open(root / "all.jsonl.gz", "wt") as f:
            f.writelines(json.dumps(r) + "\n" for r in records)
    elif fmt == "jsonl.zst":
        import zstandard

        data = "".join(json.dumps(r) + "\n" for r in records).encode()
        (root / "all.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(data))
    elif fmt == "json":
        (root / "all.json").write_text(json.dumps(records))
    elif fmt == "parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.table({"text": DOCS, "id": list(range(len(DOCS)))}), root / "all.parquet", row_group_size=25)
    elif fmt == "txt":
        for i, d in enumerate(DOCS):
            (root / f"{i:03d}.txt").write_text(d)
    return root


@pytest.fixture
def cli():
    return run_cli
