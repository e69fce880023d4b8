"""Where a training step's time goes: fsdpkit's trainer under torch.profiler, one process.

    python -m benchmarks.profile_step --preset debug --seq-len 512 --train-batch-size 16 --max-steps 6
    python -m benchmarks.profile_step --top 30 --trace /tmp/trace.json -- --preset llama3_2_1b --device cuda

Every flag after the options below goes to the trainer as is. The table is the operators (CPU) or
kernels (GPU) by their own time, summed over the profiled steps; the warm-up steps (the first
`--skip` optimizer steps, which hold compilation and allocator growth) are left out.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook
from torch.profiler import ProfilerActivity, profile, schedule


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--top", type=int, default=25, help="rows of the table")
    parser.add_argument("--skip", type=int, default=3, help="optimizer steps left out as warm-up")
    parser.add_argument("--trace", help="also write a Chrome trace here")
    parser.add_argument("--shapes", action="store_true", help="one row per operator and input shapes")
    args, trainer_flags = parser.parse_known_args(argv)
    trainer_flags = [f for f in trainer_flags if f != "--"]

    from fsdpkit.train.config import parse_args
    from fsdpkit.train.trainer import train

    cfg = parse_args(["--progress", "off", "--tensorboard", "0", "--validation-freq", "0", *trainer_flags])
    dev = cfg.parallel.device
    cuda = dev == "cuda" or (dev == "auto" and torch.cuda.is_available())
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    measured = cfg.optim.max_steps - args.skip
    if measured < 1 or args.skip < 1:
        parser.error(f"--skip must be at least 1 and --max-steps more than --skip ({args.skip})")
    prof = profile(activities=activities, record_shapes=args.shapes,
                   schedule=schedule(wait=args.skip - 1, warmup=1, active=measured))
    # The profiler advances once per optimizer step: wrap the step the trainer calls.
    step_hook = register_optimizer_step_post_hook(lambda *_: prof.step())
    try:
        with prof:
            train(cfg)
    finally:
        step_hook.remove()
    key = "self_device_time_total" if cuda else "self_cpu_time_total"
    if int(os.environ.get("RANK", 0)) == 0:  # under torchrun, one table is enough
        table = prof.key_averages(group_by_input_shape=args.shapes).table(sort_by=key, row_limit=args.top)
        print(table, file=sys.stdout)
    if args.trace:
        prof.export_chrome_trace(args.trace)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
