"""Sharded checkpoints: complete-only visibility, exact resume, resume with another world size."""

from __future__ import annotations

import fcntl
import json
import re
import shutil
import signal
import subprocess
import sys
import time

import pytest

from fsdpkit.report.runs import load_run
from fsdpkit.train.checkpoint.catalog import list_checkpoints, resolve

from conftest import FAST, ROOT, losses, processes_naming, read_metrics, run_cli, write_fixture

pytestmark = pytest.mark.slow

BASE = [*FAST, "--max_steps", "6", "--logging_freq", "1", "--warmup_steps", "2", "--tensorboard", "0",
        "--checkpoint_freq", "3"]


@pytest.fixture(scope="module")
def two_rank_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpt")
    r = run_cli("train", *BASE, "--train_batch_size", "4", "--nproc", "2", "--log_samples", "1",
                "--run_dir", str(root / "run"), "--checkpoint_dir", str(root / "ckpt"))
    assert r.returncode == 0, r.stderr[-3000:]
    return root


def effective(records: list[dict], key: str = "step") -> dict[int, dict]:
    """What a run finally computed for each step: the last record of it (a restart redoes steps)."""
    return {r[key]: r for r in records}


def samples_by_step(run_dir) -> dict[int, list[int]]:
    """The samples each step trained on, over ranks and micro-batches, from the attempt that survived."""
    out: dict[int, list[int]] = {}
    for f in sorted(run_dir.glob("samples-rank*.jsonl")):
        records = [r for r in map(json.loads, f.read_text().splitlines()) if r.get("kind") != "start"]
        per_micro = {(r["step"], r["micro"]): r for r in records}   # a restart's record replaces the first
        for (step, _), rec in sorted(per_micro.items()):
            out.setdefault(step, []).extend(rec["blocks"])
    return out


@pytest.mark.parametrize("fault", ["kill:step=5:rank=1", "kill:save=6:rank=1"], ids=["mid-run", "mid-save"])
def test_sigkilled_rank_restarts_and_continues_exactly(two_rank_run, tmp_path, fault):
    run_dir, ckpt = tmp_path / "run", tmp_path / "ckpt"
    r = run_cli("train", *BASE, "--train_batch_size", "4", "--nproc", "2", "--max_restarts", "1",
                "--log_samples", "1", "--run_dir", str(run_dir), "--checkpoint_dir", str(ckpt),
                env={"FSDPKIT_FAULT": fault})
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    assert "resumed from" in r.stdout and "step-00000003" in r.stdout  # the last complete one
    # The surviving rank's gloo error is a consequence: one line, its traceback in the launcher's log.
    assert "Traceback" not in r.stdout + r.stderr
    if fault.startswith("kill:step"):   # gloo's words depend on which side saw the socket go first
        assert re.fullmatch(r"fsdpkit: rank 0 stopped: a peer process is gone \(.*Connection (closed|reset) by "
                            rf"peer.*\); traceback in {re.escape(str(run_dir / 'launcher.log'))}\n", r.stderr), r.stderr
        assert "rank 0 lost a peer:\nTraceback (most recent call last):" in (run_dir / "launcher.log").read_text()
    records = read_metrics(run_dir)
    assert len(records) > 6  # steps after the checkpoint ran twice: once before the kill, once after
    got = {step: rec["loss"] for step, rec in effective(records).items()}
    want = {rec["step"]: rec["loss"] for rec in read_metrics(two_rank_run / "run")}
    assert got == want  # bitwise: the same computation, in the same order
    # Every sample of steps 1..6 was trained on exactly once, by exactly one rank; none skipped.
    seen = samples_by_step(run_dir)
    assert sorted(seen) == [1, 2, 3, 4, 5, 6]
    flat = [k for step in seen.values() for k in step]
    assert sorted(flat) == list(range(6 * 8))
    assert seen == samples_by_step(two_rank_run / "run")
    assert [c.step for c in list_checkpoints(ckpt)] == [3, 6]
    # One record per run: each row says its attempt, each sample log marks where attempt 1 began,
    # and the readers show each step once, from the attempt that survived.
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [(r["attempt"], r["step"]) for r in rows if r["kind"] == "start"] == [(0, 0), (1, 3)]
    assert {r["attempt"] for r in rows if r["kind"] == "train" and r["step"] > 3} == {0, 1}
    for f in run_dir.glob("samples-rank*.jsonl"):
        starts = [r for r in map(json.loads, f.read_text().splitlines()) if r.get("kind") == "start"]
        assert [(r["attempt"], r["step"]) for r in starts] == [(0, 0), (1, 3)]
    run = load_run(run_dir)
    assert [(r["step"], r["loss"]) for r in run.train] == [(r["step"], r["loss"]) for r in
                                                            read_metrics(two_rank_run / "run")]
    assert run.restarts == [3]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["first_loss"] == losses(two_rank_run / "run")[0] and summary["attempts"] == 2


