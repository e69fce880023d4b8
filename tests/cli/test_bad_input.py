"""Bad input, as an adversarial user gives it: every case is one line on stderr, no traceback, the
documented exit code (2: the input; 3: AWS or the cluster refused or could not be reached), and
nothing written or applied: no file appears or changes, no object reaches the cluster."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import FAST, ROOT, KubeMock, fsdpkit_process, run_cli

pytestmark = pytest.mark.slow

TOKEN = "hf_AbCdEfGhIjKlMnOpQrStUvWxYz012345"
SPEC = {"name": "bad", "backend": "pytorchjob", "image": "example.com/fsdpkit:v1", "instance_type": "p5.48xlarge",
        "nodes": 2, "train": {"preset": "tiny", "max_steps": 10}}
UNREACHABLE_KUBECONFIG = ("apiVersion: v1\nkind: Config\ncurrent-context: gone\n"
                          "clusters: [{name: gone, cluster: {server: 'http://127.0.0.1:9'}}]\n"
                          "contexts: [{name: gone, context: {cluster: gone, user: u}}]\n"
                          "users: [{name: u, user: {token: t}}]\n")


def spec(path: Path, **change) -> str:
    doc = {**SPEC, **change}
    path.write_text(json.dumps(doc))  # JSON is YAML
    return str(path)


@pytest.fixture(scope="module")
def inputs(tmp_path_factory) -> Path:
    """The files the cases point at, made once: a real checkpoint, datasets, specs, configs."""
    d = tmp_path_factory.mktemp("inputs")
    r = run_cli("train", *FAST, "--max_steps", "1", "--train_batch_size", "2", "--tensorboard", "0",
                "--run_dir", str(d / "run"), "--checkpoint_dir", str(d / "ckpt"))
    assert r.returncode == 0, r.stderr[-2000:]
    step = d / "ckpt" / "step-00000001"
    shutil.copytree(step, d / "truncated" / "step-00000001")
    shard = d / "truncated" / "step-00000001" / "__0_0.distcp"
    shard.write_bytes(shard.read_bytes()[:64])
    shutil.copytree(step, d / "partial" / ".step-00000002.tmp")
    (d / "partial" / ".step-00000002.tmp" / "fsdpkit.json").unlink()
    (d / "bad-syntax.yaml").write_text("optim:\n  lr: [1, 2\n  max_steps: 3\n")
    (d / "lr-true.yaml").write_text("optim:\n  lr: true\n")
    (d / "steps-true.yaml").write_text("max_steps: true\n")
    (d / "empty-folder").mkdir()
    (d / "no-documents").mkdir()
    (d / "no-documents" / "a.jsonl").write_text("\n\n")
    (d / "small.jsonl").write_text(json.dumps({"text": "a few words"}) + "\n")
    (d / "same-answers.jsonl").write_text("".join(json.dumps({"prompt": p, "chosen": a, "rejected": a}) + "\n"
                                                  for p, a in (("2+2=", "4"), ("Hi", ""))))
    (d / "broken.jsonl").write_text(json.dumps({"text": "fine " * 50}) + "\nnot json\n")
    (d / "hf-bias").mkdir()
    (d / "hf-bias" / "config.json").write_text(json.dumps({
        "model_type": "llama", "architectures": ["LlamaForCausalLM"], "attention_bias": True, "vocab_size": 300,
        "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 8}))
    (d / "hf-empty").mkdir()
    (d / "export-taken").mkdir()
    (d / "export-taken" / "keep.txt").write_text("mine")
    (d / "unreachable.kubeconfig").write_text(UNREACHABLE_KUBECONFIG)
    spec(d / "unknown-field.yaml", colour="blue")
    spec(d / "token-name.yaml", hf_token_env=TOKEN)
    spec(d / "secret-env.yaml", env={"WANDB_API_KEY": "abc123"})
    spec(d / "lr-true-spec.yaml", train={"preset": "tiny", "lr": True})
    spec(d / "bad-train.yaml", train={"preset": "tiny", "n_heads": 3})
    spec(d / "name-bool.yaml", name=True)
    spec(d / "spares-trainjob.yaml", backend="trainjob", queue="team-a", hyperpod={"spares": 1})
    spec(d / "interval-400-digits.yaml", backend="hyperpod", storage={"claim": "fsx"},
         train={"preset": "tiny", "checkpoint_every": "9" * 400})
    spec(d / "interval-zero-time.yaml", storage={"claim": "fsx"}, train={"preset": "tiny", "checkpoint_every": "0m"})
    spec(d / "bad-instance.yaml", instance_type="p9.huge")
    spec(d / "secret-ref-token.yaml", secrets=[{"env": TOKEN, "secret": "s", "key": "k"}])
    spec(d / "qlora-24-ranks.yaml", nodes=3, train={"preset": "llama3_1_8b", "lora": True, "base_dtype": "nf4",
                                                     "init_from_hf": "/fsx/llama"})
    damaged_files(d)
    return d


def damaged_files(d: Path) -> None:
    """Files damaged the way disks, copies and editors damage them (issue 35's families)."""
    noise = bytes(range(256)) * 4
    for folder, name, head in (("zst", "a.jsonl.zst", b"\x28\xb5\x2f\xfd"), ("gz", "a.jsonl.gz", b"\x1f\x8b\x08\x00"),
                               ("parquet", "a.parquet", b"PAR1")):
        (d / folder).mkdir()
        (d / folder / name).write_bytes(head + noise[7:300] + (b"PAR1" if folder == "parquet" else b""))
    r = run_cli("data", "prepare", "--dataset", "embedded", "--out", str(d / "shards"))
    assert r.returncode == 0, r.stderr[-2000:]
    shutil.copytree(d / "shards", d / "shards-cut")
    shard = d / "shards-cut" / "train-00000.bin"
    shard.write_bytes(shard.read_bytes()[:-1])  # not a whole token any more
    shutil.copytree(d / "shards", d / "shards-short")
    shard = d / "shards-short" / "train-00000.bin"
    shard.write_bytes(shard.read_bytes()[:-1000])  # whole tokens, but fewer than meta.json counts
    (d / "binary.yaml").write_bytes(noise)
    (d / "duplicate.yaml").write_text("optim:\n  lr: 0.001\n  lr: 0.1\n")
    (d / "duplicate-spec.yaml").write_text("name: a\nname: b\nbackend: pytorchjob\nimage: x:1\n")
    bomb = "a: &a [x, x, x, x, x, x, x, x, x]\n" + "".join(
        f"{chr(98 + i)}: &{chr(98 + i)} [{', '.join([f'*{chr(97 + i)}'] * 9)}]\n" for i in range(9))
    (d / "bomb.yaml").write_text("name: bomb\nbackend: pytorchjob\nimage: x:1\naffinity:\n"
                                 + "".join(f"  {line}\n" for line in bomb.splitlines()))
    (d / "huge.yaml").write_text("name: huge\nbackend: pytorchjob\nimage: x:1\nlabels:\n"
                                 + "".join(f"  k{i}: v{i}\n" for i in range(300_000)))
    (d / "tok-garbage").mkdir()
    (d / "tok-garbage" / "tokenizer.json").write_text('{"version": "1.0", "model": {"type": "BPE", "vocab": 3')
    (d / "hf-garbage-config").mkdir()
    (d / "hf-garbage-config" / "config.json").write_text("{not json")
    r = run_cli("export", str(d / "ckpt"), str(d / "hf"))
    assert r.returncode == 0, r.stderr[-2000:]
    shutil.copytree(d / "hf", d / "hf-truncated")
    weights = d / "hf-truncated" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-4096])
    shutil.copytree(d / "hf", d / "hf-garbage-weights")
    (d / "hf-garbage-weights" / "model.safetensors").write_bytes(noise)
    shutil.copytree(d / "ckpt" / "step-00000001", d / "garbled" / "step-00000001")
    (d / "garbled" / "step-00000001" / "fsdpkit.json").write_text('{"step": 1, "wor')
    (d / "a-file").write_text("not a checkpoint")
    (d / "garbage.kubeconfig").write_bytes(b"\x00\x01clusters: [\n")
    bad_chat_templates(d)


