"""What every benchmark records next to its numbers: when, where, with what."""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
from collections.abc import Callable
from datetime import date
from pathlib import Path

import torch

RESULTS_MD = Path(__file__).with_name("RESULTS.md")


def cpu_name() -> str:
    """The CPU's model name (Linux), which says more than the architecture: CPUs of one
    architecture differ here by 2x and more in bf16 matmul rate."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def environment() -> dict:
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                cwd=Path(__file__).parent, check=False).stdout.strip() or None
    except OSError:
        commit = None
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else (
        f"CPU {cpu_name()}, {os.cpu_count()} cores")
    return {"date": date.today().isoformat(), "device": device, "torch": torch.__version__,
            "python": platform.python_version(), "commit": commit, "threads": torch.get_num_threads()}


def arguments(doc: str | None, results: str, smoke: str) -> argparse.ArgumentParser:
    """The options every benchmark has: --smoke (what CI runs), --out (its JSON) and --no-results-md."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true", help=smoke)
    parser.add_argument("--out", type=Path, default=Path(__file__).with_name("results") / results)
    parser.add_argument("--no-results-md", action="store_true", help="do not append to RESULTS.md")
    return parser


def model_arguments(doc: str | None, results: str, smoke: str) -> argparse.ArgumentParser:
    """`arguments` plus what a benchmark over a preset's model takes: the preset, fewer layers, the
    device, and --from-json (a run made on a lent GPU, whose checkout is gone, into RESULTS.md)."""
    parser = arguments(doc, results, smoke)
    parser.add_argument("--preset", default="debug")
    parser.add_argument("--layers", type=int, help="fewer layers than the preset has")
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    parser.add_argument("--from-json", type=Path, help="append the rows of an earlier run's JSON to RESULTS.md")
    return parser


def device_of(args: argparse.Namespace) -> torch.device:
    """--device, with auto the GPU where there is one."""
    return torch.device(("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device)


def replayed(args: argparse.Namespace, write_results_md: Callable[[dict], None]) -> bool:
    """With --from-json: that run's rows appended to RESULTS.md (and nothing run)."""
    if args.from_json:
        write_results_md(json.loads(args.from_json.read_text()))
    return bool(args.from_json)


def publish(args: argparse.Namespace, result: dict, write_results_md: Callable[[dict], None]) -> int:
    """A benchmark's ending: its JSON to --out, and (not a smoke run, not --no-results-md) its rows
    to RESULTS.md."""
    write_json(args.out, result)
    if not args.smoke and not args.no_results_md:
        write_results_md(result)
    return 0


def write_json(path: Path, payload: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=2) + "\n")


def append_rows(section: str, header: list[str], rows: list[list]) -> None:
    """Append a table under a `## section` heading of RESULTS.md (created if missing)."""
    text = RESULTS_MD.read_text() if RESULTS_MD.exists() else "# Benchmark results\n"
    line = "| " + " | ".join(str(c) for c in header) + " |"
    if f"## {section}" not in text:
        text += f"\n## {section}\n\n{line}\n|" + "---|" * len(header) + "\n"
    lines = text.rstrip("\n").split("\n")
    # Insert after the last row of this section's table.
    start = lines.index(f"## {section}")
    end = start + 1
    while end < len(lines) and not lines[end].startswith("## "):
        end += 1
    while end > start and not lines[end - 1].startswith("|"):
        end -= 1
    new = ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    lines[end:end] = new
    RESULTS_MD.write_text("\n".join(lines) + "\n")
