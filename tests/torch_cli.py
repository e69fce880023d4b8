"""`fsdpkit` commands that import torch (train, export, eval, ...), each in a process of its own forked
from one that imported torch and the training program once.

A command in a new interpreter spends about 2.4 s of CPU importing torch and the trainer before it
reads its first option; the suite runs some hundreds of them. Here each command is still a real
process with its own exit code, standard streams, working folder and environment, started from
an interpreter whose only history is those imports (no tensor made, no thread of its own started:
forked as PyTorch's DataLoader forks its workers). What a command starts (torchrun's agent, the
ranks) starts as ever, from `sys.executable`. A test asserting how a command *starts* (what it
imports, its command line, a signal to the process) uses subprocess itself.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

# The forking process: imports once, then per request (a JSON line: argv, env, cwd, and the files for
# the standard streams) forks a child that runs the command as `python -m fsdpkit` would, and
# answers the child's pid, then its exit code.
ZYGOTE = r"""
import atexit, json, os, sys, traceback
import torch
import fsdpkit.cli.main, fsdpkit.train.launch, fsdpkit.train.trainer

def run(req):
    os.chdir(req["cwd"])
    os.environ.clear()
    os.environ.update(req["env"])
    if "OMP_NUM_THREADS" in req["env"]:   # OpenMP read the forking process's value when torch loaded
        torch.set_num_threads(int(req["env"]["OMP_NUM_THREADS"]))
    for fd, path, mode in ((0, req["stdin"], os.O_RDONLY), (1, req["stdout"], os.O_WRONLY),
                           (2, req["stderr"], os.O_WRONLY)):
        os.dup2(os.open(path, mode), fd)
    sys.argv = [fsdpkit.cli.main.__file__, *req["argv"]]
    try:
        code = fsdpkit.cli.main.main(req["argv"])
    except SystemExit as e:   # as the interpreter ends on it
        if e.code is None or isinstance(e.code, int):
            code = e.code or 0
        else:
            print(e.code, file=sys.stderr)
            code = 1
    except BaseException:
        traceback.print_exc()
        code = 1
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    return code

for line in sys.stdin:
    req = json.loads(line)
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            code = run(req)
        finally:
            os._exit(code if isinstance(code, int) else 1)
    print(pid, flush=True)
    print(os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]), flush=True)
"""


# Variables torch, OpenMP, glibc or the interpreter read once, when the forking process started: a
# command whose environment sets one otherwise runs as a plain process.
READ_AT_START = ("TORCH", "PYTORCH", "PYTHON", "MKL_", "KMP_", "OMP_", "GOMP_", "LD_", "MALLOC_", "CUDA", "OPENBLAS")
# Set per command, after the fork: the streams' buffering (the forking process runs unbuffered) and
# the OpenMP threads (torch.set_num_threads).
SET_PER_COMMAND = frozenset({"PYTHONUNBUFFERED", "OMP_NUM_THREADS"})


class _Zygote:
    """One forking process per test process (an xdist worker), started on first use."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.proc: subprocess.Popen | None = None
        self.env: dict[str, str] = {}

    def _started(self) -> subprocess.Popen:
        if self.proc is None or self.proc.poll() is not None:
            self.env = dict(os.environ)
            self.proc = subprocess.Popen([sys.executable, "-u", "-c", ZYGOTE], stdin=subprocess.PIPE,
                                         stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=self.env)
        return self.proc

    def fits(self, env: dict[str, str]) -> bool:
        """Whether a command's environment agrees with the forking process's (or, before it starts,
        this process's) on what was read at its start."""
        started = self.env if self.proc is not None and self.proc.poll() is None else dict(os.environ)
        keys = {k for k in {*env, *started} if k.startswith(READ_AT_START) and k not in SET_PER_COMMAND}
        return all(env.get(k) == started.get(k) for k in keys)

    def run(self, argv: list[str], env: dict[str, str], cwd: Path, stdin: str,
            timeout: float) -> subprocess.CompletedProcess | None:
        """The command's outcome, or None when the forking process is busy (a test running commands
        side by side: the caller starts this one as a plain process)."""
        if not self.lock.acquire(blocking=False):
            return None
        try:
            return self._run(argv, env, cwd, stdin, timeout) if self.fits(env) else None
        finally:
            self.lock.release()

    def _run(self, argv, env, cwd, stdin, timeout):
        proc = self._started()
        with tempfile.TemporaryDirectory(prefix="fsdpkit-cli-") as tmp:
            files = {name: Path(tmp) / name for name in ("stdin", "stdout", "stderr")}
            files["stdin"].write_text(stdin)
            files["stdout"].touch()
            files["stderr"].touch()
            assert proc.stdin is not None and proc.stdout is not None
            proc.stdin.write(json.dumps({"argv": argv, "env": env, "cwd": str(cwd),
                                         **{k: str(v) for k, v in files.items()}}) + "\n")
            proc.stdin.flush()
            line = proc.stdout.readline()
            if not line:
                raise RuntimeError("the forking process for torch commands (tests/torch_cli.py) is gone")
            pid = int(line)
            answer: list[str] = []
            reader = threading.Thread(target=lambda: answer.append(proc.stdout.readline()), daemon=True)
            reader.start()
            reader.join(timeout)
            timed_out = reader.is_alive()
            if timed_out:
                os.kill(pid, 9)
                reader.join(30)
            out, err = files["stdout"].read_text(errors="replace"), files["stderr"].read_text(errors="replace")
        if timed_out:
            raise subprocess.TimeoutExpired(["fsdpkit", *argv], timeout, out, err)
        return subprocess.CompletedProcess(["fsdpkit", *argv], int(answer[0]), out, err)

    def close(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            assert self.proc.stdin is not None
            self.proc.stdin.close()
            self.proc.wait(30)


ZYGOTE_PROCESS = _Zygote()