def bad_chat_templates(d: Path) -> None:
    """Chat templates that go wrong as the bad-input sweep found them (issue 50): one that ignores the
    messages, one that reads a field messages do not have, and two that loop without bound (one
    writing as it loops, one silent)."""
    (d / "chat.jsonl").write_text("".join(json.dumps({"messages": [
        {"role": "user", "content": f"What is {i} plus {i}?"},
        {"role": "assistant", "content": f"It is {2 * i}."}]}) + "\n" for i in range(40)))
    (d / "ignores.jinja").write_text("{% for m in messages %}<|turn|>{% endfor %}")
    (d / "no-such-field.jinja").write_text("{% for m in messages %}<|{{ m.role }}|>{{ m.text }}\n{% endfor %}"
                                           "{% if add_generation_prompt %}<|assistant|>{% endif %}")
    (d / "loops.jinja").write_text("{% for m in messages %}{% for i in range(100000) %}{% for j in range(100000) %}"
                                   "{{ m.content }}{% endfor %}{% endfor %}{% endfor %}")
    (d / "loops-silently.jinja").write_text("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}"
                                            "{% endfor %}{{ messages[0].content }}")


def chat_case(template: str, says: str, *more: str) -> tuple[list[str], int, str]:
    """Training on the chat records of `bad_chat_templates` with one of its templates."""
    return (["train", *FAST, "--dataset", "{in}/chat.jsonl", "--data-format", "chat", "--chat-template",
             f"{{in}}/{template}", *more], 2, says)