def test_checkpoints_are_complete_and_described(two_rank_run):
    found = list_checkpoints(two_rank_run / "ckpt")
    assert [c.step for c in found] == [3, 6]
    meta = found[0].meta
    assert meta["world_size"] == 2 and meta["samples"] == 3 * 8 and meta["preset"] == "tiny"
    assert any(p.suffix == ".distcp" for p in found[0].path.iterdir())
    # A save that crashed half-way leaves only a hidden .tmp directory: never chosen for resume.
    partial = two_rank_run / "ckpt" / ".step-00000009.tmp"
    partial.mkdir()
    (partial / "__0_0.distcp").write_bytes(b"partial")
    assert resolve(str(two_rank_run / "ckpt")).step == 6


@pytest.mark.parametrize(("nproc", "batch"), [("2", "4"), ("1", "8")], ids=["same-world", "2-to-1-ranks"])
def test_resume_continues_exactly(two_rank_run, tmp_path, nproc, batch):
    ckpt = tmp_path / "ckpt"
    shutil.copytree(two_rank_run / "ckpt" / "step-00000003", ckpt / "step-00000003")
    r = run_cli("train", *BASE, "--train_batch_size", batch, "--nproc", nproc, "--run_dir",
                str(tmp_path / "run"), "--checkpoint_dir", str(ckpt), "--resume_from_checkpoint", str(ckpt))
    assert r.returncode == 0, r.stderr[-3000:]
    assert "resumed from" in r.stdout
    assert [m["step"] for m in read_metrics(tmp_path / "run")] == [4, 5, 6]
    uninterrupted = losses(two_rank_run / "run")
    assert losses(tmp_path / "run") == pytest.approx(uninterrupted[3:], abs=1e-5)


def test_resume_with_gradient_accumulation_continues_at_the_next_unseen_sample(tmp_path):
    """With 2 micro-batches of 2 per step, a step consumes 4 samples: the checkpoint at step 3 records
    12, and the resumed run trains steps 4..6 on samples 12..23, exactly as the uninterrupted run did,
    to the same losses."""
    args = [*BASE, "--train_batch_size", "2", "--grad_accum_steps", "2", "--log_samples", "1"]
    whole = tmp_path / "whole"
    r = run_cli("train", *args, "--run_dir", str(whole / "run"), "--checkpoint_dir", str(whole / "ckpt"))
    assert r.returncode == 0, r.stderr[-3000:]
    assert [c.meta["samples"] for c in list_checkpoints(whole / "ckpt")] == [12, 24]
    ckpt = tmp_path / "ckpt"
    shutil.copytree(whole / "ckpt" / "step-00000003", ckpt / "step-00000003")
    r = run_cli("train", *args, "--run_dir", str(tmp_path / "run"), "--checkpoint_dir", str(ckpt),
                "--resume_from_checkpoint", "auto")
    assert r.returncode == 0, r.stderr[-3000:]
    resumed, uninterrupted = samples_by_step(tmp_path / "run"), samples_by_step(whole / "run")
    assert sorted(resumed) == [4, 5, 6] and resumed == {s: uninterrupted[s] for s in (4, 5, 6)}
    assert sorted(k for s in (4, 5, 6) for k in resumed[s]) == list(range(12, 24))
    assert losses(tmp_path / "run") == losses(whole / "run")[3:]


