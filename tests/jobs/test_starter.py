"""Starter specs and the defaults a cluster job gets: `job init` writes every field and reads back as
the spec it was asked for; the examples ship in the package; a job with storage checkpoints
periodically by default; HyperPod's `ml.` instance names."""

from __future__ import annotations

import json
import re

import pytest
import yaml

from fsdpkit.errors import UserError
from fsdpkit.jobs.resolved import resolve
from fsdpkit.jobs.spec import BACKENDS, JobSpec, load_spec_dict
from fsdpkit.jobs.starter import example, examples, spec_examples, starter
from fsdpkit.plan.grace import cadence
from fsdpkit.train.config import parse_args
from fsdpkit.train.model.presets import get_preset

from conftest import run_cli

IMAGE = "123456789012.dkr.ecr.us-west-2.amazonaws.com/fsdpkit:v1"


@pytest.mark.parametrize("backend", BACKENDS)
def test_init_writes_every_field_and_reads_back_as_asked(backend):
    nodes = "1" if backend == "local" else "2"
    storage = {"shared_path": "/fsx"} if backend == "slurm" else {"claim": "fsx-claim"} if backend != "local" else {}
    text = starter(backend, "my-run", "p5.48xlarge" if backend != "local" else None, nodes, IMAGE, "llama3_1_8b",
                   storage.get("claim"), storage.get("shared_path"), "allenai/c4")
    for field in JobSpec.model_fields:
        if field not in ("hyperpod", "trainjob", "slurm") or field == backend:
            assert f"{field}:" in text, field
    spec = load_spec_dict(yaml.safe_load(text))
    assert (spec.name, spec.backend, spec.image, str(spec.nodes)) == ("my-run", backend, IMAGE, nodes)
    assert spec.train == {"preset": "llama3_1_8b", "dataset": "allenai/c4"}
    assert spec.instance_type == {"local": None, "hyperpod": "ml.p5.48xlarge"}.get(backend, "p5.48xlarge")
    # Each line with a value or a commented default says what the field is.
    fields = [line for line in text.splitlines() if re.match(r"^\s*(# )?[a-z_]+:( |$)", line)]
    assert len(fields) > 40 and all(" # " in line for line in fields), [x for x in fields if " # " not in x]


def test_the_commented_defaults_are_the_real_ones():
    text = starter("pytorchjob", "j", "p5.48xlarge", "4", IMAGE, "llama3_1_8b", "fsx-claim")
    # The preset's recipe and the job's own checkpoint interval, not the trainer's bare defaults.
    assert "  # seq_len: 8192 " in text and "  # lr: 0.0003 " in text
    every = cadence(get_preset("llama3_1_8b")).every
    assert f"  # checkpoint_every: {every} " in text and "\n# max_restarts: 3 " in text


def test_init_to_stdout_under_json_keeps_the_envelope():
    r = run_cli("job", "init", "--backend", "slurm", "--out", "-", "--json")
    assert r.returncode == 0, r.stderr
    data = json.loads(r.stdout)["data"]   # stdout is one JSON document, the spec inside it
    assert data["path"] is None and load_spec_dict(yaml.safe_load(data["text"])).backend == "slurm"


def test_slurm_on_hyperpod_auto_resumes_and_runs_in_the_image_init_names():
    """`job init --image` on Slurm runs srun in that image (pyxis's REGISTRY#IMAGE form; it was
    dropped without a word), and HyperPod's ml. instance names turn on srun --auto-resume=1."""
    from fsdpkit.jobs.backends.slurm import script

    text = starter("slurm", "hp", "ml.p5.48xlarge", "2", IMAGE, shared_path="/fsx")
    spec = load_spec_dict(yaml.safe_load(text))
    assert spec.slurm.hyperpod is True and spec.image == IMAGE
    srun = next(line for line in script(resolve(spec)).splitlines() if line.startswith("srun "))
    assert srun.startswith("srun --kill-on-bad-exit=1 --auto-resume=1 --container-image="
                           "'123456789012.dkr.ecr.us-west-2.amazonaws.com#fsdpkit:v1' --container-mounts=/fsx:/fsx ")
    plain = load_spec_dict(yaml.safe_load(starter("slurm", "p", "p5.48xlarge", "2", "nvcr.io/nvidia/pytorch:25.01-py3",
                                                  shared_path="/fsx")))
    srun = next(line for line in script(resolve(plain)).splitlines() if line.startswith("srun "))
    assert "--auto-resume" not in srun and "--container-image='nvcr.io#nvidia/pytorch:25.01-py3'" in srun
    # Docker Hub names have no registry part; an explicit container_image wins.
    assert load_spec_dict({"name": "d", "backend": "slurm", "image": "pytorch/pytorch:2.6"}).slurm.image(
        "pytorch/pytorch:2.6") == "pytorch/pytorch:2.6"


