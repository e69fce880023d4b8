"""The single-machine path of a JobSpec: `fsdpkit job submit` with the local backend starts real
torchrun training in the background; status, logs, wait, list, duplicates and resubmission."""

from __future__ import annotations

import json
import re
import time

import pytest
import yaml

from fsdpkit.train.checkpoint.catalog import list_checkpoints

from conftest import losses, processes_naming, run_cli

pytestmark = pytest.mark.slow
TOKEN = "hf_local_s3cr3t_never_written"


def local_spec(tmp_path, name="tiny-local", **extra):
    doc = {"name": name, "backend": "local", "procs_per_node": 2,
           "train": {"max_steps": 30, "seq_len": 64, "validation_freq": 0, "progress": "off", "logging_freq": 5,
                     "checkpoint_freq": 10},
           **extra}
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


def test_local_submit_trains_two_processes_and_finishes(tmp_path):
    env = {"FSDPKIT_HOME": str(tmp_path / "home"), "MY_HF_TOKEN": TOKEN}
    spec = local_spec(tmp_path, hf_token_env="MY_HF_TOKEN")
    r = run_cli("job", "submit", str(spec), "--json", env=env)
    printed = r.stdout + r.stderr
    assert r.returncode == 0, r.stderr
    job_dir = tmp_path / "home" / "jobs" / "tiny-local"
    assert json.loads(r.stdout)["data"]["dir"] == str(job_dir)
    r = run_cli("job", "wait", "tiny-local", "--poll", "0.5", env=env, timeout=300)
    assert r.returncode == 0, (r.stdout, (job_dir / "log").read_text()[-3000:])
    assert "Succeeded" in r.stdout
    run_dir = job_dir / "run"
    got = losses(run_dir)
    assert len(got) == 6 and got[-1] < got[0]
    # The checkpoints, and the lock the run held on their directory (fsdpkit.train.runtime.run_lock).
    assert sorted(p.name for p in (job_dir / "checkpoints").iterdir()) == [
        ".fsdpkit.lock", *(f"step-000000{n}0" for n in (1, 2, 3))]
    assert re.search(r"params\), 2 x ", (job_dir / "log").read_text())  # two ranks trained

    r = run_cli("job", "logs", "tiny-local", env=env)
    assert r.returncode == 0 and "Loss" in r.stdout
    printed += r.stdout + r.stderr + run_cli("job", "status", "tiny-local", "--json", env=env).stdout
    # The token reached the trainer only through its environment: in no file of the job, nothing printed.
    assert TOKEN not in printed
    assert not [p for p in job_dir.rglob("*") if p.is_file() and TOKEN.encode() in p.read_bytes()]
    r = run_cli("job", "list", "--backend", "local", "--json", env=env)
    assert [(j["name"], j["state"]) for j in json.loads(r.stdout)["data"]["jobs"]] == [("tiny-local", "Succeeded")]

    # The same name again is refused; --replace resumes from its checkpoints (nothing to do at step 30).
    r = run_cli("job", "submit", str(spec), env=env)
    assert (r.returncode, r.stdout) == (2, "") and r.stderr.splitlines() == [
        f"error: job 'tiny-local' already exists (Succeeded) in {job_dir}; pick another name, or pass --replace to "
        "start it again (its checkpoints are kept and resumed)"]   # one line, nothing before it
    r = run_cli("job", "submit", str(spec), "--replace", "--wait", "--poll", "0.5", env=env, timeout=300)
    assert r.returncode == 0, (job_dir / "log").read_text()[-3000:]
    assert "resum" in (job_dir / "log").read_text().lower()


def test_local_failed_job_is_resubmitted_and_resumes(tmp_path):
    """Rank 1 is SIGKILLed at step 15 with no torchrun restarts left: the job fails, and the
    resubmission (budget 1) resumes from step 10 and finishes."""
    env = {"FSDPKIT_HOME": str(tmp_path / "home")}
    spec = local_spec(tmp_path, name="flaky", max_restarts=0, resubmits=1,
                      env={"FSDPKIT_FAULT": "kill:step=15:rank=1"})
    assert run_cli("job", "submit", str(spec), env=env).returncode == 0
    r = run_cli("job", "wait", "flaky", "--poll", "0.5", env=env, timeout=400)
    log = (tmp_path / "home" / "jobs" / "flaky" / "log").read_text()
    assert r.returncode == 0, (r.stdout, r.stderr, log[-3000:])
    assert "resubmitting, attempt 1 of 1" in r.stderr
    assert "Succeeded, resubmission 1" in r.stdout
    steps = [json.loads(line)["step"] for line in
             (tmp_path / "home" / "jobs" / "flaky" / "run" / "metrics.jsonl").read_text().splitlines()
             if json.loads(line)["kind"] == "train"]
    assert steps[-1] == 30


def test_deleting_a_running_local_job_stops_every_rank(tmp_path):
    env = {"FSDPKIT_HOME": str(tmp_path / "home")}
    spec = local_spec(tmp_path, name="to-cancel", train={"max_steps": 100000, "seq_len": 64, "validation_freq": 0,
                                                           "progress": "off", "logging_freq": 1})
    assert run_cli("job", "submit", str(spec), env=env).returncode == 0
    job_dir = tmp_path / "home" / "jobs" / "to-cancel"
    deadline = time.monotonic() + 120
    while "Loss" not in (job_dir / "log").read_text() and time.monotonic() < deadline:
        time.sleep(0.5)
    assert len(processes_naming(job_dir)) >= 3  # launcher, torchrun's agent, two ranks
    r = run_cli("job", "delete", "to-cancel", "--yes", env=env)  # the job API's cancel verb
    assert r.returncode == 0, r.stderr
    # It returns once every rank has stopped, having saved where it was; the job leaves the list
    # (as a deleted cluster job does) and what it made stays, for a new submit to resume.
    assert not processes_naming(job_dir)
    log = (job_dir / "log").read_text()
    stopped = int(re.search(r"fsdpkit: stopping at step (\d+) on SIGTERM", log).group(1))
    assert [c.step for c in list_checkpoints(job_dir / "checkpoints")][-1] == stopped
    r = run_cli("job", "list", "--backend", "local", "--json", env=env)
    assert r.returncode == 0 and json.loads(r.stdout)["data"]["jobs"] == []
    r = run_cli("job", "status", "to-cancel", "--json", env=env)
    assert r.returncode == 2 and json.loads(r.stdout)["error"]["code"] == "not_found"

