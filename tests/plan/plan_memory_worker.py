"""Run by test_plan.py (alone or under torchrun): real fsdpkit training runs under torch.profiler
with memory profiling, one after another in the same process(es) (tests/launch_cases.py), and
each run's peak of the bytes its tensors held, from the profiler's allocation and free events in
the order they happened. Each run starts with nothing of an earlier one alive (its objects
collected first), so every event the profiler records is the run's own. Each rank writes
OUT_DIR/ID.rank<N>.json per case.
Usage (from tests/): [torchrun --nproc-per-node 2 | python] -m plan.plan_memory_worker CASES.json OUT_DIR"""

from __future__ import annotations

import gc
import json

from torch.profiler import ProfilerActivity, profile

from fsdpkit.train.config import parse_args
from fsdpkit.train.runtime import dist
from fsdpkit.train.trainer import train

from launch_cases import join_group, launch_args


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


def measured(flags: list[str], case: str) -> int:
    """One run's tensor peak, the run started with nothing of an earlier one alive."""
    cfg = parse_args(flags)
    gc.collect()
    join_group(case)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        train(cfg)
    return tensor_peak(prof)


if __name__ == "__main__":
    cases, out_dir, rank = launch_args()
    for case in cases:
        peak = measured(case["flags"], case["id"])
        (out_dir / f"{case['id']}.rank{rank}.json").write_text(json.dumps({"peak_bytes": peak}))
    dist.leave(0)  # as fsdpkit's own workers end: no interpreter finalization racing gloo's threads
