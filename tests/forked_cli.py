"""`fsdpkit` commands, each in a process of its own forked from one that imported what the command
needs once: torch and the training program for the verbs that train (train, export, eval, ...), the
CLI with its Kubernetes and AWS clients and no torch for the others.

A command in a new interpreter spends about 2.4 s of CPU importing torch and the trainer, or 0.5 s
importing the CLI and its clients, before it reads its first option; the suite runs some hundreds
of each. Here each command is still a real process with its own exit code, standard streams,
working folder and environment, started from an interpreter whose only history is those imports
(no tensor made, no client configured, no thread of its own started: forked as PyTorch's
DataLoader forks its workers). What a command starts (torchrun's agent, the ranks, kubectl) starts
as ever, from `sys.executable` or its own program. A test asserting how a command *starts* (what it
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

from fsdpkit.cli.main import VERBS

import torch_pass

# The forking process: imports once (IMPORTS, named per kind of command below), then per request (a
# JSON line: argv, env, cwd, and the files for the standard streams) forks a child that runs the
# command as `python -m fsdpkit` would, and answers the child's pid, then its exit code.
ZYGOTE = r"""
import atexit, json, os, sys, traceback
import fsdpkit.cli.main
for name in IMPORTS:
    __import__(name)

def run(req):
    os.chdir(req["cwd"])
    os.environ.clear()
    os.environ.update(req["env"])
    if "OMP_NUM_THREADS" in req["env"] and "torch" in sys.modules:   # OpenMP read it when torch loaded
        sys.modules["torch"].set_num_threads(int(req["env"]["OMP_NUM_THREADS"]))
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
    """One forking process per test process (an xdist worker) and kind of command, started on first
    use, that imported `imports`."""

    def __init__(self, imports: list[str]) -> None:
        self.imports = imports
        self.lock = threading.Lock()
        self.proc: subprocess.Popen | None = None
        self.env: dict[str, str] = {}

    def _started(self) -> subprocess.Popen:
        if self.proc is None or self.proc.poll() is not None:
            self.env = dict(os.environ)
            code = f"IMPORTS = {self.imports!r}\n{ZYGOTE}"
            self.proc = subprocess.Popen([sys.executable, "-u", "-c", code], stdin=subprocess.PIPE,
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
                raise RuntimeError(f"the forking process of {self.imports} (tests/forked_cli.py) is gone")
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


# The training verbs' (tests/torch_pass.py: TORCH_VERBS), and every other verb's: those import no torch,
# and a test may hold them to that. A `job submit` of a local job imports torch after the fork, as a
# command of its own would.
TORCH = _Zygote(["torch", "fsdpkit.train.launch", "fsdpkit.train.trainer"])
CLIENTS = _Zygote([*(module.partition(":")[0] for verb, (module, _) in VERBS.items()
                     if verb not in torch_pass.TORCH_VERBS), "kubernetes.client", "boto3"])


def run(argv: list[str], env: dict[str, str], cwd: Path, stdin: str,
        timeout: float) -> subprocess.CompletedProcess | None:
    """The command forked from its kind's process, or None where that cannot be (see _Zygote.run)."""
    return (TORCH if argv and argv[0] in torch_pass.TORCH_VERBS else CLIENTS).run(argv, env, cwd, stdin, timeout)


def close() -> None:
    for zygote in (TORCH, CLIENTS):
        zygote.close()
