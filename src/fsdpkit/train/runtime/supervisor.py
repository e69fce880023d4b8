"""torchrun under a supervisor that owns the job's signals, its exit code and its lifetime.

    supervisor   `fsdpkit train --nproc N` locally, `fsdpkit-torchrun ...` on a cluster node
      agent      fsdpkit.train.runtime.agent: torch's elastic agent (torchrun's own code), own session;
                 forked from `fsdpkit train`, which imported torch already, else `python -m` it
        workers  python -m fsdpkit.train, one per device

Why not torchrun alone: on SIGTERM torchrun gives its workers 30 s before SIGKILL (far less than an
8B checkpoint takes to write) and exits 1, so an orchestrator cannot tell a preempted run from a
crash; a worker's bad-input error arrives as a page of ChildFailedError; and killing torchrun leaves
its workers (each in its own session) training on unsupervised.

Here the first SIGTERM or SIGINT goes straight to the workers: they agree on a last step, write
a complete checkpoint and exit 0, so the agent neither kills nor restarts them; the supervisor then
exits 143 (128 + SIGTERM). A second signal kills everything. Every process dies with its parent
(PR_SET_PDEATHSIG): the agent with the supervisor, the workers with the agent.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable
from pathlib import Path

from fsdpkit.errors import UserError

SUPERVISED = "FSDPKIT_SUPERVISED"   # set for the agent and workers: a supervisor handles signals
STOP_FILE = "FSDPKIT_STOP_FILE"     # the workers touch it when the run stopped on a signal
EXIT_STOPPED = 128 + signal.SIGTERM
USER_ERROR = "fsdpkit_user_error"   # key of a worker's error file: {"message", "exit_code", "code", "hint",
#                                       USER_ERROR: true}
_PR_SET_PDEATHSIG = 1


def launcher_log(run_dir: str | None) -> Path:
    """RUN_DIR/launcher.log, where what the launcher and its workers say beyond one line goes (the
    agent's logs, torch's failure report, a worker's traceback); a file in the temp dir without one."""
    if run_dir:
        try:
            Path(run_dir).mkdir(parents=True, exist_ok=True)
            return Path(run_dir) / "launcher.log"
        except OSError:
            pass
    return Path(tempfile.gettempdir()) / f"fsdpkit-launcher-{os.getpid()}.log"


def under_torchrun() -> bool:
    """Whether this process is one of torchrun's workers (torch's elastic agent sets these)."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def supervised() -> bool:
    return bool(os.environ.get(SUPERVISED))


def hand_over_error(err: UserError) -> bool:
    """In a worker: give a bad-input error to the agent through torchrun's per-worker error file,
    instead of printing it, so the user sees it once. False when no supervised agent listens."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path or not supervised():
        return False
    Path(path).write_text(json.dumps({"message": str(err), "timestamp": int(time.time()),
                                      "exit_code": err.exit_code, "code": err.code, "hint": err.hint,
                                      USER_ERROR: True}))
    return True


def report_stopped() -> None:
    """In a worker of a supervised run that stopped on a signal (checkpoint written): tell the supervisor."""
    if supervised() and os.environ.get(STOP_FILE):
        Path(os.environ[STOP_FILE]).touch()


def die_with_parent(sig: int = signal.SIGKILL) -> None:
    """Have the kernel send `sig` to this process when its parent exits (Linux; a no-op elsewhere).
    If the parent is already gone, exit now: nothing would stop us later."""
    parent = os.getppid()
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, sig, 0, 0, 0)
    except (OSError, AttributeError):
        return
    if os.getppid() != parent:
        os._exit(1)


def children(pid: int) -> list[int]:
    """Direct children of `pid`, from /proc."""
    out = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            # Field 4 of stat is the parent pid; the command name (field 2) may hold spaces.
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            out.append(int(entry.name))
    return out


def _signal(pids: list[int], sig: int) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):  # it ended meanwhile
            os.kill(pid, sig)


def torchrun_args(nproc: int, max_restarts: int, nnodes: str = "1",
                  rendezvous: tuple[str, str] | None = None) -> list[str]:
    """torchrun's own flags, for every launch fsdpkit makes. Without `rendezvous`, one machine
    (`--standalone`: a rendezvous on a free local port). With it, (endpoint, id): c10d rendezvous
    only, no --master-addr (mixing the two is a classic hang)."""
    where = ["--standalone"] if rendezvous is None else [
        "--rdzv-backend=c10d", f"--rdzv-endpoint={rendezvous[0]}", f"--rdzv-id={rendezvous[1]}"]
    return [f"--nnodes={nnodes}", f"--nproc-per-node={nproc}", *where, f"--max-restarts={max_restarts}"]