def test_checkpoints_by_wall_time_and_always_at_the_last_step(tmp_path):
    r = run_cli("train", *FAST, "--max_steps", "40", "--logging_freq", "5", "--tensorboard", "0", "--run_dir",
                str(tmp_path / "run"), "--checkpoint_dir", str(tmp_path / "ckpt"), "--checkpoint_every", "1s",
                "--keep_last", "0")
    assert r.returncode == 0, r.stderr[-3000:]
    steps = [c.step for c in list_checkpoints(tmp_path / "ckpt")]
    # Saved as each second passed (a step here takes tens of milliseconds), and at step 40.
    assert steps[-1] == 40 and len(steps) >= 2 and steps == sorted(set(steps)), steps


def test_resume_with_another_sequence_length_and_batch_says_where_the_data_continues(two_rank_run, tmp_path):
    """The model is the same, so resuming is allowed; the data position carries over in tokens."""
    ckpt = tmp_path / "ckpt"
    shutil.copytree(two_rank_run / "ckpt" / "step-00000003", ckpt / "step-00000003")  # 24 samples of 64 tokens
    r = run_cli("train", *BASE, "--seq_len", "32", "--train_batch_size", "2", "--nproc", "1", "--run_dir",
                str(tmp_path / "run"), "--checkpoint_dir", str(ckpt), "--resume_from_checkpoint", "auto")
    assert r.returncode == 0, r.stderr[-3000:]
    assert "resumed with seq_len 32 (the checkpoint's: 64): the data continues after the 1,536 tokens already " \
           "trained on (sample 48 at the new length)" in r.stdout
    assert "resumed with a global batch of 2 sequences per step (the checkpoint's: 8): the data continues at " \
           "sample 48" in r.stdout
    assert [m["step"] for m in read_metrics(tmp_path / "run")] == [4, 5, 6]


def test_resume_keeps_the_checkpoints_data_and_refuses_other_data_in_one_line(tmp_path):
    """A resume that names no dataset or tokenizer continues on the checkpoint's (it did not: the
    embedded text with the byte tokenizer, loss 3.7 -> 13.8 without a word); naming other data is
    refused before anything starts, unless --resume_new_data says it is meant."""
    corpus = write_fixture(tmp_path / "corpus", "jsonl")
    ckpt, common = tmp_path / "ckpt", [*BASE, "--train_batch_size", "2", "--nproc", "1"]
    r = run_cli("train", *common, "--max_steps", "3", "--dataset", str(corpus), "--run_dir", str(tmp_path / "a"),
                "--checkpoint_dir", str(ckpt))
    assert r.returncode == 0, r.stderr[-3000:]
    assert f"fsdpkit: data {corpus}, tokenizer bytes, vocab 258" in r.stdout
    r = run_cli("train", *common, "--run_dir", str(tmp_path / "b"), "--checkpoint_dir", str(ckpt), "--resume", "auto")
    assert r.returncode == 0, r.stderr[-3000:]
    assert f"fsdpkit: dataset {str(corpus)!r}, as the checkpoint in {ckpt} was trained (the default on resume)" \
        in r.stdout
    assert f"fsdpkit: data {corpus}, tokenizer bytes, vocab 258" in r.stdout
    first, resumed = losses(tmp_path / "a"), losses(tmp_path / "b")
    assert len(resumed) == 3 and max(resumed) < first[0]   # still learning the same text, not a new one
    # Another dataset, named: one line, exit 2, nothing written.
    r = run_cli("train", *common, "--dataset", "embedded", "--run_dir", str(tmp_path / "c"), "--checkpoint_dir",
                str(ckpt), "--resume", "auto")
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr[-3000:]
    assert r.stderr == (f"error: resume_from_checkpoint: {ckpt / 'step-00000006'} was trained on other data than "
                        f"this run names: dataset 'embedded' (the checkpoint's: {str(corpus)!r}); drop those options "
                        "to continue on its data, or pass --resume-new-data 1 to change it deliberately\n")
    assert not (tmp_path / "c").exists()
    # Meant: allowed, and said.
    r = run_cli("train", *common, "--max_steps", "7", "--dataset", "embedded", "--resume_new_data", "1",
                "--run_dir", str(tmp_path / "d"), "--checkpoint_dir", str(ckpt), "--resume", "auto")
    assert r.returncode == 0, r.stderr[-3000:]
    assert "warning: resuming" in r.stdout and "on other data, as --resume-new-data asks: dataset 'embedded'" in \
        r.stdout and "fsdpkit: data embedded, tokenizer bytes" in r.stdout


