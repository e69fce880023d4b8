"""Run by test_plan.py under torchrun: real fsdpkit training runs, one after another in the same two
ranks (tests/launch_cases.py), with every c10d collective each issues recorded (op, output and
input bytes) through a TorchDispatchMode, each optimizer step marked among them as
("optimizer.step", 0, 0). A case's calls are written as JSON by rank 0 to OUT_DIR/ID.json and by
every other rank r to OUT_DIR/ID.json.r (expert parallel's all-to-alls differ by rank).
Usage (from tests/): torchrun --nproc-per-node 2 -m plan.plan_comm_worker CASES.json OUT_DIR"""

from __future__ import annotations

import json

import torch
import torch.distributed as c10d
from torch.optim.optimizer import register_optimizer_step_post_hook
from torch.utils._python_dispatch import TorchDispatchMode

from fsdpkit.train.config import parse_args
from fsdpkit.train.runtime import dist
from fsdpkit.train.trainer import train

from launch_cases import join_group, launch_args


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
    cases, out_dir, rank = launch_args()
    modes: list[Collectives] = []
    register_optimizer_step_post_hook(lambda *_: modes[-1].calls.append(("optimizer.step", 0, 0)))
    for case in cases:
        cfg = parse_args(case["flags"])
        join_group(case["id"])
        modes.append(Collectives())
        with modes[-1]:
            train(cfg)
        assert not c10d.is_initialized(), "the trainer left its process group"
        (out_dir / (f"{case['id']}.json" + (f".{rank}" if rank else ""))).write_text(json.dumps(modes[-1].calls))
    dist.leave(0)  # as fsdpkit's own workers end: no interpreter finalization racing gloo's threads
