"""The supervisor's agent (fsdpkit.train.runtime.supervisor): a fork of a launcher that imported torch
(no second import of it), run in its own session with the environment it was given and default
signal handlers; a new interpreter where a Python thread besides the caller's runs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading

import pytest

from fsdpkit.train.runtime.supervisor import Supervisor

OUT = "FSDPKIT_TEST_AGENT_OUT"
# A launcher of its own (a test process has threads of its own: pytest-xdist's): its Supervisor
# runs `agent` (says where and how it runs, ends with the code its last argument names) or
# `broken`, then the launcher says how it ended.
LAUNCHER = f"""
import json, os, signal, sys
from pathlib import Path
from fsdpkit.train.runtime.supervisor import SUPERVISED, Supervisor

def agent(args):
    Path(os.environ["{OUT}"]).write_text(json.dumps({{
        "args": args, "pid": os.getpid(), "ppid": os.getppid(), "session": os.getsid(0),
        "supervised": os.environ.get(SUPERVISED), "sigterm": signal.getsignal(signal.SIGTERM) == signal.SIG_DFL,
        "imported": "fsdpkit.train.runtime.supervisor" in sys.modules}}))
    return int(args[-1])

def broken(args):
    raise RuntimeError("agent broke")

before = signal.getsignal(signal.SIGTERM)
code = Supervisor(sys.argv[2:], dict(os.environ), start=agent if sys.argv[1] == "agent" else broken).run()
print(json.dumps({{"code": code, "pid": os.getpid(), "session": os.getsid(0),
                  "restored": signal.getsignal(signal.SIGTERM) == before}}))
"""


def launch(tmp_path, *argv: str) -> tuple[dict, subprocess.CompletedProcess]:
    r = subprocess.run([sys.executable, "-c", LAUNCHER, *argv], env={**os.environ, OUT: str(tmp_path / "agent.json")},
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout), r


def test_the_agent_of_a_launcher_is_a_fork_in_a_session_of_its_own_with_its_environment(tmp_path):
    launcher, _ = launch(tmp_path, "agent", "--nproc-per-node=2", "7")
    seen = json.loads((tmp_path / "agent.json").read_text())
    assert launcher["code"] == 7
    # A fork (what the launcher imported is there), its child, leading a session of its own.
    assert seen["imported"] and seen["ppid"] == launcher["pid"] != seen["pid"]
    assert seen["session"] == seen["pid"] != launcher["session"]
    assert seen["args"] == ["--nproc-per-node=2", "7"] and seen["supervised"] == "1" and seen["sigterm"]
    # The supervisor's own handlers (the agent's were reset in it) are back as they were.
    assert launcher["restored"]


def test_an_agent_that_raises_ends_with_exit_1_and_says_why(tmp_path):
    launcher, r = launch(tmp_path, "broken", "x")
    assert launcher["code"] == 1 and "RuntimeError: agent broke" in r.stderr


def test_with_another_python_thread_running_the_agent_is_a_new_interpreter(tmp_path):
    """A fork copies only the calling thread; a lock another held would stay held in the child. The
    new interpreter runs the real agent module, which refuses arguments torchrun's parser does not
    take (exit 2), as `python -m fsdpkit.train.runtime.agent` does."""
    out = tmp_path / "agent.json"
    stop = threading.Event()
    other = threading.Thread(target=stop.wait)
    other.start()
    try:
        code = Supervisor(["--no-such-torchrun-flag"], {**os.environ, OUT: str(out)},
                          start=lambda args: out.write_text("forked") and 0).run()
    finally:
        stop.set()
        other.join()
    assert code == 2 and not out.exists()


@pytest.mark.torch   # torch's own parser: the program's path is no constant the marker's reading sees
def test_fsdpkit_torchrun_s_help_names_it():
    """torchrun's own parser, under the command's name (its module's name, agent.py, before)."""
    r = subprocess.run([os.path.join(os.path.dirname(sys.executable), "fsdpkit-torchrun"), "--help"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.startswith("usage: fsdpkit-torchrun [-h] [--nnodes NNODES]"), r.stdout[:300]