class _ForkedAgent:
    """The agent as a fork of this process, for a launcher that already imported torch: the child
    starts with torch loaded (about 1.5 s of CPU a run less than a new interpreter's import), then
    runs exactly what `python -m fsdpkit.train.runtime.agent ARGS` would. Popen's pid, poll and
    wait, for the Supervisor."""

    def __init__(self, start: Callable[[list[str]], int], args: list[str], env: dict[str, str]):
        sys.stdout.flush()
        sys.stderr.flush()
        self.returncode: int | None = None
        self.pid = os.fork()
        if self.pid == 0:
            code = 1
            try:
                os.setsid()   # as start_new_session
                die_with_parent()
                for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT):
                    signal.signal(s, signal.SIG_DFL)   # the supervisor's handlers are not the agent's
                os.environ.clear()
                os.environ.update(env)
                code = start(args)
            except SystemExit as e:   # as the interpreter ends on it: no code is 0
                code = 0 if e.code is None else e.code if isinstance(e.code, int) else 1
            except BaseException:
                traceback.print_exc()
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code)

    def poll(self) -> int | None:
        if self.returncode is None:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self, timeout: float) -> int:
        end = time.monotonic() + timeout
        while (code := self.poll()) is None:
            if time.monotonic() >= end:
                raise subprocess.TimeoutExpired("fsdpkit.train.runtime.agent", timeout)
            time.sleep(0.02)
        return code


class Supervisor:
    """Runs the agent (torchrun's arguments, then the worker's module and flags) and answers signals.
    With `start` (the agent's main, given by a launcher that imported torch) and no Python thread but
    this one (a fork copies only the caller's, and a lock another held would stay held), the agent is
    a fork of this process, as PyTorch's DataLoader forks its workers; otherwise a new interpreter."""

    def __init__(self, torchrun_args: list[str], env: dict[str, str] | None = None,
                 start: Callable[[list[str]], int] | None = None):
        self.args = torchrun_args
        self.env = dict(os.environ if env is None else env)
        self.start = start
        self.proc: subprocess.Popen[bytes] | _ForkedAgent | None = None
        self.stopping = False
        self.told: set[int] = set()   # workers already sent SIGTERM

    def _tell_workers(self) -> None:
        """SIGTERM to every worker not yet told (one started after the request is told too)."""
        if self.proc is not None:
            new = [pid for pid in children(self.proc.pid) if pid not in self.told]
            _signal(new, signal.SIGTERM)
            self.told.update(new)

    def _on_stop(self, signum: int, frame: object) -> None:
        if self.proc is None:
            return
        if self.stopping:  # asked twice: stop now, checkpoint or not
            _signal([*children(self.proc.pid), self.proc.pid], signal.SIGKILL)
            return
        self.stopping = True
        self._tell_workers()

    def _on_kill(self, signum: int, frame: object) -> None:
        if self.proc is not None:
            _signal([*children(self.proc.pid), self.proc.pid], signal.SIGKILL)

    def _wait(self, timeout: float = 0.5) -> int | None:
        assert self.proc is not None  # waited on only once started
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            return None

    def run(self) -> int:
        stop_file = Path(tempfile.mkdtemp(prefix="fsdpkit-")) / "stopped"
        env = {**self.env, SUPERVISED: "1", STOP_FILE: str(stop_file)}
        handlers = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT)}
        signal.signal(signal.SIGTERM, self._on_stop)
        signal.signal(signal.SIGINT, self._on_stop)
        signal.signal(signal.SIGHUP, self._on_kill)
        signal.signal(signal.SIGQUIT, self._on_kill)
        try:
            # Its own session: a terminal's Ctrl-C reaches the supervisor only, which decides.
            if self.start is not None and threading.active_count() == 1:
                self.proc = _ForkedAgent(self.start, self.args, env)
            else:
                self.proc = subprocess.Popen([sys.executable, "-m", "fsdpkit.train.runtime.agent", *self.args],
                                             env=env, start_new_session=True, preexec_fn=die_with_parent)
            while (code := self._wait()) is None:
                if self.stopping:  # the stop came during rendezvous or a restart: tell new workers too
                    self._tell_workers()
        finally:
            for s, h in handlers.items():
                signal.signal(s, h)
            stopped = stop_file.exists()
            stop_file.unlink(missing_ok=True)
            stop_file.parent.rmdir()   # on every way out: nothing of a run is left in /tmp
        if code == 0 and stopped:
            return EXIT_STOPPED
        return code if code >= 0 else 128 - code


def main(argv: list[str] | None = None) -> int:
    """`fsdpkit-torchrun`: torchrun's arguments, supervised (what every cluster node runs)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    return Supervisor(argv).run()


if __name__ == "__main__":
    raise SystemExit(main())
