"""Exact epochs through the trainer: a finite chat dataset under `--epochs 2` on two ranks, one of
them killed mid-epoch and the run resumed by torchrun's restart, trains every conversation once an
epoch, as the ranks' sample logs (`--log-samples`) record it."""

from __future__ import annotations

import json

import pytest

from fsdpkit.train.data import ByteTokenizer
from fsdpkit.train.data.chat import conversation_of, encode_conversation
from fsdpkit.train.data.chat_template import CHATML, ChatTemplate

from conftest import run_cli

pytestmark = pytest.mark.slow


def records(n: int) -> list[dict]:
    """Conversations of different lengths: packed 64 tokens a row, some straddle two rows."""
    return [{"messages": [{"role": "user", "content": f"What is {i} plus {i % 7}?" + " please" * (i % 3)},
                          {"role": "assistant", "content": f"{i + i % 7}." + " Sure" * (i % 4)}]} for i in range(n)]


def trained(run_dir) -> tuple[dict[tuple[int, int], int], dict[int, set[int]]]:
    """The tokens of each (epoch, conversation) the run trained on, and the steps each epoch's rows
    were in: over both ranks' sample logs, each step and micro-batch as the attempt that survived
    recorded it (a restart redoes steps)."""
    seen: dict[tuple[int, int], int] = {}
    steps: dict[int, set[int]] = {}
    for f in sorted(run_dir.glob("samples-rank*.jsonl")):
        entries = [e for e in map(json.loads, f.read_text().splitlines()) if e.get("kind") != "start"]
        for entry in {(e["step"], e["micro"]): e for e in entries}.values():
            for row in entry["records"]:
                for epoch, number, tokens in row:
                    seen[epoch, number] = seen.get((epoch, number), 0) + tokens
                    steps.setdefault(epoch, set()).add(entry["step"])
    return seen, steps


def test_every_conversation_trains_once_an_epoch_across_a_kill_and_resume_on_two_ranks(tmp_path):
    data = tmp_path / "chat" / "train"   # a split of its own: no record held out for validation
    data.mkdir(parents=True)
    rows = records(30)
    (data / "chat.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    run, ckpt = tmp_path / "run", tmp_path / "ckpt"
    r = run_cli("train", "--preset", "debug", "--dataset", str(tmp_path / "chat"), "--data-format", "chat",
                "--chat-template", "chatml", "--seq-len", "63", "--train-batch-size", "2", "--nproc", "2",
                "--epochs", "2", "--max-steps", "1000", "--log-samples", "1", "--checkpoint-dir", str(ckpt),
                "--checkpoint-every", "2", "--max-restarts", "1", "--validation-freq", "0", "--tensorboard", "0",
                "--progress", "off", "--run-dir", str(run), env={"FSDPKIT_FAULT": "kill:step=3:rank=1"})
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    assert "resumed from" in r.stdout and "step-00000002" in r.stdout   # killed after step 3, mid-epoch
    assert "the data ran out after 2 epoch(s)" in r.stdout
    template = ChatTemplate(CHATML, {}, "chatml")
    lengths = [len(encode_conversation(template, ByteTokenizer().encode, conversation_of(row, "x"))[0])
               for row in rows]
    # Each epoch spans several steps, and its last tokens share no row with the next epoch's.
    assert sum(lengths) > 8 * 64 and sum(lengths) % 64
    seen, steps = trained(run)
    assert seen == {(epoch, i + 1): n for epoch in (0, 1) for i, n in enumerate(lengths)}
    # No row of the second epoch is drawn before the first epoch's last (they may meet in one step).
    assert max(steps[0]) <= min(steps[1]) and len(steps[0]) > 2
