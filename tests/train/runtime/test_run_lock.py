"""The checkpoint directory's lock on its own: who takes it, what a second run is told, and that
a run that never started leaves no folder behind (the whole-run behaviour, kill -9 included, is in
test_checkpoint.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from fsdpkit.train.runtime import run_lock

SECOND = ("import sys; from fsdpkit.train.runtime import run_lock\n"
          "try:\n    run_lock.hold(sys.argv[1])\nexcept Exception as e:\n"
          "    print(type(e).__name__, e)\n")


def test_one_holder_and_a_second_process_is_told_who(tmp_path, monkeypatch):
    monkeypatch.delenv(run_lock.HELD_ENV, raising=False)
    monkeypatch.delenv("RANK", raising=False)
    ckpt = tmp_path / "ckpt"
    lock = run_lock.hold(str(ckpt))
    env = {k: v for k, v in os.environ.items() if k not in (run_lock.HELD_ENV, "RANK")}
    r = subprocess.run([sys.executable, "-c", SECOND, str(ckpt)], capture_output=True, text=True, env=env)
    assert r.stdout == (f"Conflict checkpoint_dir: {ckpt} is in use by another run (its holder is still starting); "
                        "wait for it to end, or pass another --checkpoint-dir\n")
    lock.claim(tmp_path / "run")   # its checks passed: the file names it
    holder = json.loads((ckpt / run_lock.LOCK_NAME).read_text())
    assert holder["pid"] == os.getpid() and holder["run_dir"] == str(tmp_path / "run")
    r = subprocess.run([sys.executable, "-c", SECOND, str(ckpt)], capture_output=True, text=True, env=env)
    assert r.stdout.startswith(f"Conflict checkpoint_dir: {ckpt} is in use by another run (pid {os.getpid()} on ")
    lock.release()
    r = subprocess.run([sys.executable, "-c", SECOND, str(ckpt)], capture_output=True, text=True, env=env)
    assert r.stdout == "" and r.returncode == 0  # free again: the second process took it and exited


def test_workers_of_a_holding_launcher_and_other_ranks_take_nothing(tmp_path, monkeypatch):
    monkeypatch.setenv(run_lock.HELD_ENV, "1")
    run_lock.hold(str(tmp_path / "a"))
    monkeypatch.delenv(run_lock.HELD_ENV)
    monkeypatch.setenv("RANK", "1")
    run_lock.hold(str(tmp_path / "b"))
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


def test_a_run_that_never_started_leaves_nothing_changed(tmp_path, monkeypatch):
    """The launcher takes the lock before checking its inputs; when they are refused, a checkpoint
    directory or lock file the lock created goes again, and a lock file that was there keeps its
    bytes and time: it names the last run that started."""
    monkeypatch.delenv(run_lock.HELD_ENV, raising=False)
    monkeypatch.delenv("RANK", raising=False)
    new, existing, used = tmp_path / "new" / "ckpt", tmp_path / "existing", tmp_path / "used"
    existing.mkdir()
    (existing / "step-00000001").mkdir()
    used.mkdir()
    (used / run_lock.LOCK_NAME).write_text('{"pid": 1, "run_dir": "runs/a"}\n')
    os.utime(used / run_lock.LOCK_NAME, ns=(10**18, 10**18))
    for path in (new, existing, used):
        run_lock.hold(str(path)).release(undo=True)
    assert not (tmp_path / "new").exists()  # every folder hold() made goes
    assert [p.name for p in existing.iterdir()] == ["step-00000001"]
    assert (used / run_lock.LOCK_NAME).read_text() == '{"pid": 1, "run_dir": "runs/a"}\n'
    assert (used / run_lock.LOCK_NAME).stat().st_mtime_ns == 10**18
