"""Start training: in this process, or as `--nproc N` processes under torchrun."""

from __future__ import annotations

import os
import sys

from fsdpkit.errors import UserError
from fsdpkit.train import dist
from fsdpkit.train.config import TrainConfig, parse_args


def torchrun_command(cfg: TrainConfig, argv: list[str], run_dir: str) -> list[str]:
    """torchrun on this machine with the same flags; the run directory is fixed here so every
    process agrees on it. `--nproc` is dropped: torchrun's own parser would take it for a prefix
    of its `--nproc-per-node`, and the workers do not need it."""
    rest, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg == "--nproc":
            skip = True
        elif not arg.startswith("--nproc="):
            rest.append(arg)
    return [
        sys.executable, "-m", "torch.distributed.run", "--standalone",
        f"--nproc_per_node={cfg.parallel.nproc}", f"--max-restarts={cfg.parallel.max_restarts}",
        "-m", "fsdpkit.train", *rest, "--run_dir", run_dir,
    ]


def launch(cfg: TrainConfig, argv: list[str], notices: list[str]) -> int:
    # Imported here so that `--help` and bad-input errors stay fast.
    from fsdpkit.train.trainer import preflight, train

    if cfg.parallel.nproc > 1 and not dist.under_torchrun():
        run_dir = preflight(cfg)
        env = dict(os.environ)
        if dist.resolve_device_type(cfg.parallel.device) == "cpu" and "OMP_NUM_THREADS" not in env:
            # torchrun would pin every process to one thread; share the cores out instead.
            env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // cfg.parallel.nproc))
        # Become torchrun (no parent left behind), so SIGTERM from Kubernetes or a user reaches it
        # and it forwards the signal to the workers, which save a checkpoint before exiting.
        cmd = torchrun_command(cfg, argv, str(run_dir))
        sys.stdout.flush()
        sys.stderr.flush()
        os.execve(cmd[0], cmd, env)
    result = train(cfg, notices)
    # 128 + SIGTERM, as if the signal had ended the process: an orchestrator must not take a
    # preempted run for a finished one.
    return 143 if result.stopped_by_signal else 0


def main(argv: list[str] | None = None, prog: str = "fsdpkit train") -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        cfg, notices = parse_args(argv, prog)
        return launch(cfg, argv, notices)
    except UserError as e:
        if int(os.environ.get("RANK", "0")) == 0:
            print(f"error: {e}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
