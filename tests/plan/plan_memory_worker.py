"""Run by test_plan.py (alone or under torchrun): real fsdpkit training runs under torch.profiler
with memory profiling, one after another in the same process(es) (one launch for every case of a
world size: the start-up is most of a small run's cost), and each run's peak of the bytes its
tensors held, from the profiler's allocation and free events in the order they happened. Each rank
writes OUT_DIR/ID.rank<N>.json per case.

Each run starts with nothing of an earlier one alive (its objects collected first), so every event
the profiler records is the run's own. Under torchrun, each case's process group is made here on
torchrun's store under a prefix of its own (a group made again under the same keys would read the
former group's addresses); the trainer finds it made and tears it down, as it does its own.
Usage: [torchrun --nproc-per-node 2] tests/plan/plan_memory_worker.py CASES.json OUT_DIR
CASES.json: [{"id": ..., "flags": [trainer flags]}, ...]"""

from __future__ import annotations

import gc
import json
import os
import sys
from pathlib import Path

import torch.distributed as c10d
from torch.profiler import ProfilerActivity, profile

from fsdpkit.train.config import parse_args
from fsdpkit.train.runtime import dist
from fsdpkit.train.runtime.supervisor import under_torchrun
from fsdpkit.train.trainer import train


def tensor_peak(prof: profile) -> int:
    """Largest sum of live tensor bytes: every allocation and free is one "[memory]" event with a
    signed byte count; nothing is allocated before the profiled run starts."""
    events = sorted((e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"),
                    key=lambda e: e.start_ns())
    live = peak = 0
    for e in events:
        live += e.nbytes()
        peak = max(peak, live)
    return peak


def measured(flags: list[str], case: str, rank: int) -> int:
    """One run's tensor peak, the run started with nothing of an earlier one alive."""
    cfg = parse_args(flags)
    gc.collect()
    if under_torchrun():
        world = int(os.environ["WORLD_SIZE"])
        store = c10d.PrefixStore(f"case-{case}/", dist._attempt_store(rank, world))
        c10d.init_process_group("gloo", store=store, rank=rank, world_size=world)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        train(cfg)
    return tensor_peak(prof)


if __name__ == "__main__":
    cases, out_dir = json.loads(Path(sys.argv[1]).read_text()), Path(sys.argv[2])
    rank = int(os.environ.get("RANK", "0"))
    for case in cases:
        peak = measured(case["flags"], case["id"], rank)
        (out_dir / f"{case['id']}.rank{rank}.json").write_text(json.dumps({"peak_bytes": peak}))
    dist.leave(0)  # as fsdpkit's own workers end: no interpreter finalization racing gloo's threads
