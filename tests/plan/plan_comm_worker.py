"""Run by test_plan.py under torchrun: a real fsdpkit training run with every c10d collective it
issues recorded (op, output and input bytes) through a TorchDispatchMode, each optimizer step marked
among them as ("optimizer.step", 0, 0), written as JSON by rank 0 to OUT.json and by every other
rank r to OUT.json.r (expert parallel's all-to-alls differ by rank).
Usage: torchrun --nproc-per-node 2 tests/plan/plan_comm_worker.py OUT.json [trainer flags]"""

from __future__ import annotations

import json
import os
import sys

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook
from torch.utils._python_dispatch import TorchDispatchMode

from fsdpkit.train.config import parse_args
from fsdpkit.train.runtime.dist import leave
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
    cfg = parse_args(sys.argv[2:])
    mode = Collectives()
    register_optimizer_step_post_hook(lambda *_: mode.calls.append(("optimizer.step", 0, 0)))
    with mode:
        train(cfg)
    rank = int(os.environ.get("RANK", "0"))
    with open(sys.argv[1] + (f".{rank}" if rank else ""), "w") as f:
        json.dump(mode.calls, f)
    leave(0)  # as fsdpkit's own workers end: no interpreter finalization racing gloo's threads
