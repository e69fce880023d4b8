"""The Slurm backend against a real Slurm (tests/slurm_cluster.py: slurmctld and two slurmd nodes on
this machine): `job submit` of a two-node spec runs the rendered sbatch script, whose srun starts one
torchrun per node, and the two form one world and train; status, logs and wait follow Slurm's own
states; cancel stops the run with a checkpoint, and the next submit resumes from it."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from ports import free_port

from fsdpkit.jobs.backends.slurm import script
from fsdpkit.jobs.resolved import load_job

from conftest import ROOT, read_metrics

VENV_BIN = str(Path(sys.executable).parent)


def write_spec(tmp_path, name, **train):
    doc = {"name": name, "backend": "slurm", "nodes": 2, "procs_per_node": 1, "rdzv_port": free_port(),
           "max_restarts": 0, "storage": {"shared_path": str(tmp_path / "shared")},
           "slurm": {"script_dir": str(tmp_path), "output": str(tmp_path / "%x-%j.out")},
           "train": {"seq_len": 64, "validation_freq": 0, "progress": "off", "logging_freq": 5,
                     "tensorboard": False, "max_steps": 300, **train}}
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


def slurm_cli(slurm, *args, timeout=300):
    # The job runs in the submitting environment's Python: this virtual environment, as if activated.
    env = {**os.environ, **slurm.env, "PATH": f"{VENV_BIN}:{os.environ['PATH']}", "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "fsdpkit", *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=timeout)


def state(slurm, name):
    r = slurm_cli(slurm, "job", "status", name, "--backend", "slurm", "--json")
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)["data"]


@pytest.mark.slow
@pytest.mark.torch  # the batch script trains (its command is rendered, out of tests/torch_pass.py's reading)
def test_slurm_two_node_job_trains_and_is_followed_to_its_end(slurm, tmp_path):
    spec = write_spec(tmp_path, "slurm-e2e", max_steps=20)
    r = slurm_cli(slurm, "job", "submit", str(spec), "--json")
    assert r.returncode == 0, r.stderr
    submitted = json.loads(r.stdout)["data"]
    assert submitted["submitted"] is True and submitted["job_id"]
    assert state(slurm, "slurm-e2e")["state"] in ("Pending", "Created", "Running", "Succeeded")
    logs = slurm_cli(slurm, "job", "logs", "slurm-e2e", "--backend", "slurm", "-f")  # follows to the end
    assert logs.returncode == 0, logs.stderr
    r = slurm_cli(slurm, "job", "wait", "slurm-e2e", "--backend", "slurm", "--poll", "0.5", "--json")
    assert r.returncode == 0, r.stderr
    final = json.loads(r.stdout)["data"]
    assert final["state"] == "Succeeded" and final["details"]["job_id"] == submitted["job_id"]
    # One world of two nodes: rank 0's record, and node 1's own step lines in the job's output.
    run = tmp_path / "shared" / "slurm-e2e" / "run"
    assert read_metrics(run, "start")[0]["world_size"] == 2
    assert [m["step"] for m in read_metrics(run)] == [5, 10, 15, 20]
    assert "Batch 20 Loss: " in logs.stdout and "node 1" in logs.stdout
    listed = slurm_cli(slurm, "job", "list", "--backend", "slurm", "--json")
    assert "slurm-e2e" in [j["name"] for j in json.loads(listed.stdout)["data"]["jobs"]]


@pytest.mark.slow
@pytest.mark.torch  # as above
def test_slurm_cancel_stops_with_a_checkpoint_and_the_next_submit_resumes(slurm, tmp_path):
    spec = write_spec(tmp_path, "slurm-resume", max_steps=100000, checkpoint_freq=20)
    assert slurm_cli(slurm, "job", "submit", str(spec)).returncode == 0
    ckpts = tmp_path / "shared" / "slurm-resume" / "checkpoints"
    deadline = time.monotonic() + 240
    while not any(ckpts.glob("step-*")):
        assert time.monotonic() < deadline, state(slurm, "slurm-resume")
        time.sleep(0.5)
    assert state(slurm, "slurm-resume")["state"] == "Running"
    r = slurm_cli(slurm, "job", "delete", "slurm-resume", "--backend", "slurm")
    assert r.returncode == 0, r.stderr
    deadline = time.monotonic() + 120
    while (st := state(slurm, "slurm-resume"))["state"] not in ("Cancelled", "Failed", "Succeeded"):
        assert time.monotonic() < deadline, st
        time.sleep(0.5)
    assert st["state"] == "Cancelled"
    # Slurm's SIGTERM reached the trainer: it saved where it stopped, and nothing trains any more.
    saved = max(int(p.name.split("-")[1]) for p in ckpts.glob("step-*") if p.name.split("-")[1].isdigit())
    assert not [ln for ln in subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True).stdout.splitlines()
                if "fsdpkit.train" in ln and "slurm-resume" in ln]
    r = slurm_cli(slurm, "job", "submit", str(spec), "--replace", "--set", f"train.max_steps={saved + 10}")
    assert r.returncode == 0, r.stderr
    r = slurm_cli(slurm, "job", "wait", "slurm-resume", "--backend", "slurm", "--poll", "0.5")
    assert r.returncode == 0, r.stderr
    starts = read_metrics(tmp_path / "shared" / "slurm-resume" / "run", "start")
    assert starts[-1]["step"] == saved and read_metrics(tmp_path / "shared" / "slurm-resume" / "run")[-1]["step"] \
        == saved + 10


def test_slurm_script_uses_pyxis_only_with_an_image(tmp_path):
    """No image: the nodes run the submitting environment's fsdpkit-torchrun, with no pyxis flag a
    Slurm without pyxis would reject. An image: srun runs it through pyxis with the storage mounted."""
    base = [("name", "pyxis"), ("backend", "slurm"), ("nodes", 2), ("storage", {"shared_path": "/fsx"})]
    bare = script(load_job(None, base))
    assert "--container" not in bare and "srun --kill-on-bad-exit=1 fsdpkit-torchrun" in bare
    boxed = script(load_job(None, [*base, ("slurm", {"container_image": "nvcr.io#nvidia/pytorch:25.01-py3"})]))
    assert "--container-image='nvcr.io#nvidia/pytorch:25.01-py3'" in boxed and "--container-mounts=/fsx:/fsx" in boxed


@pytest.mark.skipif(shutil.which("sbatch") is None, reason="sbatch is not installed here")
def test_slurm_submit_that_sbatch_refuses_is_one_line(tmp_path):
    """sbatch's own complaint (several lines) becomes fsdpkit's one line: here, a broken slurm.conf."""
    conf = tmp_path / "slurm.conf"
    conf.write_text("SlurmctldHost=nowhere\n")
    r = subprocess.run([sys.executable, "-m", "fsdpkit", "job", "submit", str(write_spec(tmp_path, "nowhere"))],
                       cwd=ROOT, env={**os.environ, "SLURM_CONF": str(conf)}, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: sbatch refused "), r.stderr


def test_slurm_submit_that_reaches_no_controller_is_exit_3_and_leaves_no_script(slurm, tmp_path):
    """The cluster's side, not the input: a controller nobody answers for (the session's Slurm, its
    port changed) is exit 3, `unreachable`, and the script this submit wrote is gone again."""
    conf = slurm.unreachable_conf(tmp_path / "slurm.conf")
    spec = write_spec(tmp_path, "lonely")
    r = subprocess.run([sys.executable, "-m", "fsdpkit", "job", "submit", str(spec), "--json"], cwd=ROOT,
                       env={**os.environ, **slurm.env, "SLURM_CONF": str(conf)}, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 3, r.stdout + r.stderr
    error = json.loads(r.stdout)["error"]
    assert error["code"] == "unreachable" and error["message"].startswith(
        "sbatch could not reach the Slurm controller (sbatch: error: ") and "SLURM_CONF" in error["message"]
    assert not (tmp_path / "lonely.sbatch").exists()
