"""Several trainer runs in one launch: starting ranks (torch's import, the agent, the rendezvous)
costs more than a short run, so tests that need several runs of one world size make them in the
same processes, case after case. CASES.json: [{"id": ..., "flags": [trainer flags]}, ...].

Under torchrun each case joins a process group made here on torchrun's store under a prefix of
its own: a group made again under the same keys would read the former group's addresses. The
trainer finds the group made and tears it down at the end of its run, as its own.

`python -m launch_cases CASES.json OUT_DIR` (from tests/, under torchrun or alone) trains the
cases and nothing else; tests/plan's workers measure each case as it trains."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch.distributed as c10d

from fsdpkit.train.config import parse_args
from fsdpkit.train.runtime import dist
from fsdpkit.train.runtime.supervisor import under_torchrun
from fsdpkit.train.trainer import train

TESTS = Path(__file__).resolve().parent


def launch(module: str, cases: list[dict], out: Path, world: int) -> None:
    """Run `python -m MODULE` (a module under tests/) over `cases` in one launch of `world`
    processes (torchrun's when more than one), its results under `out`."""
    (out / f"cases{world}.json").write_text(json.dumps(cases))
    cmd = [sys.executable, *(["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world}"]
                             if world > 1 else []), "-m", module, str(out / f"cases{world}.json"), str(out)]
    r = subprocess.run(cmd, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True, cwd=TESTS,
                       timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]


def launch_args() -> tuple[list[dict], Path, int]:
    """The cases (argv 1), the folder their results go to (argv 2), and this process's rank."""
    return json.loads(Path(sys.argv[1]).read_text()), Path(sys.argv[2]), int(os.environ.get("RANK", "0"))


def join_group(case: str) -> None:
    """Under torchrun: this case's process group, on keys of its own; alone: nothing."""
    if under_torchrun():
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        store = c10d.PrefixStore(f"case-{case}/", dist._attempt_store(rank, world))
        c10d.init_process_group("gloo", store=store, rank=rank, world_size=world)


if __name__ == "__main__":
    cases, _, _ = launch_args()
    for case in cases:
        cfg = parse_args(case["flags"])
        join_group(case["id"])
        train(cfg)
    dist.leave(0)  # as fsdpkit's own workers end: no interpreter finalization racing gloo's threads
