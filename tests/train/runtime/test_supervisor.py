"""The supervisor's agent (fsdpkit.train.runtime.supervisor): a fork of a launcher that imported torch
(no second import of it), run in its own session with the environment it was given and default
signal handlers; a new interpreter where a Python thread besides the caller's runs."""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
from pathlib import Path

from fsdpkit.train.runtime.supervisor import SUPERVISED, Supervisor

OUT = "FSDPKIT_TEST_AGENT_OUT"


def agent(args: list[str]) -> int:
    """Stands for the agent's main: says where and how it runs, ends with the code its args name."""
    Path(os.environ[OUT]).write_text(json.dumps({
        "args": args, "pid": os.getpid(), "ppid": os.getppid(), "session": os.getsid(0),
        "supervised": os.environ.get(SUPERVISED), "sigterm": signal.getsignal(signal.SIGTERM) == signal.SIG_DFL,
        "modules": "fsdpkit.train.runtime.supervisor" in sys.modules}))
    return int(args[-1])


def test_the_agent_of_a_launcher_is_a_fork_in_a_session_of_its_own_with_its_environment(tmp_path):
    out = tmp_path / "agent.json"
    before = signal.getsignal(signal.SIGTERM)
    code = Supervisor(["--nproc-per-node=2", "7"], {**os.environ, OUT: str(out)}, start=agent).run()
    seen = json.loads(out.read_text())
    assert code == 7
    # A fork (what this process imported is there), its child, leading a session of its own.
    assert seen["modules"] and seen["ppid"] == os.getpid() and seen["pid"] != os.getpid()
    assert seen["session"] == seen["pid"] != os.getsid(0)
    assert seen["args"] == ["--nproc-per-node=2", "7"] and seen["supervised"] == "1" and seen["sigterm"]
    # The supervisor's own handlers (the agent's were reset in it) are back as they were.
    assert signal.getsignal(signal.SIGTERM) == before


def test_an_agent_that_raises_ends_with_exit_1_and_says_why(tmp_path, capfd):
    def broken(args: list[str]) -> int:
        raise RuntimeError("agent broke")

    assert Supervisor(["x"], dict(os.environ), start=broken).run() == 1
    assert "RuntimeError: agent broke" in capfd.readouterr().err


def test_with_another_python_thread_running_the_agent_is_a_new_interpreter(tmp_path):
    """A fork copies only the calling thread; a lock another held would stay held in the child. The
    new interpreter runs the real agent module, which refuses arguments torchrun's parser does not
    take (exit 2), as `python -m fsdpkit.train.runtime.agent` does."""
    out = tmp_path / "agent.json"
    stop = threading.Event()
    other = threading.Thread(target=stop.wait)
    other.start()
    try:
        code = Supervisor(["--no-such-torchrun-flag"], {**os.environ, OUT: str(out)}, start=agent).run()
    finally:
        stop.set()
        other.join()
    assert code == 2 and not out.exists()