@pytest.mark.parametrize("nproc", ["1", "2"])
def test_resume_refuses_another_model_shape(two_rank_run, tmp_path, nproc):
    # Checked before any process starts (the checkpoint's fsdpkit.json names its shape), so under
    # --nproc 2 too nothing is launched or written.
    r = run_cli("train", *FAST, "--max_steps", "6", "--train_batch_size", "8", "--n_layers", "3", "--nproc", nproc,
                "--run_dir", str(tmp_path / "run"), "--resume_from_checkpoint", str(two_rank_run / "ckpt"))
    assert r.returncode == 2, r.stderr[-3000:]
    assert r.stderr.strip().splitlines() == [r.stderr.strip()]
    assert r.stderr.startswith("error: resume_from_checkpoint")
    assert "another shape: n_layers 4 (this run: 3)" in r.stderr
    assert not (tmp_path / "run").exists()
    assert json.loads((two_rank_run / "ckpt" / "step-00000006" / "fsdpkit.json").read_text())["step"] == 6


def test_a_checkpoint_recorded_before_the_qwen_fields_resumes(two_rank_run, tmp_path):
    """A checkpoint whose fsdpkit.json predates a shape field (head_dim, qkv_bias, qk_norm) holds a
    model with that field's default, so a run of the same shape resumes it."""
    ckpt = tmp_path / "ckpt"
    shutil.copytree(two_rank_run / "ckpt" / "step-00000003", ckpt / "step-00000003")
    meta_file = ckpt / "step-00000003" / "fsdpkit.json"
    meta = json.loads(meta_file.read_text())
    for field in ("head_dim", "qkv_bias", "qk_norm"):
        del meta["model"][field]
    meta_file.write_text(json.dumps(meta))
    r = run_cli("train", *FAST, "--max_steps", "4", "--train_batch_size", "8", "--tensorboard", "0",
                "--run_dir", str(tmp_path / "run"), "--resume_from_checkpoint", str(ckpt))
    assert r.returncode == 0, r.stderr[-3000:]
    assert "resumed from" in r.stdout


def test_resume_from_empty_directory_starts_fresh(tmp_path):
    r = run_cli("train", *FAST, "--max_steps", "2", "--logging_freq", "1", "--tensorboard", "0",
                "--train_batch_size", "2", "--run_dir", str(tmp_path / "run"),
                "--resume_from_checkpoint", str(tmp_path / "nothing-here"))
    assert r.returncode == 0, r.stderr[-3000:]
    assert "starting from step 0" in r.stdout


def _train_until(tmp_path, nproc: str, sig: int, *extra: str) -> tuple[subprocess.Popen, float, str]:
    """A long run, sent `sig` once it has logged 3 steps; returns it ended, the seconds it took and its stdout."""
    cmd = [sys.executable, "-m", "fsdpkit", "train", *FAST, "--max_steps", "100000", "--logging_freq", "1",
           "--tensorboard", "0", "--train_batch_size", "4", "--nproc", nproc, "--run_dir", str(tmp_path / "run"),
           "--checkpoint_dir", str(tmp_path / "ckpt"), *extra]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, cwd=ROOT)
    metrics = tmp_path / "run" / "metrics.jsonl"
    deadline = time.monotonic() + 120
    # Three training rows (the file's first row is the run's start record, not a step).
    while time.monotonic() < deadline and not (metrics.exists() and metrics.read_text().count('"kind": "train"') >= 3):
        assert proc.poll() is None, proc.communicate()[0][-3000:]
        time.sleep(0.1)
    proc.send_signal(sig)
    sent = time.monotonic()
    out, _ = proc.communicate(timeout=60)
    return proc, time.monotonic() - sent, out


def test_killing_the_launcher_leaves_no_rank_running(tmp_path):
    """SIGKILL can be neither caught nor forwarded: the workers must die with their launcher
    (parent-death signals along launcher -> torchrun's agent -> workers), not train on unsupervised."""
    proc, _, _ = _train_until(tmp_path, "2", signal.SIGKILL)
    assert proc.returncode == -signal.SIGKILL
    deadline = time.monotonic() + 10
    while processes_naming(tmp_path / "run") and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not processes_naming(tmp_path / "run")


