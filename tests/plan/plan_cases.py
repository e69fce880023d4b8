"""What test_plan.py's workers share: the cases of one launch (CASES.json: [{"id": ..., "flags":
[trainer flags]}, ...]) and where their results go, and a process group per case.

The trainer is called case after case in the same processes (starting ranks costs more than a
two-step run). Under torchrun each case joins a process group made here on torchrun's store under
a prefix of its own: a group made again under the same keys would read the former group's
addresses. The trainer finds the group made and tears it down at the end of its run, as its own."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch.distributed as c10d

from fsdpkit.train.runtime import dist
from fsdpkit.train.runtime.supervisor import under_torchrun


def launch_args() -> tuple[list[dict], Path, int]:
    """The cases (argv 1), the folder their results go to (argv 2), and this process's rank."""
    return json.loads(Path(sys.argv[1]).read_text()), Path(sys.argv[2]), int(os.environ.get("RANK", "0"))


def join_group(case: str) -> None:
    """Under torchrun: this case's process group, on keys of its own; alone: nothing."""
    if under_torchrun():
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        store = c10d.PrefixStore(f"case-{case}/", dist._attempt_store(rank, world))
        c10d.init_process_group("gloo", store=store, rank=rank, world_size=world)
