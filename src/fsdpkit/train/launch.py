"""Start training: in this process, or as `--nproc N` processes under torchrun."""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import sys
import traceback
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from fsdpkit.effects import Effect, declare
from fsdpkit.envelope import emit_error, emit_json, show_diagnostics
from fsdpkit.errors import UserError
from fsdpkit.train import config
from fsdpkit.train.config import TrainConfig, parse_args
from fsdpkit.train.runtime import run_lock
from fsdpkit.train.runtime.supervisor import (
    EXIT_STOPPED,
    Supervisor,
    die_with_parent,
    hand_over_error,
    launcher_log,
    report_stopped,
    supervised,
    torchrun_args,
    under_torchrun,
)

if TYPE_CHECKING:  # the trainer (torch) is imported when a run starts, so that --help stays fast
    from fsdpkit.train.trainer import TrainResult


# The launcher's --nproc, for its workers: their config.yaml records it as given, so `--config` of it
# starts as many again.
NPROC_ENV = "FSDPKIT_NPROC"


def agent_args(cfg: TrainConfig, argv: list[str], run_dir: str) -> list[str]:
    """torchrun's arguments for this machine, then the worker's module and the same flags; the run
    directory is fixed here so every process agrees on it. `--nproc` is dropped: torchrun's own
    parser would take it for a prefix of its `--nproc-per-node` (it reaches the workers as NPROC_ENV)."""
    rest, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg == "--nproc":
            skip = True
        elif not arg.startswith("--nproc="):
            rest.append(arg)
    return [*torchrun_args(cfg.parallel.nproc, cfg.parallel.max_restarts), "-m", "fsdpkit.train", *rest,
            "--run-dir", run_dir]


def launch(cfg: TrainConfig, argv: list[str], accepted: Callable[[], None] = lambda: None) \
        -> tuple[int, TrainResult | None]:
    """Train; returns (exit code, TrainResult or None). With --nproc N this process supervises
    N workers under torchrun (fsdpkit.train.runtime.supervisor) and returns their outcome."""
    # Imported here, as torch is, so that `--help` and bad-input errors stay fast (no torch until a
    # run starts).
    from fsdpkit.train.runtime import agent
    from fsdpkit.train.runtime.dist import resolve_device_type
    from fsdpkit.train.trainer import preflight, train

    if cfg.parallel.nproc > 1 and not under_torchrun():
        # This process outlives every restart of the workers: it holds the checkpoint directory.
        run_dir, lock = preflight(cfg)
        accepted()
        env = {**os.environ, run_lock.HELD_ENV: "1", NPROC_ENV: str(cfg.parallel.nproc)}
        if resolve_device_type(cfg.parallel.device) == "cpu" and "OMP_NUM_THREADS" not in env:
            # torchrun would pin every process to one thread; share the cores out instead.
            env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // cfg.parallel.nproc))
        sys.stdout.flush()
        sys.stderr.flush()
        try:
            return Supervisor(agent_args(cfg, argv, str(run_dir)), env, start=agent.main).run(), None
        finally:
            lock.release()
    result = train(cfg, accepted)
    if not result.stopped_by_signal:
        return 0, result
    if supervised():
        # Exit 0 so torchrun neither restarts nor reports the workers; the supervisor exits 143.
        # Every worker says so: each node's supervisor hears it from its own workers.
        report_stopped()
        return 0, result
    # 128 + SIGTERM, as if the signal had ended the process: an orchestrator must not take a
    # preempted run for a finished one.
    return EXIT_STOPPED, result


def summary(result: TrainResult) -> dict[str, Any]:
    """The envelope's data: what rank 0 wrote to RUN_DIR/summary.json, and where the run is."""
    path = result.run_dir / "summary.json"
    data = json.loads(path.read_text()) if path.is_file() else {"steps": result.steps}
    return {"run_dir": str(result.run_dir), **data, "stopped_by_signal": result.stopped_by_signal}