@pytest.mark.parametrize("nproc", ["1", "2"])
def test_sigterm_saves_a_complete_checkpoint_within_grace_period(tmp_path, nproc):
    proc, took, out = _train_until(tmp_path, nproc, signal.SIGTERM, "--json")
    assert took < 30, "Kubernetes' default grace period is 30 s"
    # 128 + SIGTERM, also under torchrun: an interrupted run must not look finished, nor failed. The
    # envelope agrees with the exit code (under torchrun the worker itself exits 0 to its supervisor).
    assert proc.returncode == 143
    envelope = json.loads(out)
    assert envelope["ok"] is False and envelope["data"]["stopped_by_signal"] is True
    assert envelope["error"]["code"] == "failed" and "--resume-from-checkpoint auto" in envelope["error"]["hint"]
    assert not processes_naming(tmp_path / "run")   # the workers and torchrun's agent are gone too
    (latest,) = list_checkpoints(tmp_path / "ckpt")
    assert latest.step >= 3 and latest.meta["world_size"] == int(nproc)
    steps_logged = [m["step"] for m in read_metrics(tmp_path / "run")]
    assert latest.step == steps_logged[-1]  # saved after the last completed step, nothing lost
    r = run_cli("train", *FAST, "--max_steps", str(latest.step + 2), "--logging_freq", "1", "--tensorboard", "0",
                "--train_batch_size", "4", "--nproc", nproc, "--run_dir", str(tmp_path / "run2"),
                "--resume_from_checkpoint", str(tmp_path / "ckpt"))
    assert r.returncode == 0, r.stderr[-3000:]
    assert [m["step"] for m in read_metrics(tmp_path / "run2")] == [latest.step + 1, latest.step + 2]


def test_hyperpods_graceful_stop_signal_saves_a_checkpoint_too(tmp_path):
    """HyperPod's elastic agent stops workers gracefully with SIGUSR1, whose default action ends a
    process at once: the worker stops after its step and saves, as on SIGTERM."""
    proc, _, _ = _train_until(tmp_path, "1", signal.SIGUSR1)
    assert proc.returncode == 143
    (latest,) = list_checkpoints(tmp_path / "ckpt")
    assert latest.step == [m["step"] for m in read_metrics(tmp_path / "run")][-1] >= 3


