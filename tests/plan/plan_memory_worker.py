"""Run by test_plan.py (alone or under torchrun): a real fsdpkit training run under torch.profiler
with memory profiling, and the peak of the bytes its tensors held, from the profiler's allocation
and free events in the order they happened. Each rank writes OUT/rank<N>.json.
Usage: [torchrun --nproc-per-node 2] tests/plan/plan_memory_worker.py OUT_DIR [trainer flags]"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from torch.profiler import ProfilerActivity, profile

from fsdpkit.train.config import parse_args
from fsdpkit.train.runtime.dist import leave
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


if __name__ == "__main__":
    cfg = parse_args(sys.argv[2:])
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        train(cfg)
    out = Path(sys.argv[1]) / f"rank{os.environ.get('RANK', '0')}.json"
    out.write_text(json.dumps({"peak_bytes": tensor_peak(prof)}))
    leave(0)  # as fsdpkit's own workers end: no interpreter finalization racing gloo's threads