def test_a_launcher_option_under_train_is_refused_for_the_spec_s_own_field():
    """`train.max_restarts` lost silently to the spec's max_restarts on a cluster (and won locally)."""
    with pytest.raises(UserError, match=r"^train.max_restarts: a job's launcher takes this from the spec; set "
                                        r"max_restarts: 5 \(a top-level field\) and drop train.max_restarts$"):
        load_spec_dict({"name": "j", "backend": "pytorchjob", "image": IMAGE, "train": {"max_restarts": 5}})
    with pytest.raises(UserError, match=r"^train.nproc: .* set procs_per_node: 4"):
        load_spec_dict({"name": "j", "train": {"parallel": {"nproc": 4}}})


def test_init_refuses_to_overwrite_and_bad_values_write_nothing(tmp_path):
    out = tmp_path / "job.yaml"
    r = run_cli("job", "init", "--backend", "pytorchjob", "--image", IMAGE, "--out", str(out), "--json")
    assert r.returncode == 0 and json.loads(r.stdout)["data"]["path"] == str(out)
    r = run_cli("job", "init", "--out", str(out), "--json")
    error = json.loads(r.stdout)["error"]
    assert r.returncode == 2 and error["code"] == "conflict" and "--force" in error["hint"]
    r = run_cli("job", "init", "--nodes", "0", "--out", str(tmp_path / "bad.yaml"))
    assert r.returncode == 2 and r.stderr.startswith("error: nodes") and not (tmp_path / "bad.yaml").exists()


def test_examples_ship_with_the_package_and_each_is_a_valid_spec():
    found = examples()
    assert {"eks-p5", "hyperpod-p5", "trainjob-p5", "slurm-p5", "local-tiny", "ray-p5", "requirements"} <= set(found)
    assert all(d and not d.endswith(":") for d in found.values())
    assert set(spec_examples()) == set(found) - {"requirements"}
    for name in spec_examples():
        load_spec_dict(yaml.safe_load(example(name)))
    # Named with its suffix or without, as a reader copies it from a path.
    assert example("requirements.txt") == example("requirements")
    wanted = [r for r in example("requirements").splitlines() if not r.startswith("#")]
    assert wanted == ["datasets>=3.0", "wandb>=0.19"]
    r = run_cli("examples", "show", "nope", "--json")
    assert r.returncode == 2 and json.loads(r.stdout)["error"]["code"] == "not_found"


def _every(spec: JobSpec) -> str | None:
    flags = resolve(spec).flags()
    cfg = parse_args(flags)
    return cfg.checkpoint.checkpoint_every


def test_a_job_with_storage_checkpoints_periodically_by_default():
    base = {"name": "j", "backend": "pytorchjob", "image": IMAGE, "instance_type": "p5.48xlarge", "nodes": 4,
            "train": {"preset": "llama3_1_8b"}}
    on_fsx = load_spec_dict({**base, "storage": {"claim": "fsx", "write_mb_per_s": 1200}})
    # 96.4 GB at 1,200 MB/s is 80 s of writing: saving <= 5% of the time means every 27 min.
    assert _every(on_fsx) == "27m"
    assert _every(load_spec_dict({**base, "storage": {"claim": "fsx"}})) == "65m"  # a slower volume
    # The spec's own interval wins (steps or time), and 0 keeps only the last step's checkpoint.
    for given in ("500", "30m", "0"):
        spec = load_spec_dict({**base, "storage": {"claim": "fsx"}, "train": {"preset": "llama3_1_8b",
                                                                              "checkpoint_every": given}})
        assert _every(spec) == given
    # Without storage there is nowhere to keep them: none, and asking for them is refused.
    assert _every(load_spec_dict(base)) == "0"
    with pytest.raises(UserError, match=r"train\.checkpoint_every is set but the job has no storage"):
        load_spec_dict({**base, "train": {"preset": "llama3_1_8b", "checkpoint_every": "30m"}})


def test_hyperpod_instance_types_are_named_with_ml(capfd):
    spec = load_spec_dict({"name": "j", "backend": "hyperpod", "image": IMAGE, "instance_type": "p5.48xlarge"})
    assert spec.instance_type == "ml.p5.48xlarge" and spec.gpus == 8
    r = run_cli("job", "render", "--backend", "hyperpod", "--name", "j", "--image", IMAGE, "--instance-type",
                "p5.48xlarge", "--json")
    job = json.loads(r.stdout)["data"]["manifests"][-1]
    assert "node.kubernetes.io/instance-type: ml.p5.48xlarge" not in r.stdout  # JSON, not YAML
    assert json.dumps(job).count('"ml.p5.48xlarge"') >= 1 and '"p5.48xlarge"' not in json.dumps(job)
    # ... and a job on the trainer's default steps says so: 300 steps x 256 tokens x 16 sequences x 8 GPUs.
    assert r.stderr.splitlines() == [
        "instance_type: p5.48xlarge is ml.p5.48xlarge on HyperPod (its nodes are labelled so)",
        "warning: train.max_steps: this job trains the default 300 steps (9,830,400 tokens); set train.tokens (a "
        "token budget) or train.max_steps"]
    # Other backends keep the EC2 name.
    assert load_spec_dict({"name": "j", "backend": "pytorchjob", "image": IMAGE,
                           "instance_type": "p5.48xlarge"}).instance_type == "p5.48xlarge"