# id -> (argv with {in} for the inputs folder, exit code, what the one line says)
CASES = {
    # the MCP server takes no arguments: a stray one is refused before it serves anything
    "mcp-argument": (["mcp", "--port", "8080"], 2, "unrecognized arguments: --port 8080"),
    # train: values and flags
    "lr-nan": (["train", "--lr", "nan"], 2, "lr: expected a finite number, got 'nan'"),
    "lr-inf-nproc": (["train", "--nproc", "2", "--lr", "inf"], 2, "lr: expected a finite number"),
    "lr-negative": (["train", "--lr", "-1"], 2, "lr: -1.0 is out of range; it must be >= 0"),
    "steps-zero": (["train", "--max_steps", "0"], 2, "max_steps: 0 is out of range"),
    "steps-fraction": (["train", "--max_steps", "1.5"], 2, "max_steps: expected an integer"),
    "yaml-syntax": (["train", "--config", "{in}/bad-syntax.yaml"], 2, "is not valid YAML: line 3, column"),
    "yaml-lr-bool": (["train", "--config", "{in}/lr-true.yaml"], 2, "lr: expected a number, got True"),
    "yaml-steps-bool": (["train", "--config", "{in}/steps-true.yaml"], 2, "max_steps: expected an integer, got True"),
    "heads-divide": (["train", "--n_heads", "3"], 2, "n_heads: 3 must divide dim"),
    "precision-choice": (["train", "--mixed_precision", "fp16"], 2, "mixed_precision"),
    "near-miss-flag": (["train", "--max_stpes", "5"], 2, "did you mean --max-steps"),
    "resume-auto-no-dir": (["train", "--resume_from_checkpoint", "auto"], 2, "needs --checkpoint-dir"),
    "float8-cpu": (["train", "--float8", "1", "--device", "cpu"], 2, "float8: needs an NVIDIA GPU"),
    "warmup-past-end": (["train", "--max_steps", "10", "--warmup_steps", "50"], 2, "warmup_steps: 50 must be <="),
    "config-missing": (["train", "--config", "{in}/none.yaml"], 2, "file not found"),
    # Refused before the model is built and anything is written (it stopped a run after its start).
    "mlflow-without-uri": (["train", "--tracker", "mlflow", "--run_dir", "run"], 2,
                           "--tracker mlflow: set MLFLOW_TRACKING_URI"),
    # LoRA's options without --lora were read by nothing: the run trained the whole model.
    "lora-rank-without-lora": (["train", "--lora_rank", "8"], 2,
                               "lora_rank: a LoRA option, but this run trains the whole model; add --lora 1, or "
                               "drop --lora-rank"),
    # A checkpoint interval that never saves, or one no run reaches (a typo), is refused: only 0 means
    # the last step only.
    "checkpoint-every-zero-time": (["train", "--checkpoint_every", "0m", "--checkpoint_dir", "ck"], 2,
                                   "checkpoint_every: a wall time of 0m would never checkpoint; give 0 for the last "
                                   "step only"),
    "checkpoint-every-past-a-year": (["train", "--checkpoint_every", "400d", "--checkpoint_dir", "ck"], 2,
                                     "checkpoint_every: '400d' is out of range: at most 2147483647 steps or 365d"),
    # data
    "dataset-missing": (["train", "--dataset", "{in}/none.jsonl"], 2, "none.jsonl not found"),
    "dataset-no-files": (["train", "--dataset", "{in}/empty-folder"], 2, "no .jsonl/.json/.parquet/.txt files"),
    "dataset-no-documents": (["train", "--dataset", "{in}/no-documents"], 2, "has no documents in its 'train' split"),
    "dataset-too-small": (["train", "--dataset", "{in}/small.jsonl", "--seq_len", "512"], 2,
                          "holds fewer than 513 tokens (1 document(s), 12 tokens); lower seq_len"),
    "bad-record-fail": (["train", "--dataset", "{in}/broken.jsonl", "--on_bad_record", "fail", "--seq_len", "16",
                         "--max_steps", "1"], 2, "broken.jsonl:2: not JSON (use --on-bad-record skip"),
    "tokenizer-missing": (["train", "--tokenizer", "./no-such-tokenizer"], 2,
                          "tokenizer: ./no-such-tokenizer not found"),
    "prepare-missing": (["data", "prepare", "--dataset", "{in}/none.jsonl", "--out", "shards"], 2, "not found"),
    "tokenizer-vocab-zero": (["tokenizer", "train", "--dataset", "{in}/small.jsonl", "--vocab_size", "0",
                              "--out", "tok"], 2, "vocab_size"),
    # checkpoints and Hugging Face weights
    "resume-truncated": (["train", *FAST, "--resume_from_checkpoint", "{in}/truncated/step-00000001"], 2,
                         "__0_0.distcp is truncated (64 of"),
    "resume-partial": (["train", *FAST, "--resume_from_checkpoint", "{in}/partial/.step-00000002.tmp"], 2,
                       "is not a complete fsdpkit checkpoint"),
    "resume-other-shape": (["train", *FAST, "--n_layers", "3", "--resume_from_checkpoint", "{in}/ckpt"], 2,
                           "holds a model of another shape: n_layers 4 (this run: 3)"),
    # The checkpoint directory's lock file (a run made it) keeps its bytes and time: it names the
    # last run that started, not this refused one.
    "resume-auto-other-shape": (["train", *FAST, "--n_layers", "3", "--checkpoint_dir", "{in}/ckpt", "--resume",
                                 "auto", "--run_dir", "run"], 2, "another shape: n_layers 4 (this run: 3)"),
    # HyperPod's renaming of the instance type is a note, said only for a spec that is accepted.
    "hyperpod-renamed-then-refused": (["job", "render", str(ROOT / "examples" / "jobs" / "hyperpod-p5.yaml"), "--set",
                                       "instance_type=p5.48xlarge", "--set", "nodes=0"], 2, "nodes: '0' must be >= 1"),
    "resume-other-shape-nproc": (["train", *FAST, "--nproc", "2", "--n_layers", "3", "--resume_from_checkpoint",
                                  "{in}/ckpt", "--run_dir", "run"], 2, "another shape"),
    "ckpt-show-missing": (["ckpt", "show", "{in}/none"], 2, "none"),
    "export-missing": (["export", "{in}/none", "out"], 2, "no complete checkpoint"),
    "export-taken": (["export", "{in}/ckpt", "{in}/export-taken"], 2, "exists and is not empty"),
    "export-peft-of-full": (["export", "{in}/ckpt", "out", "--to", "peft"], 2, "trained the whole model, not LoRA"),
    "eval-not-a-model": (["eval", "{in}", "--tasks", "hellaswag"], 2, "not a Hugging Face model directory"),
    "chat-on-embedded": (["train", "--data-format", "chat"], 2, "the embedded corpus is plain text"),
    # chat templates that would train on nothing, or never finish (each refused by the preflight)
    "chat-template-ignores-messages": chat_case(
        "ignores.jinja", "chat_template: {in}/ignores.jinja leaves answer 1 of {in}/chat.jsonl:1 ('It is 0.') out of "
        "the text it trains on; check that it renders each message's content"),
    "chat-template-no-such-field": chat_case(
        "no-such-field.jinja", "chat_template: {in}/no-such-field.jinja leaves answer 1 of {in}/chat.jsonl:1 "
        "('It is 0.') out of the text it trains on; check that it renders each message's content",
        "--nproc", "2", "--run_dir", "run"),
    "chat-template-loops": chat_case(
        "loops.jinja", "chat_template: {in}/loops.jinja wrote more than 1050240 characters for {in}/chat.jsonl:1, "
        "which holds 104 characters: it loops without bound; check the template"),
    "chat-template-loops-silently": chat_case(
        "loops-silently.jinja", "chat_template: {in}/loops-silently.jinja did not finish rendering "
        "{in}/chat.jsonl:1 within 5 s: it loops without bound; check the template"),
    "lora-without-base": (["train", "--lora", "1"], 2, "pass --init-from-hf"),
    "nf4-without-lora": (["train", "--base-dtype", "nf4"], 2, "base_dtype: nf4 stores the frozen base of a LoRA run "
                         "(QLoRA); pass --lora 1, or drop --base-dtype to train the whole model"),
    "context-parallel-over-nproc": (["train", *FAST, "--nproc", "2", "--context-parallel", "4", "--run_dir", "run"], 2,
                                    "context_parallel: 4 must divide the processes on each node (2): the ranks that "
                                    "share a sequence sit on one node"),
    "expert-parallel-over-ranks": (["train", *FAST, "--family", "mixtral", "--n-experts", "4", "--nproc", "2",
                                    "--expert-parallel", "4", "--run_dir", "run"], 2,
                                   "expert_parallel: 4 must divide the ranks of the run (2): each group of 4 "
                                   "consecutive ranks holds every expert once"),
    "context-parallel-dpo": (["train", "--objective", "dpo", "--data-format", "preference", "--context-parallel", "2"],
                             2, "context_parallel: dpo sums each answer's log-probabilities over the whole sequence; "
                             "train it without --context-parallel"),
    # The tiny export's 128 x 128 q_proj over 2 ranks: 64 x 128, half an NF4 block group each.
    "nf4-blocks-over-ranks": (["train", *FAST, "--init_from_hf", "{in}/hf", "--lora", "1", "--base-dtype", "nf4",
                               "--nproc", "2", "--run_dir", "run"], 2,
                              "base_dtype: nf4 stores q_proj (128 x 128) in blocks of 16384 elements, and over 2 "
                              "shard rank(s) each rank's rows (64 x 128) are no whole number of them; use a rank "
                              "count that divides them so, or --base-dtype auto"),
    "nf4-job-over-24-ranks": (["job", "render", "{in}/qlora-24-ranks.yaml"], 2,
                              "train.base_dtype: nf4 stores q_proj (4096 x 4096) in blocks of 16384 elements, and "
                              "over 24 shard rank(s) each rank's rows (170.667 x 4096)"),
    "hf-bias": (["train", "--init_from_hf", "{in}/hf-bias"], 2, "uses attention_bias"),
    "preset-of-another-family": (["train", "--preset", "qwen2_5_0_5b", "--init_from_hf", "{in}/hf"], 2,
                                 "preset: qwen2_5_0_5b is a qwen2 model and {in}/hf holds a llama one (its "
                                 "config.json); drop --preset to train the weights as they are, or pick a llama "
                                 "preset"),
    "hf-no-config": (["train", "--init_from_hf", "{in}/hf-empty"], 2, "no config.json"),
    # job specs
    "spec-unknown-field": (["job", "render", "{in}/unknown-field.yaml"], 2, "colour: unknown field"),
    "spec-nodes-zero": (["job", "render", "{in}/unknown-field.yaml", "--set", "colour=", "--set", "nodes=0"], 2, ""),
    "spec-token-as-name": (["job", "render", "{in}/token-name.yaml"], 2, "hf_token_env: looks like a token"),
    "spec-secret-ref-token": (["job", "render", "{in}/secret-ref-token.yaml"], 2, "secrets[0].env: looks like a token"),
    "spec-secret-in-env": (["job", "render", "{in}/secret-env.yaml"], 2, "env.WANDB_API_KEY: looks like a secret"),
    "spec-train-lr-bool": (["job", "render", "{in}/lr-true-spec.yaml"], 2, "train.lr: expected a number, got True"),
    "spec-set-bad-yaml": (["job", "render", "{in}/lr-true-spec.yaml", "--set", "image=["], 2,
                          "--set image: the value is not valid YAML: line 1"),
    "spec-instance": (["job", "render", "{in}/bad-instance.yaml"], 2, "p9.huge"),
    "spec-missing": (["job", "render", "{in}/none.yaml"], 2, "file not found"),
    "spec-name-bool": (["job", "render", "{in}/name-bool.yaml"], 2,
                       "name: expected a name in quotes or plain letters, got True"),
    "spec-interval-400-digits": (["job", "render", "{in}/interval-400-digits.yaml"], 2,
                                 "train.checkpoint_every: '99999999999999999999...' is out of range"),
    "spec-interval-zero-time": (["job", "render", "{in}/interval-zero-time.yaml"], 2,
                                "train.checkpoint_every: a wall time of 0m would never checkpoint"),
    "spec-submit-bad-train": (["job", "submit", "{in}/bad-train.yaml"], 2, "train.n_heads: 3 must divide dim"),
    # cluster (Kubernetes)
    "kube-no-kubeconfig": (["cluster", "check", "--kubeconfig", "{in}/none"], 3, "no kubeconfig at"),
    "kube-unreachable": (["cluster", "check", "--kubeconfig", "{in}/unreachable.kubeconfig"], 3,
                         "cannot reach the Kubernetes API"),
    "kube-unreachable-submit": (["job", "submit", "{in}/lr-true-spec.yaml", "--set", "train.lr=0.1",
                                 "--set", "storage.claim=fsx", "--kubeconfig", "{in}/unreachable.kubeconfig"], 3,
                                "cannot reach the Kubernetes API"),
    "kube-context": (["cluster", "check", "--kubeconfig", "{in}/unreachable.kubeconfig", "--context", "nope"], 3,
                     "nope"),
    "eks-no-region": (["cluster", "check", "--eks-cluster", "x"], 2, "--eks-cluster needs --region"),
    # AWS
    "aws-no-credentials-check": (["cluster", "check", "--eks-cluster", "x", "--region", "us-west-2"], 3,
                                 "no AWS credentials found"),
    "aws-no-credentials-validate": (["cluster", "validate", "gpu", "--eks-cluster", "x", "--region",
                                     "us-west-2"], 3, "no AWS credentials found"),
    "aws-no-credentials-addons": (["cluster", "addons", "install", "--eks-cluster", "x", "--region", "us-west-2"],
                                  3, "no AWS credentials found"),
    "aws-no-credentials-infra": (["infra", "status", "--region", "us-west-2"], 3, "no AWS credentials found"),
    "fsx-too-small": (["storage", "fsx", "create", "ckpt", "--size", "3000"], 2, "size"),
    # damaged files (issue 35): one line naming the file, whatever the decoder raised
    "data-zst-corrupt": (["train", *FAST, "--dataset", "{in}/zst"], 2, "dataset: cannot read {in}/zst/a.jsonl.zst"),
    "data-gz-corrupt": (["train", *FAST, "--dataset", "{in}/gz"], 2, "dataset: cannot read {in}/gz/a.jsonl.gz"),
    "data-parquet-corrupt": (["train", *FAST, "--dataset", "{in}/parquet"], 2,
                             "dataset: cannot read {in}/parquet/a.parquet"),
    "data-prepare-corrupt": (["data", "prepare", "--dataset", "{in}/gz", "--out", "shards"], 2,
                             "dataset: cannot read {in}/gz/a.jsonl.gz"),
    "shards-cut": (["train", *FAST, "--dataset", "{in}/shards-cut"], 2,
                   "dataset: cannot read {in}/shards-cut/train-00000.bin"),
    "shards-short": (["train", *FAST, "--dataset", "{in}/shards-short"], 2, "(a shard is truncated or replaced)"),
    "config-binary": (["train", "--config", "{in}/binary.yaml"], 2, "binary.yaml is not text"),
    "config-duplicate-key": (["train", "--config", "{in}/duplicate.yaml"], 2, "'lr' is given twice"),
    "spec-duplicate-key": (["job", "render", "{in}/duplicate-spec.yaml"], 2, "'name' is given twice"),
    "spec-alias-bomb": (["job", "render", "{in}/bomb.yaml"], 2, "aliases expand to more than"),
    "spec-huge": (["job", "render", "{in}/huge.yaml"], 2, "fsdpkit reads YAML files of up to 4 MiB"),
    "tokenizer-garbage": (["train", *FAST, "--tokenizer", "{in}/tok-garbage"], 2,
                          "tokenizer: cannot read {in}/tok-garbage/tokenizer.json"),
    "hf-garbage-config": (["train", *FAST, "--init_from_hf", "{in}/hf-garbage-config"], 2,
                          "init_from_hf: cannot read {in}/hf-garbage-config/config.json"),
    "hf-truncated-weights": (["train", *FAST, "--init_from_hf", "{in}/hf-truncated"], 2,
                             "init_from_hf: cannot read {in}/hf-truncated/model.safetensors"),
    "hf-garbage-weights": (["train", *FAST, "--init_from_hf", "{in}/hf-garbage-weights"], 2,
                           "init_from_hf: cannot read {in}/hf-garbage-weights/model.safetensors"),
    "hf-garbage-weights-nproc": (["train", *FAST, "--nproc", "2", "--init_from_hf", "{in}/hf-garbage-weights",
                                  "--run_dir", "run"], 2, "cannot read {in}/hf-garbage-weights/model.safetensors"),
    "resume-garbled-meta": (["train", *FAST, "--resume_from_checkpoint", "{in}/garbled/step-00000001"], 2,
                            "is damaged and cannot be read (fsdpkit.json cannot be read"),
    "ckpt-latest-garbled": (["ckpt", "latest", "{in}/garbled"], 2, "no complete checkpoint"),
    "ckpt-show-garbled": (["ckpt", "show", "{in}/garbled/step-00000001"], 2,
                          "ckpt show: {in}/garbled/step-00000001 is damaged and cannot be read ("),
    # A checkpoint named by its step that is not there is a typo, not a first run: refused (a root
    # that does not exist yet still starts fresh, test_checkpoint's empty-directory case).
    "resume-named-step-missing": (["train", *FAST, "--resume_from_checkpoint", "{in}/ckpt/step-00000009"], 2,
                                  "resume_from_checkpoint: no checkpoint {in}/ckpt/step-00000009; fsdpkit ckpt list "
                                  "{in}/ckpt shows the ones there"),
    "export-garbled": (["export", "{in}/garbled", "out"], 2, "no complete checkpoint"),
    # Pairs that teach DPO nothing (the same answer twice, two empty answers): nothing to train on.
    "dpo-same-answers": (["train", *FAST, "--objective", "dpo", "--data-format", "preference", "--dataset",
                          "{in}/same-answers.jsonl", "--run-dir", "run"], 2,
                         "dataset: {in}/same-answers.jsonl has no preference records in its 'train' split (2 bad "
                         "records skipped, 2 of them pairs whose chosen and rejected answers are the same)"),
    "spares-on-trainjob": (["job", "render", "{in}/spares-trainjob.yaml"], 2,
                           "hyperpod.spares: is a field of HyperPod's training operator"),
    "preview-no-records": (["data", "preview", "--records", "0"], 2, "records: 0 is out of range; preview 1..100"),
    "preview-no-pairs": (["data", "preview", "--dataset", "{in}/small.jsonl", "--data-format", "preference"], 2,
                         "data preview: {in}/small.jsonl gave no usable record; check --dataset, --data-format"),
    # Named, it is the export's checkpoint and its own words, not resume's.
    "export-garbled-named": (["export", "{in}/garbled/step-00000001", "out"], 2,
                             "export: {in}/garbled/step-00000001 is damaged and cannot be read (fsdpkit.json cannot "
                             "be read (JSONDecodeError)); pass its parent directory to export the newest checkpoint"),
    # The only checkpoint truncated: the error alone, no "exporting an older checkpoint" before it.
    "export-truncated-only": (["export", "{in}/truncated", "out"], 2,
                              "export: every checkpoint in {in}/truncated is damaged (__0_0.distcp is truncated "
                              "(64 of"),
    "export-into-file": (["export", "{in}/ckpt", "{in}/a-file"], 2, "is a file; choose a new directory"),
    "resume-from-file": (["train", *FAST, "--resume_from_checkpoint", "{in}/a-file"], 2,
                         "is a file, not a checkpoint"),
    "vocab-too-large": (["train", "--vocab_size", "100000000000"], 2, "vocab_size: 100000000000 is out of range"),
    "kubeconfig-garbage": (["cluster", "check", "--kubeconfig", "{in}/garbage.kubeconfig"], 2,
                           "kubeconfig: cannot read {in}/garbage.kubeconfig"),
    "tokenizer-into-checkpoints": (["tokenizer", "train", "--dataset", "{in}/small.jsonl", "--vocab_size", "300",
                                    "--out", "{in}/ckpt"], 2, "holds checkpoints"),
    # checks that can run in the launcher run there: no runs/ folder, no worker started
    "nproc-bad-replicate": (["train", *FAST, "--nproc", "2", "--sharding_strategy", "hybrid", "--dp_replicate", "3"],
                            2, "dp_replicate: 3 must divide"),
    "nproc-float8-cpu": (["train", *FAST, "--nproc", "2", "--float8", "1", "--device", "cpu"], 2, "float8: needs"),
    # No look at the hub client's half minute of retries: one look at the hub's host, then its cache.
    "hub-tokenizer-unreachable": (["train", *FAST, "--tokenizer", "fsdpkit-tests/no-such-tokenizer"], 3,
                                  "tokenizer: 'fsdpkit-tests/no-such-tokenizer' is not in the Hugging Face cache here "
                                  "and the hub (https://huggingface.co) cannot be reached; point --tokenizer at a "
                                  "local directory with tokenizer.json, or run once where the hub can be reached"),
}
# Cases that reach an endpoint that is down: AWS credentials are given, the endpoint refuses.
UNREACHABLE_AWS = {
    "aws-unreachable-check": (["cluster", "check", "--eks-cluster", "x", "--region", "us-west-2"], 3,
                              "cannot reach AWS"),
    "aws-unreachable-infra": (["infra", "status", "--region", "us-west-2"], 3, "cannot reach AWS"),
}