def test_ckpt_list_and_show(two_rank_run, tmp_path, cli):
    root = tmp_path / "ckpts"
    shutil.copytree(two_rank_run / "ckpt", root, ignore=shutil.ignore_patterns(".*.tmp"))
    (root / ".step-00000009.tmp").mkdir()  # a save that died half-way
    (root / "llama_v3-50steps").mkdir()  # the reference example's naming
    (root / "llama_v3-50steps" / ".metadata").write_bytes(b"x")
    (root / "notes").mkdir()  # not a checkpoint
    r = cli("ckpt", "list", str(root), "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["ok"] is True and out["error"] is None
    rows = {row["name"]: row for row in out["data"]}
    assert set(rows) == {"step-00000003", "step-00000006", ".step-00000009.tmp", "llama_v3-50steps"}
    assert rows["step-00000006"]["complete"] and rows["step-00000006"]["world_size"] == 2
    assert rows["step-00000006"]["bytes"] > 10_000
    assert rows[".step-00000009.tmp"]["complete"] is False
    assert rows["llama_v3-50steps"]["kind"] == "reference" and rows["llama_v3-50steps"]["step"] == 50
    human = cli("ckpt", "list", str(root))
    assert "step-00000006" in human.stdout and "NO" in human.stdout

    shown = json.loads(cli("ckpt", "show", str(root / "step-00000003"), "--json").stdout)["data"]
    assert shown["step"] == 3 and shown["meta"]["model"]["dim"] == 128
    assert shown["meta"]["config"]["optim"]["max_steps"] == 6
    assert "fsdpkit.json" in shown["files"]


def test_ckpt_errors_are_one_line_or_json(cli, tmp_path):
    r = cli("ckpt", "list", str(tmp_path / "missing"))
    assert r.returncode == 2 and r.stderr.strip().splitlines() == [f"error: checkpoint directory not found: "
                                                                    f"{tmp_path / 'missing'}"]
    j = cli("ckpt", "show", str(tmp_path), "--json")
    assert j.returncode == 2
    body = json.loads(j.stdout)
    assert body["ok"] is False and body["error"]["code"] == "bad_input"
    assert "not a checkpoint" in body["error"]["message"]


def test_resume_from_one_process_on_two_ranks(tmp_path):
    """Resharding the other way: saved by 1 process, continued by 2 FSDP ranks."""
    first = tmp_path / "first"
    r = run_cli("train", *BASE, "--train_batch_size", "8", "--run_dir", str(first / "run"),
                "--checkpoint_dir", str(first / "ckpt"))
    assert r.returncode == 0, r.stderr[-3000:]
    assert list_checkpoints(first / "ckpt")[0].meta["world_size"] == 1
    ckpt = tmp_path / "ckpt"
    shutil.copytree(first / "ckpt" / "step-00000003", ckpt / "step-00000003")
    r = run_cli("train", *BASE, "--train_batch_size", "4", "--nproc", "2", "--run_dir", str(tmp_path / "run"),
                "--checkpoint_dir", str(ckpt), "--resume", "auto")
    assert r.returncode == 0, r.stderr[-3000:]
    assert [m["step"] for m in read_metrics(tmp_path / "run")] == [4, 5, 6]
    assert losses(tmp_path / "run") == pytest.approx(losses(first / "run")[3:], abs=1e-5)


def test_async_checkpoints_hold_the_state_of_their_step(two_rank_run, tmp_path):
    """Background writes snapshot the step they were taken at, though training went on meanwhile."""
    first = tmp_path / "async"
    r = run_cli("train", *BASE, "--train_batch_size", "4", "--nproc", "2", "--async_checkpoint", "1",
                "--run_dir", str(first / "run"), "--checkpoint_dir", str(first / "ckpt"))
    assert r.returncode == 0, r.stderr[-3000:]
    assert "writing in the background" in r.stdout
    assert [c.step for c in list_checkpoints(first / "ckpt")] == [3, 6]
    assert losses(first / "run") == losses(two_rank_run / "run")
    ckpt = tmp_path / "ckpt"
    shutil.copytree(first / "ckpt" / "step-00000003", ckpt / "step-00000003")
    r = run_cli("train", *BASE, "--train_batch_size", "4", "--nproc", "2", "--run_dir", str(tmp_path / "run"),
                "--checkpoint_dir", str(ckpt), "--resume", "auto")
    assert r.returncode == 0, r.stderr[-3000:]
    assert losses(tmp_path / "run") == losses(two_rank_run / "run")[3:]


def test_partial_or_damaged_checkpoint_is_a_clear_error(two_rank_run, tmp_path):
    partial = tmp_path / ".step-00000009.tmp"
    shutil.copytree(two_rank_run / "ckpt" / "step-00000003", partial)
    (partial / "fsdpkit.json").unlink()
    damaged = tmp_path / "ckpt" / "step-00000003"
    shutil.copytree(two_rank_run / "ckpt" / "step-00000003", damaged)
    shard = next(damaged.glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:100])  # truncated, as by a full disk
    (tmp_path / "reference" / "llama_v3-100steps").mkdir(parents=True)
    # Named directly, a damaged checkpoint is an error; in a root it is set aside (test below).
    cases = ((partial, "not a complete fsdpkit checkpoint"), (damaged, "is damaged"),
             (tmp_path / "reference", "reference example"))
    for spec, text in cases:
        r = run_cli("train", *FAST, "--max_steps", "6", "--train_batch_size", "8", "--run_dir",
                    str(tmp_path / "run"), "--resume_from_checkpoint", str(spec))
        assert r.returncode == 2, r.stderr[-2000:]
        lines = r.stderr.strip().splitlines()
        assert len(lines) == 1 and text in lines[0], r.stderr[-2000:]
        assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("damage", ["shard", "metadata"])