@pytest.mark.parametrize("backend", [b for b in BACKENDS if b != "local"])
@pytest.mark.parametrize("lora", [False, True], ids=["sft", "lora"])
def test_init_writes_a_chat_fine_tuning_job_on_weights_the_nodes_read(backend, lora, tmp_path):
    """An SFT (or LoRA) job on every cluster backend: the base is a directory on the job's storage,
    not on this machine, so the preset stands for its shape in checks and plans; the nodes get the
    preset's SFT recipe (LoRA's over it) and the weights' own tokenizer."""
    base = "/fsx/models/Qwen2.5-3B-Instruct"
    storage = ("", "/fsx") if backend == "slurm" else ("fsx-claim", "")
    text = starter(backend, "sft", "p5.48xlarge", "2", IMAGE, "qwen2_5_3b", storage[0] or None, storage[1] or None,
                   "/fsx/data/chat.jsonl", None, base, "chat", lora)
    spec = load_spec_dict(yaml.safe_load(text))
    flags = resolve(spec).flags()
    given = dict(zip(flags[::2], flags[1::2], strict=True))
    assert given["--init-from-hf"] == given["--tokenizer"] == base and given["--data-format"] == "chat"
    # The Qwen2.5 report's SFT rate; LoRA's QLoRA rate and shape over it.
    assert given["--lr"] == ("0.0002" if lora else "7e-06")
    assert ("--lora-rank" in given) == lora and given.get("--lora-rank", "64") == "64"
    (tmp_path / "sft.yaml").write_text(text)
    r = run_cli("job", "render", str(tmp_path / "sft.yaml"))
    assert r.returncode == 0, r.stderr
    assert base in r.stdout and "chat" in r.stdout


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_init_writes_a_dpo_job_with_the_preset_s_dpo_recipe(lora):
    """`job init --objective dpo --data-format preference`: the spec names the objective and the nodes
    get TRL's DPO defaults over the preset's recipe (LoRA's shape kept, its rate replaced)."""
    base = "/fsx/models/Qwen2.5-3B-Instruct"
    text = starter("pytorchjob", "dpo", "p5.48xlarge", "2", IMAGE, "qwen2_5_3b", "fsx-claim", None,
                   "/fsx/data/prefs.jsonl", None, base, "preference", lora, None, "dpo")
    doc = yaml.safe_load(text)
    assert (doc["train"]["objective"], doc["train"]["data_format"]) == ("dpo", "preference")
    assert "  # dpo_beta: 0.1" in text and "  # lr: 1.0e-06" in text
    flags = resolve(load_spec_dict(doc)).flags()
    given = dict(zip(flags[::2], flags[1::2], strict=True))
    assert (given["--objective"], given["--data-format"], given["--lr"]) == ("dpo", "preference", "1e-06")
    assert ("--lora-rank" in given) == lora
    with pytest.raises(UserError, match="objective: dpo trains on preference records"):
        starter("pytorchjob", "dpo", "p5.48xlarge", "2", IMAGE, "qwen2_5_3b", "fsx-claim", None, "/fsx/p", None, base,
                "chat", lora, None, "dpo")


def test_init_writes_a_qlora_job_with_the_qlora_paper_s_recipe():
    """`job init --lora --base-dtype nf4`: the spec names the NF4 base and the nodes get the QLoRA
    paper's schedule over LoRA's recipe: a constant rate after warm-up, gradients clipped at 0.3, no
    weight decay (the rank, alpha and rate stay LoRA's)."""
    text = starter("pytorchjob", "qlora", "p5.48xlarge", "1", IMAGE, "llama3_1_70b", "fsx-claim", None,
                   "/fsx/data/chat.jsonl", None, "/fsx/models/Llama-3.1-70B", "chat", True, None, None, "nf4")
    doc = yaml.safe_load(text)
    assert (doc["train"]["lora"], doc["train"]["base_dtype"]) == (True, "nf4")
    flags = resolve(load_spec_dict(doc)).flags()
    given = dict(zip(flags[::2], flags[1::2], strict=True))
    assert (given["--base-dtype"], given["--lr-decay-style"], given["--grad-clip"], given["--weight-decay"],
            given["--lr"], given["--lora-rank"], given["--lora-alpha"]) == ("nf4", "constant", "0.3", "0.0", "0.0001",
                                                                            "64", "16.0")
    # Without the NF4 base the same job keeps the LoRA recipe's cosine schedule and clip.
    lora = resolve(load_spec_dict({**doc, "train": {**doc["train"], "base_dtype": "auto"}})).flags()
    plain = dict(zip(lora[::2], lora[1::2], strict=True))
    assert (plain["--lr-decay-style"], plain["--grad-clip"], plain["--weight-decay"]) == ("cosine", "1.0", "0.1")