def build_parser() -> argparse.ArgumentParser:
    """`fsdpkit train`'s parser: the config's, generated from its fields."""
    parser = config.build_parser()
    declare(parser, Effect.WRITES | Effect.LONG)   # checkpoints and the run's folder
    return parser


def _to_stdout(line: str) -> None:
    print(line, flush=True)  # the stream of the moment: stderr under --json


def _silent(line: str) -> None:
    pass


def _accepted(cfg: TrainConfig, rank0: bool, held: list[str]) -> Callable[[], None]:
    """What runs once the run passed its checks: what was said so far is shown (a refused run shows
    only its error), and what is said from here on, as it is said. A launcher of --nproc workers
    leaves what reading the options said to them."""
    def accepted() -> None:
        if rank0:
            show_diagnostics(_to_stdout)
            if not (cfg.parallel.nproc > 1 and not under_torchrun()):
                for line in held:
                    _to_stdout(line)
    return accepted


def main(argv: list[str] | None = None, prog: str = "fsdpkit train") -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    # --json: every human line goes to stderr and rank 0 prints one envelope on stdout at the end
    # (also under torchrun, where the flag travels to the workers with the others).
    as_json = "--json" in argv
    rank0 = int(os.environ.get("RANK", "0")) == 0
    if under_torchrun():
        die_with_parent()  # a worker never outlives torchrun's agent
        if NPROC_ENV in os.environ:
            argv += ["--nproc", os.environ[NPROC_ENV]]
    # What reading the options says waits until it is known who trains: a launcher of --nproc
    # workers leaves it to them (rank 0 says it once); other ranks say nothing.
    held: list[str] = []
    show_diagnostics(held.append if rank0 else _silent)
    cfg = None
    try:
        cfg = parse_args(argv, prog)
        if cfg.log.verbose:
            logging.getLogger("fsdpkit").setLevel(logging.DEBUG)
        with contextlib.redirect_stdout(sys.stderr) if as_json else contextlib.nullcontext():
            code, result = launch(cfg, argv, _accepted(cfg, rank0, held))
        if as_json and rank0 and result is not None:
            _emit_result(result, code)
        return code
    except UserError as e:
        if not (under_torchrun() and hand_over_error(e)) and rank0:
            emit_error(e, as_json)
        return e.exit_code
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except Exception as e:
        if not (under_torchrun() and _lost_a_peer(e)):
            raise
        return _peer_gone(e, cfg)


def _emit_result(result: TrainResult, code: int) -> None:
    """Rank 0's envelope of the run: a stopped run is not a finished one, also in a worker that
    exits 0 for its supervisor."""
    stopped = result.stopped_by_signal
    emit_json(summary(result), EXIT_STOPPED if stopped else code,
              f"stopped by SIGTERM at step {result.steps}" if stopped else None,
              hint="run it again with --resume-from-checkpoint auto to continue" if stopped else None)


def _peer_gone(e: BaseException, cfg: TrainConfig | None) -> int:
    """A consequence, not the cause: the rank that failed first says why (the agent reports it).
    This one's traceback goes to the launcher's log, where its report of the failure also goes."""
    path = launcher_log(cfg.run_dir if cfg is not None else None)
    with path.open("a") as f:
        f.write(f"rank {os.environ.get('RANK')} lost a peer:\n{traceback.format_exc()}")
    print(f"fsdpkit: rank {os.environ.get('RANK')} stopped: a peer process is gone "
          f"({_first_line(e)}); traceback in {path}", file=sys.stderr, flush=True)
    return 1


# What a collective raises in a rank whose peer died (gloo's TCP pair, NCCL's remote error).
_PEER_GONE = ("Connection closed by peer", "Connection reset by peer", "remote process exited",
              "NCCL communicator was aborted")


def _lost_a_peer(e: BaseException) -> bool:
    return isinstance(e, RuntimeError) and any(s in str(e) for s in _PEER_GONE)


def _first_line(e: BaseException) -> str:
    line = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    return line.split("] ", 1)[-1].split(". ", 1)[0][:160]   # gloo prefixes its source location