def test_a_damaged_newest_checkpoint_is_set_aside_and_the_older_one_resumed(two_rank_run, tmp_path, damage):
    """A truncated shard, or a truncated fsdpkit.json (which once stopped `--resume auto` with a
    JSONDecodeError): the newest is set aside in one line and the run resumes exactly from the one
    before."""
    ckpt = tmp_path / "ckpt"
    shutil.copytree(two_rank_run / "ckpt", ckpt, ignore=shutil.ignore_patterns(".*.tmp", ".fsdpkit.lock"))
    damaged = ckpt / "step-00000006" / ("__1_0.distcp" if damage == "shard" else "fsdpkit.json")
    kept = damaged.read_bytes()[:100]
    damaged.write_bytes(kept)  # what a disk that filled up mid-copy leaves
    r = run_cli("ckpt", "list", str(ckpt))
    assert r.returncode == 0 and ("damaged" in r.stdout.split("step-00000006")[1].splitlines()[0]
                                  or damage == "shard")
    # Export takes the newest whole one too, and says which it passed over (it moves nothing).
    r = run_cli("export", str(ckpt), str(tmp_path / "hf"), "--json")
    why = "__1_0.distcp is truncated (100 of" if damage == "shard" else "fsdpkit.json cannot be read (JSONDecodeError)"
    assert r.returncode == 0, r.stderr[-2000:]
    said = r.stderr.strip().splitlines()
    assert said[0] == f"warning: export: {ckpt / 'step-00000006'} is damaged ({why}" + r.stderr.split(why, 1)[1]\
        .splitlines()[0] and said[0].endswith("exporting an older checkpoint")
    assert said[1:] == [f"export: reading step 3 of {ckpt / 'step-00000003'} (0.80M parameters) into CPU memory",
                        f"export: writing {tmp_path / 'hf'} (fp32)"]   # then its progress, of the older one
    data = json.loads(r.stdout)["data"]
    assert data["step"] == 3 and [s["checkpoint"] for s in data["skipped"]] == [str(ckpt / "step-00000006")]
    assert damaged.read_bytes() == kept
    stale = ckpt / ".step-00000009.tmp"  # a save a killed attempt never finished
    stale.mkdir()
    (stale / "__0_0.distcp").write_bytes(b"partial")
    r = run_cli("train", *BASE, "--train_batch_size", "4", "--nproc", "2", "--run_dir", str(tmp_path / "run"),
                "--checkpoint_dir", str(ckpt), "--resume_from_checkpoint", "auto")
    assert r.returncode == 0, r.stderr[-3000:]
    assert [line for line in r.stdout.splitlines() if line.startswith("warning: checkpoint")] == [
        f"warning: checkpoint {ckpt / 'step-00000006'} is damaged ({why}" + r.stdout.split(why, 1)[1].splitlines()[0]]
    assert "set aside as step-00000006.damaged" in r.stdout and "resumed from" in r.stdout
    assert "step-00000003" in r.stdout.split("resumed from", 1)[1].splitlines()[0]
    # Kept for a person to look at, byte for byte; the run then wrote a whole step 6 again.
    assert (ckpt / "step-00000006.damaged" / damaged.name).read_bytes() == kept
    assert [c.step for c in list_checkpoints(ckpt)] == [3, 6]
    assert not stale.exists()
    assert losses(tmp_path / "run") == pytest.approx(losses(two_rank_run / "run")[3:], abs=1e-5)