def _tree(*roots: Path) -> dict[str, tuple[int, int]]:
    return {str(p): (p.stat().st_size, p.stat().st_mtime_ns) for root in roots for p in root.rglob("*")}


def _run(argv: list[str], inputs: Path, cwd: Path, env: dict[str, str]) -> subprocess.CompletedProcess:
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "KUBECONFIG", "FSDPKIT_"))}
    clean.update({"PYTHONUNBUFFERED": "1", "FSDPKIT_HOME": str(cwd / "home"), "HOME": str(cwd),
                  "AWS_CONFIG_FILE": str(cwd / "no-aws-config"), "AWS_SHARED_CREDENTIALS_FILE": str(cwd / "none"),
                  "AWS_EC2_METADATA_DISABLED": "true", "AWS_MAX_ATTEMPTS": "1", "KUBECONFIG": str(cwd / "none"),
                  **env})
    args = [a.replace("{in}", str(inputs)) for a in argv]
    return fsdpkit_process(args, clean, cwd, timeout=180)


def _check(r: subprocess.CompletedProcess, code: int, says: str, before: dict, after: dict) -> None:
    lines = r.stderr.strip().splitlines()
    assert r.returncode == code, (r.returncode, r.stderr[-3000:])
    assert len(lines) == 1 and lines[0].startswith("error: "), r.stderr[-3000:]
    assert not r.stdout, r.stdout[-3000:]   # the error is the only line: no note before it
    assert says in lines[0], lines[0]
    assert "Traceback" not in r.stdout + r.stderr
    assert TOKEN not in r.stdout + r.stderr  # a value that looked like a token is never echoed
    assert after == before, sorted(set(after.items()) ^ set(before.items()))[:5]


