"""`python -m fsdpkit.train.runtime.agent [torchrun arguments]`: torch's elastic agent, run by the supervisor
(fsdpkit.train.runtime.supervisor). It is torchrun's own code (rendezvous, restarts, worker monitoring);
what differs is the ending. A worker's bad-input error reaches the user as its one line and exit
code; any other failure as one line that names the rank, how it ended and where the details are;
the agent's logs and the full ChildFailedError report go to RUN_DIR/launcher.log, not the terminal.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
from pathlib import Path
from typing import cast

from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure
from torch.distributed.run import get_args_parser, run

from fsdpkit.envelope import emit_error
from fsdpkit.errors import UserError
from fsdpkit.train.runtime.supervisor import SUPERVISED, USER_ERROR, launcher_log


def _log_file(worker_args: list[str]) -> Path:
    """The launcher's log, in the run directory the workers are given (--run-dir)."""
    run_dir = None
    for i, a in enumerate(worker_args):
        name, eq, value = a.partition("=")
        if name in ("--run-dir", "--run_dir"):
            run_dir = value if eq else worker_args[i + 1] if i + 1 < len(worker_args) else None
    return launcher_log(run_dir)


def _quiet_agent_logs(path: Path) -> None:
    """torch's elastic agent logs rendezvous, restarts and failures to stderr: into the log file."""
    handler = logging.FileHandler(path)
    handler.setFormatter(logging.Formatter("%(asctime)s %(name)s %(levelname)s %(message)s"))
    for name in ("torch.distributed.elastic", "torch.distributed.run", "torch.distributed.launcher"):
        log = logging.getLogger(name)
        log.handlers[:] = [handler]
        log.propagate = False


def _describe(rank: int, f: ProcessFailure) -> str:
    if f.exitcode < 0:
        name = f.signal_name()
        why = " (out of memory?)" if name == "SIGKILL" else ""
        return f"training process rank {rank} was killed by {name}{why}"
    return f"training process rank {rank} failed with exit code {f.exitcode}: {str(f.message).splitlines()[0]}"


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = get_args_parser()
    parser.prog = "fsdpkit-torchrun"   # run as `python -m` this module, argparse would name agent.py
    args = parser.parse_args(argv)
    worker_args = list(args.training_script_args)
    as_json = "--json" in worker_args
    if os.environ.get(SUPERVISED):
        # The supervisor owns SIGTERM and SIGINT (it sends them to the workers itself); torch's agent
        # would answer them by killing the workers 30 s later. Older torch ignores this setting.
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        if hasattr(args, "signals_to_handle"):
            args.signals_to_handle = "SIGHUP,SIGQUIT"
    log_path = _log_file(worker_args)
    _quiet_agent_logs(log_path)
    try:
        run(args)
        return 0
    except ChildFailedError as e:
        with log_path.open("a") as f:
            f.write(str(e) + "\n")
        rank, failure = e.get_first_failure()
        data = failure.error_file_data if isinstance(failure.error_file_data, dict) else {}
        if data.get(USER_ERROR):
            emit_error(UserError(str(data["message"]), data.get("hint"), data.get("code")), as_json)
            return int(data.get("exit_code", 2))
        emit_error(UserError(f"{_describe(rank, failure)}; details in {log_path}", code="failed"), as_json)
        return cast("int", failure.exitcode if failure.exitcode > 0 else 128 - failure.exitcode)
    except SignalException as e:
        return 128 + int(e.sigval)


if __name__ == "__main__":
    raise SystemExit(main())
