"""Experiment trackers: a two-rank CPU run, one rank SIGKILLed mid-run and the run restarted by
torchrun from its checkpoint, logs to W&B (offline: its transaction log read back with W&B's own
protobuf records) and MLflow (a local file store read with MlflowClient) as one run per tracker:
the same metrics as metrics.jsonl, the resolved config, a marker at each start, from rank 0 only,
and no API key anywhere."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from fsdpkit.errors import UserError
from fsdpkit.train.observe.trackers import open_trackers

from conftest import FAST, read_metrics, run_cli

pytestmark = pytest.mark.slow

SECRET = "wandb-key-0123456789abcdef0123456789abcdef"


def wandb_records(path: Path) -> list:
    """The records of a W&B transaction log (`run-ID.wandb`): a 7-byte header (":W&B", magic,
    version), then LevelDB-log blocks of 32 KiB whose records (CRC, length, type) carry protobufs."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = path.read_bytes()
    assert data[:4] == b":W&B"
    pos, block, pending, out = 7, 32768, b"", []
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        length, kind = int.from_bytes(data[pos + 4:pos + 6], "little"), data[pos + 6]
        if kind == 0:
            break
        pending += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # FULL or LAST
            record = pb.Record()
            record.ParseFromString(pending)
            out.append(record)
            pending = b""
    return out


def wandb_history(path: Path) -> tuple[str, list[dict], dict]:
    """(run id, history rows, config) of one offline run."""
    run_id, rows, config = "", [], {}
    for r in wandb_records(path):
        kind = r.WhichOneof("record_type")
        if kind == "run":
            run_id = r.run.run_id
        elif kind == "history":
            rows.append({i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in r.history.item})
        elif kind == "config":
            config.update({u.key: json.loads(u.value_json) for u in r.config.update})
    return run_id, rows, config


@pytest.fixture(scope="module")
def tracked(tmp_path_factory):
    root = tmp_path_factory.mktemp("trackers")
    run_dir = root / "run"
    env = {"FSDPKIT_FAULT": "kill:step=5:rank=1", "WANDB_MODE": "offline", "WANDB_API_KEY": SECRET,
           "MLFLOW_TRACKING_URI": f"file:{root / 'mlruns'}"}  # a file store, allowed because named
    r = run_cli("train", *FAST, "--max_steps", "8", "--logging_freq", "2", "--tensorboard", "0",
                "--train_batch_size", "4", "--nproc", "2", "--max_restarts", "1", "--run_dir", str(run_dir),
                "--checkpoint_dir", str(root / "ckpt"), "--checkpoint_every", "4", "--tracker", "wandb,mlflow",
                "--tracker_project", "tiny", env=env)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    assert "resumed from" in r.stdout
    return root, run_dir, r


def test_wandb_logs_the_killed_and_resumed_run_as_one(tracked):
    _, run_dir, _ = tracked
    ids = json.loads((run_dir / "trackers.json").read_text())
    logs = sorted((run_dir / "wandb").glob("offline-run-*/run-*.wandb"))
    # One offline log per attempt (rank 1 logged nothing), both of the one run.
    assert len(logs) == 2 and all(p.name == f"run-{ids['wandb']['id']}.wandb" for p in logs)
    rows = read_metrics(run_dir)
    starts = read_metrics(run_dir, "start")
    assert [(s["attempt"], s["step"]) for s in starts] == [(0, 0), (1, 4)]
    for attempt, log in enumerate(logs):
        run_id, history, config = wandb_history(log)
        assert run_id == ids["wandb"]["id"]
        trained = [(h["trainer/step"], h["train/loss"]) for h in history if "train/loss" in h]
        assert trained == [(r["step"], r["loss"]) for r in rows if r["attempt"] == attempt]
        marker = [h for h in history if "start/attempt" in h]
        assert [(m["trainer/step"], m["start/attempt"]) for m in marker] == [(starts[attempt]["step"], attempt)]
        assert config["optim"]["max_steps"] == 8 and config["log"]["tracker"] == "wandb,mlflow"


def test_mlflow_logs_the_killed_and_resumed_run_as_one(tracked, monkeypatch):
    from mlflow.tracking import MlflowClient

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    root, run_dir, _ = tracked
    client = MlflowClient(f"file:{root / 'mlruns'}")
    [run] = client.search_runs([client.get_experiment_by_name("tiny").experiment_id])
    assert run.info.run_id == json.loads((run_dir / "trackers.json").read_text())["mlflow"]["run_id"]
    assert run.info.status == "FINISHED" and run.data.tags["fsdpkit.attempts"] == "2"
    rows = read_metrics(run_dir)
    history = client.get_metric_history(run.info.run_id, "train/loss")
    assert sorted((m.step, m.value) for m in history) == sorted((r["step"], r["loss"]) for r in rows)
    assert {m.step for m in history} == {2, 4, 6, 8}
    starts = client.get_metric_history(run.info.run_id, "start/attempt")
    assert sorted((m.step, m.value) for m in starts) == [(0, 0.0), (4, 1.0)]
    params = run.data.params
    assert params["optim.max_steps"] == "8" and params["checkpoint.checkpoint_every"] == "4"
    assert params["data.seq_len"] == "64"


def test_no_api_key_reaches_a_log_or_a_file(tracked):
    root, _, r = tracked
    assert SECRET not in r.stdout + r.stderr
    for path in root.rglob("*"):
        if path.is_file():
            assert SECRET.encode() not in path.read_bytes(), path


def test_a_tracker_without_its_setting_is_one_line(tmp_path, monkeypatch):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    with pytest.raises(UserError, match="set MLFLOW_TRACKING_URI"):
        open_trackers(("mlflow",), tmp_path, "p", {}, 0)
    r = run_cli("train", "--tracker", "comet", "--max_steps", "1")
    assert r.returncode == 2 and "unknown tracker 'comet'; allowed: wandb, mlflow" in r.stderr
