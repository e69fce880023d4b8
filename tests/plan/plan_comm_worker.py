"""Run by test_plan.py under torchrun: real fsdpkit training runs, one after another in the same two
ranks (one launch for every case: the ranks' start-up is most of a small run's cost), with every c10d
collective each issues recorded (op, output and input bytes) through a TorchDispatchMode, each
optimizer step marked among them as ("optimizer.step", 0, 0). A case's calls are written as JSON by
rank 0 to OUT_DIR/ID.json and by every other rank r to OUT_DIR/ID.json.r (expert parallel's
all-to-alls differ by rank).

Each case's process group is made here, on torchrun's store under a prefix of its own (a group made
again under the same keys would read the former group's addresses); the trainer finds it made and
tears it down at the end of its run, as it does its own.
Usage: torchrun --nproc-per-node 2 tests/plan/plan_comm_worker.py CASES.json OUT_DIR
CASES.json: [{"id": ..., "flags": [trainer flags]}, ...]"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as c10d
from torch.optim.optimizer import register_optimizer_step_post_hook
from torch.utils._python_dispatch import TorchDispatchMode

from fsdpkit.train.config import parse_args
from fsdpkit.train.runtime import dist
from fsdpkit.train.trainer import train


class Collectives(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.calls: list[tuple[str, int, int]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.name()
        if name in ("c10d::_allgather_base_", "c10d::_reduce_scatter_base_"):
            out, inp = args[0], args[1]   # (output_tensor, input_tensor, process_group, ...)
            self.calls.append((name, out.numel() * out.element_size(), inp.numel() * inp.element_size()))
        elif name == "_c10d_functional::all_to_all_single":   # context parallel (input, ..., group)
            inp = args[0]
            self.calls.append((name, inp.numel() * inp.element_size(), 0))
        elif name.startswith(("c10d::", "_c10d_functional")):
            tensors = [t for a in args for t in (a if isinstance(a, list) else [a]) if isinstance(t, torch.Tensor)]
            self.calls.append((name, sum(t.numel() * t.element_size() for t in tensors), 0))
        return func(*args, **(kwargs or {}))


if __name__ == "__main__":
    cases, out_dir = json.loads(Path(sys.argv[1]).read_text()), Path(sys.argv[2])
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    modes: list[Collectives] = []
    register_optimizer_step_post_hook(lambda *_: modes[-1].calls.append(("optimizer.step", 0, 0)))
    for case in cases:
        cfg = parse_args(case["flags"])
        c10d.init_process_group("gloo", store=c10d.PrefixStore(f"case-{case['id']}/", dist._attempt_store(rank, world)),
                                rank=rank, world_size=world)
        modes.append(Collectives())
        with modes[-1]:
            train(cfg)
        assert not c10d.is_initialized(), "the trainer left its process group"
        (out_dir / (f"{case['id']}.json" + (f".{rank}" if rank else ""))).write_text(json.dumps(modes[-1].calls))
    dist.leave(0)  # as fsdpkit's own workers end: no interpreter finalization racing gloo's threads
