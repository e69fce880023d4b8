"""`fsdpkit eval`: lm-evaluation-harness scores an exported model offline on a local task; the score
is fsdpkit's own model's choice, and it lands in the run's summary.json and report."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from fsdpkit.train.checkpoint import catalog
from fsdpkit.train.data import HFTokenizer, train_bpe
from fsdpkit.train.export import load_full_model

from conftest import DOCS, require, run_cli
from finetune_fixtures import local_task, perplexity_task, tiny_qwen

pytestmark = pytest.mark.slow

QUESTIONS = [(f"document {i}:", [f"w{(i * 7) % 50}", f"w{(i * 7 + 25) % 50}", "zebra"], 0) for i in range(12)]


def our_accuracy(model, tok: HFTokenizer) -> float:
    """The task scored by hand with fsdpkit's model: the choice of highest log-likelihood after the
    question (the harness's rule: context, a space, the choice; its tokens are the whole's after
    the context's)."""
    right = 0
    for question, choices, answer in QUESTIONS:
        context = tok.encode(question).tolist()
        scores = []
        for choice in choices:
            whole = tok.encode(f"{question} {choice}").tolist()
            tokens = torch.tensor([whole])
            with torch.no_grad():
                logp = torch.log_softmax(model(tokens[:, :-1]).float(), dim=-1)[0]
            cont = range(len(context), len(whole))
            scores.append(sum(logp[i - 1, whole[i]].item() for i in cont))
        right += int(max(range(len(choices)), key=scores.__getitem__) == answer)
    return right / len(QUESTIONS)


def test_eval_scores_an_export_offline_into_the_runs_summary_and_report(tmp_path, monkeypatch):
    require("lm_eval")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "docs.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in DOCS))
    tok_dir = train_bpe(DOCS, 300, tmp_path / "tok")
    run = tmp_path / "run"
    r = run_cli("train", "--dataset", str(corpus), "--tokenizer", str(tok_dir), "--vocab-size", "320",
                "--seq-len", "64", "--max-steps", "30", "--train-batch-size", "8", "--validation-freq", "0",
                "--validation-batches", "1", "--tensorboard", "0", "--progress", "off", "--run-dir", str(run),
                "--checkpoint-dir", str(tmp_path / "ckpt"))
    assert r.returncode == 0, r.stderr[-3000:]
    assert run_cli("export", str(tmp_path / "ckpt"), str(tmp_path / "hf")).returncode == 0
    tasks = perplexity_task(local_task(tmp_path / "tasks", QUESTIONS), [("document 3:", "w21"), ("document 5:", "w35")])
    r = run_cli("eval", str(tmp_path / "hf"), "--tasks", "fsdpkit_tiny_mc,fsdpkit_tiny_ppl", "--include-path",
                str(tasks), "--device", "cpu", "--json", timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    # stdout is the envelope alone, though the harness printed that it bootstraps (to stderr).
    assert "bootstrapping for stddev: perplexity" in r.stderr
    assert subprocess.run([sys.executable, "-m", "json.tool"], input=r.stdout, text=True,
                          capture_output=True).returncode == 0, r.stdout[:500]
    data = json.loads(r.stdout)["data"]
    assert set(data["tasks"]) == {"fsdpkit_tiny_mc", "fsdpkit_tiny_ppl"}
    acc = data["tasks"]["fsdpkit_tiny_mc"]["acc"]
    # The harness's score is what fsdpkit's own model chooses, question by question.
    model = load_full_model(catalog.resolve(str(tmp_path / "ckpt"))).eval()
    assert acc == pytest.approx(our_accuracy(model, HFTokenizer(str(tok_dir))))
    # Recorded in the run the export came from, beside what training wrote there.
    assert data["run_dir"] == str(run)
    summary = json.loads((run / "summary.json").read_text())
    assert summary["steps"] == 30 and summary["eval"]["tasks"]["fsdpkit_tiny_mc"]["acc"] == acc
    assert set(json.loads((run / "eval.json").read_text())["results"]) == {"fsdpkit_tiny_mc", "fsdpkit_tiny_ppl"}
    r = run_cli("report", str(run), "--out", str(tmp_path / "report"))
    assert r.returncode == 0, r.stderr
    page = (tmp_path / "report" / "report.html").read_text()
    assert "fsdpkit_tiny_mc" in page and f"{acc:.4f}" in page
    # A hub task with the hub out of reach and nothing cached: exit 3 (unreachable) after one look
    # at the hub's host, none of the hub client's retries; with HF_HUB_OFFLINE=1, the user's input.
    monkeypatch.delenv("HF_HUB_OFFLINE")
    monkeypatch.delenv("HF_DATASETS_OFFLINE")
    gone = {"HF_ENDPOINT": "http://127.0.0.1:9", "HF_HOME": str(tmp_path / "empty-hf-home")}
    for env, code, says in ((gone, 3, "and the Hugging Face hub (http://127.0.0.1:9) cannot be reached"),
                            ({**gone, "HF_HUB_OFFLINE": "1"}, 2, "and HF_HUB_OFFLINE=1 keeps the hub out")):
        r = run_cli("eval", str(tmp_path / "hf"), "--tasks", "hellaswag", "--limit", "2", "--device", "cpu", env=env,
                    timeout=600)
        last = r.stderr.strip().splitlines()[-1]
        assert r.returncode == code and last.startswith("error: eval: hellaswag needs data that is not cached here, ")
        assert says in last and "Retrying" not in r.stderr, r.stderr[-3000:]


@pytest.fixture(scope="module")
def hub_model(tmp_path_factory):
    """A model directory as the hub has them (Qwen2.5's form, tiny), and local tasks: one scored by
    perplexity, and one whose data file is damaged (it fails when its turn comes)."""
    root = tmp_path_factory.mktemp("hub-model")
    model = tiny_qwen(root / "model", require("transformers"))
    tasks = perplexity_task(root / "tasks", [(f"document {i}: w{i}", f"w{i + 1}") for i in range(4)])
    local_task(tasks, QUESTIONS[:2], name="fsdpkit_damaged")
    (tasks / "fsdpkit_damaged.jsonl").write_text('{"question": "a", "choices": ["b"], "answer": 0}\nnot json\n')
    return model, tasks


def test_eval_makes_its_run_dir_keeps_each_task_as_it_ends_and_prints_only_json(hub_model, tmp_path, monkeypatch):
    """A run directory not yet made is made (before the scoring); a task that fails after another
    has finished leaves the finished task's scores on disk, the error in one line saying so; and
    under --json stdout is the envelope alone, though the harness printed "bootstrapping for
    stddev: perplexity" meanwhile (to stderr)."""
    require("lm_eval")
    model, tasks = hub_model
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    run = tmp_path / "not" / "yet"
    r = run_cli("eval", str(model), "--tasks", "fsdpkit_tiny_ppl,fsdpkit_damaged", "--include-path", str(tasks),
                "--device", "cpu", "--run-dir", str(run), "--json", timeout=600)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-3000:]
    assert "bootstrapping for stddev: perplexity" in r.stderr
    assert subprocess.run([sys.executable, "-m", "json.tool"], input=r.stdout, text=True,
                          capture_output=True).returncode == 0, r.stdout[:500]
    error = json.loads(r.stdout)["error"]["message"]
    assert error.startswith("eval: the harness stopped on fsdpkit_damaged (") and "JSON parse error" in error
    assert error.endswith(f"; the scores of fsdpkit_tiny_ppl are recorded in {run}") and "\n" not in error
    kept = json.loads((run / "eval.json").read_text())
    assert set(kept["results"]) == set(kept["configs"]) == {"fsdpkit_tiny_ppl"}
    assert kept["results"]["fsdpkit_tiny_ppl"]["perplexity,none"] > 1
    assert not list(run.glob(".*.tmp"))


def test_eval_says_what_is_wrong_in_one_line(tmp_path, hub_model):
    """Before the harness loads: a folder that is no model, one whose config is damaged, no task named."""
    (tmp_path / "empty").mkdir()
    r = run_cli("eval", str(tmp_path / "empty"), "--tasks", "x")
    assert r.returncode == 2 and r.stderr.startswith("error: eval: ") and "export a checkpoint first" in r.stderr
    assert len(r.stderr.splitlines()) == 1
    model, _ = hub_model
    r = run_cli("eval", str(model), "--tasks", " , ")
    assert r.returncode == 2 and r.stderr.splitlines() == [
        "error: eval: --tasks names no task; give one or more, comma-separated (lm-eval ls tasks)"]
    garbage = tmp_path / "garbage"
    garbage.mkdir()
    for f in ("tokenizer.json", "tokenizer_config.json"):
        (garbage / f).write_bytes((model / f).read_bytes())
    (garbage / "config.json").write_text("{not json")
    r = run_cli("eval", str(garbage), "--tasks", "fsdpkit_tiny_mc")
    assert r.returncode == 2 and len(r.stderr.splitlines()) == 1, r.stderr[-3000:]
    assert r.stderr.startswith(f"error: eval: cannot read {garbage}/config.json: "), r.stderr


@pytest.mark.parametrize("flag,value,says", [
    ("--limit", "-1", "expected documents per task above 0 (below 1: a fraction of each task), got '-1'"),
    ("--limit", "0", "expected documents per task above 0 (below 1: a fraction of each task), got '0'"),
    ("--limit", "inf", "expected documents per task above 0 (below 1: a fraction of each task), got 'inf'"),
    ("--batch-size", "0", "expected sequences per forward, 1 or more, got '0'"),
    ("--batch-size", "x", "expected sequences per forward, 1 or more, got 'x'"),
])
def test_eval_refuses_a_limit_or_batch_it_cannot_use_before_loading_anything(tmp_path, flag, value, says):
    """Checked by the parser, before the model, the harness or the hub is touched (the folder given
    does not even exist)."""
    r = run_cli("eval", str(tmp_path / "nothing"), "--tasks", "x", flag, value)
    assert r.returncode == 2
    assert r.stderr.splitlines() == [f"error: argument {flag}: {says} (see `fsdpkit eval --help`)"]