@pytest.mark.parametrize("case", sorted(CASES))
def test_bad_input_is_one_line_with_its_exit_code_and_writes_nothing(case, inputs, tmp_path):
    argv, code, says = CASES[case]
    before = _tree(inputs, tmp_path)
    r = _run(argv, inputs, tmp_path, {})
    _check(r, code, says.replace("{in}", str(inputs)), before, _tree(inputs, tmp_path))


@pytest.mark.parametrize("case", sorted(UNREACHABLE_AWS))
def test_an_aws_endpoint_that_is_down_is_one_line(case, inputs, tmp_path):
    argv, code, says = UNREACHABLE_AWS[case]
    env = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
           "FSDPKIT_AWS_ENDPOINT_URL": "http://127.0.0.1:9"}
    before = _tree(inputs, tmp_path)
    _check(_run(argv, inputs, tmp_path, env), code, says, before, _tree(inputs, tmp_path))
    r = _run([*argv, "--json"], inputs, tmp_path, env)
    assert r.returncode == code
    error = json.loads(r.stdout)["error"]
    assert error["code"] == "unreachable" and says in error["message"]


def test_nothing_reaches_the_cluster_from_a_bad_spec(inputs, tmp_path):
    """A spec the trainer would refuse is refused before submission: the API server sees no write."""
    kube = KubeMock(tmp_path)
    try:
        r = _run(["job", "submit", "{in}/bad-train.yaml", "--json"], inputs, tmp_path, kube.env)
        assert r.returncode == 2 and json.loads(r.stdout)["error"]["message"].startswith("train.n_heads")
        assert [m for m, _p, _b in kube.requests() if m in ("POST", "PUT", "PATCH", "DELETE")] == []
        r = _run(["job", "status", "nope", "--backend", "pytorchjob", "--json"], inputs, tmp_path, kube.env)
        assert r.returncode != 0 and json.loads(r.stdout)["ok"] is False
    finally:
        kube.close()


