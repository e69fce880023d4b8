"""checkpoint.tiered: HyperPod's managed tiered checkpointing through amzn-sagemaker-checkpointing's
own DCP writer and reader, against the in-memory store scripted in tests/memory_store.py. A run
that loses a rank resumes from the memory tier, which is newer than shared storage, and continues
exactly; without the package the option is one line and every save goes to shared storage."""

from __future__ import annotations

import datetime as dt

import pytest

from fsdpkit.jobs.health import log_progress
from fsdpkit.train.checkpoint.catalog import list_checkpoints
from fsdpkit.train.checkpoint.tiered import namespace_of

from conftest import FAST, read_metrics, require, run_cli
from memory_store import MemoryStore

pytestmark = pytest.mark.slow

RUN = [*FAST, "--max_steps", "6", "--logging_freq", "1", "--warmup_steps", "2", "--tensorboard", "0",
       "--train_batch_size", "4", "--nproc", "2", "--checkpoint_every", "2"]


@pytest.fixture
def store():
    require("amzn_sagemaker_checkpointing.checkpointing.filesystem.filesystem")
    s = MemoryStore()
    yield s
    s.close()


def by_step(run_dir) -> dict[int, float]:
    """Each step's loss as the run finally computed it (a restart computes some steps again)."""
    return {r["step"]: r["loss"] for r in read_metrics(run_dir)}


def test_a_run_resumes_from_the_memory_tier_and_continues_exactly(store, tmp_path):
    reference = tmp_path / "reference"
    r = run_cli("train", *RUN, "--run_dir", str(reference / "run"), "--checkpoint_dir", str(reference / "ckpt"))
    assert r.returncode == 0, r.stderr[-3000:]

    ckpt, run_dir = tmp_path / "job" / "checkpoints", tmp_path / "job" / "run"
    # Checkpoints at steps 2 and 4 go to memory (every 4th to shared storage); rank 1 dies after step 5.
    r = run_cli("train", *RUN, "--tiered", "1", "--durable-every", "4", "--max_restarts", "1", "--run_dir",
                str(run_dir), "--checkpoint_dir", str(ckpt), env={**store.env, "FSDPKIT_FAULT": "kill:step=5:rank=1"})
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    namespace = namespace_of(ckpt)
    assert namespace.startswith("job-")
    assert f"checkpoint memory:{namespace}/step-00000002 saved" in r.stdout
    assert f"resumed from memory:{namespace}/step-00000004 at step 4" in r.stdout
    # Bitwise the reference's losses: the same state, data position and schedule after the restart.
    assert by_step(run_dir) == by_step(reference / "run")
    # Shared storage holds the last step only; the store held steps 2 and 4 of two ranks and the
    # metadata shard, and the restart read step 4 back.
    assert [c.step for c in list_checkpoints(ckpt)] == [6]
    assert store.namespaces[namespace] == {"num_ranks": 3, "steps_retained": 3}
    written = {(rank, step) for ns, rank, step in store.shards if ns == namespace}
    assert written == {(rank, step) for rank in range(3) for step in (2, 4)}
    reads = {path for method, path in store.requests if method == "GET" and "/checkpoints/" in path}
    assert f"/v1/cp/checkpoints/{namespace}/2/4" in reads   # the metadata shard of step 4


def test_without_the_package_the_option_is_one_line_and_saves_go_to_shared_storage(tmp_path):
    """amzn-sagemaker-checkpointing installed without what it imports (s3torchconnector): the run
    says so once and checkpoints as if the option were off."""
    shadow = tmp_path / "site" / "amzn_sagemaker_checkpointing"
    shadow.mkdir(parents=True)
    (shadow / "__init__.py").write_text("raise ImportError(\"No module named 's3torchconnector'\")\n")
    r = run_cli("train", *FAST, "--max_steps", "4", "--logging_freq", "2", "--tensorboard", "0", "--tiered", "1",
                "--checkpoint_every", "2", "--run_dir", str(tmp_path / "run"), "--checkpoint_dir",
                str(tmp_path / "ckpt"), env={"PYTHONPATH": str(tmp_path / "site")})
    assert r.returncode == 0, r.stderr[-3000:]
    said = [ln for ln in (r.stdout + r.stderr).splitlines() if "checkpoint.tiered" in ln]
    assert said == [f"warning: checkpoint.tiered: amzn-sagemaker-checkpointing cannot be imported here (No module "
                    f"named 's3torchconnector'); every checkpoint goes to {tmp_path / 'ckpt'} (build the "
                    "image with `fsdpkit image init --tiered`)"]
    assert [c.step for c in list_checkpoints(tmp_path / "ckpt")] == [2, 4]
    # `job watch` reading this log names it: the pod's grace was planned for the memory tier.
    _, findings = log_progress((r.stdout + r.stderr).splitlines(), "worker-0", dt.datetime.now(dt.timezone.utc), 1e9)
    assert [(f.kind, f.detail) for f in findings] == [("tiered_off", said[0])]
    assert "image init --hyperpod --tiered" in findings[0].fix