def test_a_second_run_on_a_busy_checkpoint_dir_is_refused_and_kill_9_frees_it(tmp_path):
    """Two runs on one checkpoint_dir once trained side by side and collided on the same temporary
    checkpoint. The second is refused in one line naming the first; after `kill -9` of the first's
    launcher (no clean-up of any kind) a new run starts once its processes are gone, and resumes its
    newest checkpoint."""
    ckpt = tmp_path / "ckpt"
    log = open(tmp_path / "first.log", "w")  # noqa: SIM115 (closed below)
    first = subprocess.Popen([sys.executable, "-m", "fsdpkit", "train", *FAST, "--max_steps", "100000",
                              "--checkpoint_every", "4", "--logging_freq", "4", "--nproc", "2", "--tensorboard", "0",
                              "--checkpoint_dir", str(ckpt), "--run_dir", str(tmp_path / "first")],
                             cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 240
        while not list_checkpoints(ckpt) and first.poll() is None and time.monotonic() < deadline:
            time.sleep(0.5)
        assert list_checkpoints(ckpt), (tmp_path / "first.log").read_text()[-3000:]
        r = run_cli("train", *FAST, "--max_steps", "3", "--checkpoint_dir", str(ckpt),
                    "--run_dir", str(tmp_path / "second"))
        assert r.returncode == 2, r.stderr[-3000:]
        assert r.stderr.splitlines() == [r.stderr.strip()] and r.stderr.startswith(
            f"error: checkpoint_dir: {ckpt} is in use by another run (pid {first.pid} on ")
        assert f"run_dir {tmp_path / 'first'}" in r.stderr and not (tmp_path / "second").exists()
        first.kill()  # SIGKILL: the launcher gets no chance to let go of anything
        first.wait()
    finally:
        first.kill()
        log.close()
    deadline = time.monotonic() + 60
    # Its agent and workers follow it (parent-death signals); the lock goes with the last of them, which
    # may first finish a write it is inside of (a SIGKILL waits for the kernel's I/O).
    while (processes_naming(tmp_path / "first") or _locked(ckpt)) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not _locked(ckpt), processes_naming(tmp_path / "first")
    newest = list_checkpoints(ckpt)[-1]
    r = run_cli("train", *FAST, "--max_steps", str(newest.step + 2), "--checkpoint_dir", str(ckpt),
                "--run_dir", str(tmp_path / "third"), "--resume_from_checkpoint", "auto")
    assert r.returncode == 0, r.stderr[-3000:]
    assert f"resumed from {newest.path} at step {newest.step}" in r.stdout


def _locked(ckpt) -> bool:
    """Whether a process holds the checkpoint directory's run lock (fsdpkit.train.runtime.run_lock)."""
    with open(ckpt / ".fsdpkit.lock") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        fcntl.flock(f, fcntl.LOCK_UN)
        return False


def _tmpfs_refused() -> str | None:
    if shutil.which("unshare") is None:
        return "unshare (util-linux) is not installed"
    r = subprocess.run(["unshare", "--mount", "sh", "-c", "mount -t tmpfs -o size=1m tmpfs /mnt"], capture_output=True)
    return None if r.returncode == 0 else "this machine cannot mount a tmpfs in a mount namespace"


@pytest.mark.skipif(_tmpfs_refused() is not None, reason=str(_tmpfs_refused()))
@pytest.mark.parametrize("nproc", [1, 2])
def test_a_save_into_a_full_disk_is_one_line_naming_the_disk(tmp_path, nproc):
    """A 2 MiB file system (a tmpfs in a mount namespace of the run's own) cannot hold the first
    checkpoint: the run ends with one line naming the full disk and the directory, from the
    launcher too, instead of some 200 lines of DCP tracebacks."""
    disk = tmp_path / "disk"
    disk.mkdir()
    cmd = [sys.executable, "-m", "fsdpkit", "train", *FAST, "--max_steps", "4", "--checkpoint_every", "2",
           "--tensorboard", "0", "--nproc", str(nproc), "--checkpoint_dir", str(disk / "ckpt"),
           "--run_dir", str(tmp_path / "run")]
    r = subprocess.run(["unshare", "--mount", "sh", "-c", 'mount -t tmpfs -o size=2m tmpfs "$0" && exec "$@"',
                        str(disk), *cmd], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 1, r.stderr[-3000:]
    assert "Traceback" not in r.stderr and "[rank" not in r.stderr
    [line] = [x for x in r.stderr.splitlines() if x.startswith("error:")]
    assert line.startswith(f"error: checkpoint: saving step 2 to {disk / 'ckpt'} failed: no space left on device")
    assert r.stderr.strip().splitlines()[-1] == line


def test_a_damaged_checkpoint_named_directly_is_one_line_and_left_in_place(two_rank_run, tmp_path):
    ckpt = tmp_path / "step-00000006"
    shutil.copytree(two_rank_run / "ckpt" / "step-00000006", ckpt)
    (ckpt / "__0_0.distcp").unlink()
    r = run_cli("train", *FAST, "--max_steps", "6", "--train_batch_size", "8", "--run_dir", str(tmp_path / "run"),
                "--resume_from_checkpoint", str(ckpt))
    assert r.returncode == 2
    assert r.stderr.strip() == f"error: resume_from_checkpoint: {ckpt} is damaged and cannot be read " \
                               "(__0_0.distcp is missing)"
    assert ckpt.is_dir()