def test_no_credentials_under_json_is_an_envelope(inputs, tmp_path):
    r = _run(["cluster", "check", "--eks-cluster", "x", "--region", "us-west-2", "--json"], inputs, tmp_path, {})
    assert r.returncode == 3 and r.stderr == ""
    error = json.loads(r.stdout)["error"]
    assert error["code"] == "no_credentials" and "no AWS credentials found" in error["message"]
    assert error["hint"].startswith("run `aws configure`")


def test_read_only_places_are_one_line(inputs, tmp_path):
    """A read-only FSDPKIT_HOME and a read-only export target (a read-only bind mount in a mount
    namespace of the command's own: permissions alone do not stop root, which CI runs as)."""
    if shutil.which("unshare") is None or subprocess.run(
            ["unshare", "--mount", "sh", "-c", f"mount --bind {tmp_path} {tmp_path}"], capture_output=True).returncode:
        pytest.skip("this machine cannot make a read-only bind mount in a mount namespace")
    ro = tmp_path / "ro"
    (ro / "home").mkdir(parents=True)
    (ro / "out").mkdir()
    spec(tmp_path / "local.yaml", backend="local", nodes=1, instance_type=None, image=None)
    for argv, says in ((["job", "submit", str(tmp_path / "local.yaml")], f"FSDPKIT_HOME: cannot create {ro / 'home'}"),
                       (["export", str(inputs / "ckpt"), str(ro / "out" / "hf")],
                        f"export: cannot write to {ro / 'out'} (read-only, or no permission)")):
        r = subprocess.run(["unshare", "--mount", "sh", "-c", 'mount --bind "$0" "$0" && mount -o remount,bind,ro "$0" '
                            '&& exec "$@"', str(ro), sys.executable, "-m", "fsdpkit", *argv],
                           capture_output=True, text=True, env={**os.environ, "FSDPKIT_HOME": str(ro / "home")},
                           cwd=tmp_path, timeout=180)
        assert r.returncode == 2 and r.stderr.splitlines() == [r.stderr.strip()], r.stderr[-2000:]
        assert r.stderr.startswith(f"error: {says}"), r.stderr


def test_tokenizer_train_from_bad_records_only_trains_nothing(inputs, tmp_path):
    """Every record bad: one error that counts the skips (the skip warnings are said only when a
    usable document follows them); no tokenizer."""
    r = _run(["tokenizer", "train", "--dataset", "{in}/broken.jsonl", "--text_field", "nope", "--vocab_size", "300",
              "--out", "tok"], inputs, tmp_path, {})
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr.splitlines() == [f"error: tokenizer train: {inputs}/broken.jsonl gave no usable document (2 bad "
                                     "record(s) skipped); check --dataset and --text-field"]
    assert not (tmp_path / "tok").exists()


def test_yaml_reads_yes_and_on_as_strings_as_kubectl_does(tmp_path):
    """`name: yes` was a job named 'true' (YAML 1.1's booleans); booleans still take yes and on."""
    from fsdpkit.jobs.spec import load_spec

    (tmp_path / "job.yaml").write_text("name: yes\nbackend: pytorchjob\nimage: x:1\ntrain: {compile: on}\n")
    job = load_spec(tmp_path / "job.yaml")
    assert job.name == "yes" and job.train["compile"] == "on"


def test_the_table_is_wide():
    assert len(CASES) + len(UNREACHABLE_AWS) >= 40
    assert {argv[0] for argv, _, _ in CASES.values()} >= {"train", "data", "tokenizer", "ckpt", "export", "job",
                                                           "cluster", "infra", "storage"}


def test_a_refused_training_option_is_said_before_torch_is_imported():
    """`fsdpkit train` with a value out of range answers from the config alone: torch (2 s and more
    to import) loads only once a run starts."""
    code = ("import sys; from fsdpkit.cli.main import main; code = main(['train', '--lr', '-1']); "
            "print(code, 'torch' in sys.modules)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert r.stdout.split() == ["2", "False"], r.stdout + r.stderr
    assert r.stderr == "error: lr: -1.0 is out of range; it must be >= 0.0\n"
