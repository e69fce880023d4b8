"""ResolvedJob: a job's derived values worked out once (one build of the trainer's config per
render), shown with their sources by `job render --explain` and held there to what the manifest
carries; a token budget that `plan` and the rendered job agree on; the warning for a cluster job
on the trainer's default steps; and the plan's time with its checkpoint saves and validation."""

from __future__ import annotations

import ast
import json
import math
from pathlib import Path
from unittest import mock

import pytest
import yaml

from fsdpkit.cli import job as job_cli
from fsdpkit.jobs import resolved
from fsdpkit.plan.grace import checkpoint_bytes
from fsdpkit.train.config import build
from fsdpkit.train.model.presets import PRESETS

from conftest import ROOT, cli_here

EXAMPLES = sorted((ROOT / "examples" / "jobs").glob("*.yaml"))
HYPERPOD = ROOT / "examples" / "jobs" / "hyperpod-p5.yaml"
CKPT_8B = checkpoint_bytes(PRESETS["llama3_1_8b"])


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda p: p.stem)
def test_one_render_builds_the_trainer_config_once(example, monkeypatch, tmp_path, capsys):
    monkeypatch.setenv("FSDPKIT_HOME", str(tmp_path))
    with mock.patch.object(resolved, "build", wraps=build) as built:
        assert job_cli.main(["render", str(example)]) == 0
    assert built.call_count == 1
    assert capsys.readouterr().out   # the render itself


def test_the_spec_module_is_schema_and_checks_alone():
    """No planner, image or manifest code in jobs/spec.py: what a job derives lives in jobs/resolved."""
    tree = ast.parse((ROOT / "src" / "fsdpkit" / "jobs" / "spec.py").read_text())
    imported = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
    assert not {m for m in imported if m.startswith(("fsdpkit.plan", "fsdpkit.image", "fsdpkit.cluster"))
                or m in ("fsdpkit.jobs.manifests", "fsdpkit.jobs.command", "fsdpkit.jobs.hyperpod")}


def _render(*args: str) -> dict:
    r = cli_here("job", "render", *args, "--json")
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)["data"]


def _flag(command: list[str], name: str) -> str:
    return command[command.index(name) + 1]


def test_explain_of_the_hyperpod_example_holds_each_value_to_what_the_manifest_carries():
    explained = {s["name"]: s for s in _render(str(HYPERPOD), "--explain")["explain"]}
    job = _render(str(HYPERPOD))["manifests"][-1]
    pod = job["spec"]["replicaSpecs"][0]["template"]["spec"]
    policy, command = job["spec"]["runPolicy"], pod["containers"][0]["command"]
    rules = {r["name"]: r for r in policy["logMonitoringConfiguration"]}
    carried = {"grace_seconds": pod["terminationGracePeriodSeconds"],
               "startup_deadline": policy["startupDeadlineSeconds"], "fault_deadline": policy["faultDeadlineSeconds"],
               "hang_seconds": rules["fsdpkit-progress"]["expectedRecurringFrequencyInSeconds"],
               "loss_threshold": rules["fsdpkit-loss"]["metricThreshold"],
               "checkpoint_every": _flag(command, "--checkpoint-every"), "steps": int(_flag(command, "--max-steps"))}
    assert {k: explained[k]["value"] for k in carried} == carried
    # The values themselves, and where each came from. An 8B checkpoint is 96.4 GB: 192.7 s at the
    # example's 500 MB/s; 4 p5 nodes of 8 GPUs at 8192 tokens a sequence.
    assert {k: (v["value"], v["source"]) for k, v in explained.items()} == {
        "grace_seconds": (360, "plan"),        # 60 + 2 x 1.4 + 1.5 x 192.7 = 351.9, in tens
        "startup_deadline": (1200, "plan"),    # 600 + 1.5 x 192.7 + 300 = 1189.1, in minutes
        "fault_deadline": (1560, "plan"),      # the grace and a start-up
        "hang_seconds": (600, "plan"),         # 5 x 10 x 1.4 + 1.5 x 192.7 + 60 = 419, at least 600
        "loss_threshold": (24, "default"),     # 2 ln(128,256) = 23.5, up
        "checkpoint_every": ("65m", "plan"),   # 192.7 s / 5%, in minutes
        "steps": (10_000, "given"), "tokens": (10_000 * 8192 * 32, "given"),
        "devices": ("extended", "default")}       # DRA only where `job submit` finds it (tests/jobs/test_devices.py)
    assert explained["hang_seconds"]["why"] == ("5 logging windows of 10 steps at 1.4 s + 1.5 x 193 s to write a "
                                                "checkpoint + 60 s = 419 s, in whole minutes, at least 600 s")
    r = cli_here("job", "render", str(HYPERPOD), "--explain")
    assert r.returncode == 0 and r.stdout.splitlines()[0] == "llama3-8b-hp (hyperpod) runs with:"
    assert "  grace_seconds                360  plan: 360 s = 60 s + 2 x 1.4 s to finish the step" in r.stdout


def _without_steps(tmp_path: Path) -> Path:
    doc = yaml.safe_load(HYPERPOD.read_text())
    del doc["train"]["max_steps"]
    path = tmp_path / "budget.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


def test_plan_tokens_and_the_rendered_job_train_the_same_tokens(tmp_path):
    spec = _without_steps(tmp_path)
    r = cli_here("plan", str(spec), "--tokens", "1e10", "--json")
    assert r.returncode == 0, r.stderr
    run = json.loads(r.stdout)["data"]["run"]
    # 1e10 tokens in steps of 8192 x 1 x 32 = 262,144 tokens: 38,147 steps, the last one partly over.
    assert (run["steps"], run["tokens"]) == (38_147, 38_147 * 262_144)
    rendered = _render(str(spec), "--set", "train.tokens=10000000000")
    command = rendered["manifests"][-1]["spec"]["replicaSpecs"][0]["template"]["spec"]["containers"][0]["command"]
    assert int(_flag(command, "--max-steps")) == run["steps"] and "--tokens" not in command
    explained = {s["name"]: s for s in _render(str(spec), "--set", "train.tokens=10000000000", "--explain")["explain"]}
    assert explained["tokens"]["value"] == run["tokens"] and explained["steps"]["source"] == "given"
    # A spec with its own step count: --tokens plans the budget in its place, and says how to run it.
    r = cli_here("plan", str(HYPERPOD), "--tokens", "1e10", "--json")
    assert json.loads(r.stdout)["data"]["run"]["steps"] == 38_147
    assert r.stderr.splitlines() == ["note: --tokens 10,000,000,000 replaces the spec's train.max_steps 10000; to run "
                                     "this plan, set train.tokens: 10000000000 in the spec and drop train.max_steps"]
    r = cli_here("job", "render", str(HYPERPOD), "--set", "train.tokens=10000000000")
    assert (r.returncode, r.stderr) == (2, "error: train.tokens: give a token budget or max_steps (10000), not "
                                           "both\n")


DEFAULT_STEPS = ("warning: train.max_steps: this job trains the default 300 steps (78,643,200 tokens); set "
                 "train.tokens (a token budget) or train.max_steps")


def test_a_cluster_job_on_the_default_steps_warns_at_render_and_submit(tmp_path):
    spec = _without_steps(tmp_path)
    render = cli_here("job", "render", str(spec))
    submit = cli_here("job", "submit", str(spec), "--dry-run")
    assert render.returncode == submit.returncode == 0, submit.stderr
    for r in (render, submit):
        assert DEFAULT_STEPS in r.stderr.splitlines()
    assert "default 300 steps" not in cli_here("job", "render", str(HYPERPOD)).stderr
    # A local job is the user's own machine at work: nothing to warn about.
    local = cli_here("job", "render", "--backend", "local", "--name", "l", "--set", "storage={}", "--set",
                    "instance_type=null", "--set", "nodes=1", "--set", "hyperpod={}", str(spec))
    assert local.returncode == 0 and "default 300 steps" not in local.stderr, local.stderr


def _plan(tmp_path: Path, **train) -> dict:
    doc = {"name": "budget", "backend": "pytorchjob", "image": "x:1", "instance_type": "p5.48xlarge", "nodes": 1,
           "storage": {"claim": "fsx", "write_mb_per_s": 1000},
           "train": {"preset": "llama3_1_8b", "max_steps": 1000, "validation_freq": 250, **train}}
    path = tmp_path / "plan.yaml"
    path.write_text(yaml.safe_dump(doc))
    r = cli_here("plan", str(path), "--json")
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)["data"]


def test_plan_time_includes_checkpoint_saves_and_validation_at_the_job_s_intervals(tmp_path):
    write_s = CKPT_8B / 1000e6   # 96.4 s at 1,000 MB/s
    every_100 = _plan(tmp_path, checkpoint_every=100)
    run = every_100["run"]
    # Steps 100, 200, ..., 900 and the last (1000, saved once): 10 saves, each stopping the loop.
    assert (run["steps"], run["saves"]) == (1000, 10)
    assert run["checkpoint_s"] == pytest.approx(10 * write_s, rel=1e-12)
    assert run["train_s"] == pytest.approx(1000 * every_100["step_s"], rel=1e-4)
    assert run["validation_s"] > 0 and run["total_s"] == pytest.approx(
        run["train_s"] + run["validation_s"] + run["checkpoint_s"], rel=1e-12)
    assert every_100["hours"] == round(run["total_s"] / 3600, 2)
    # By wall time: a save every full 10 minutes of training and validation, then the last.
    timed = _plan(tmp_path, checkpoint_every="10m")["run"]
    assert timed["saves"] == math.floor((timed["train_s"] + timed["validation_s"]) / 600) + 1
    assert timed["checkpoint_s"] == pytest.approx(timed["saves"] * write_s, rel=1e-12)
    # Only the last step's save, at 0.
    assert _plan(tmp_path, checkpoint_every=0)["run"]["saves"] == 1


def test_a_spec_without_its_image_yet_is_planned_and_explained_but_not_rendered(tmp_path):
    """`job init` writes a cluster spec before any image is pushed: `plan` and `--explain` read it
    (the image is a concern of the pods), and the render says what is missing, in one line."""
    spec = tmp_path / "job.yaml"
    r = cli_here("job", "init", "--backend", "pytorchjob", "--instance-type", "p5.48xlarge", "--nodes", "2",
                "--preset", "llama3_1_8b", "--storage-claim", "fsx", "--out", str(spec))
    assert r.returncode == 0, r.stderr
    assert "\nimage:" not in spec.read_text()
    plan = cli_here("plan", str(spec), "--json")
    assert plan.returncode == 0 and json.loads(plan.stdout)["data"]["model"] == "llama3_1_8b", plan.stderr
    assert [s["name"] for s in _render(str(spec), "--explain")["explain"]][-2:] == ["steps", "tokens"]
    render = cli_here("job", "render", str(spec))
    assert (render.returncode, render.stderr) == (2, "error: image: the pytorchjob backend runs a container image; "
                                                     "give image: (for example ACCOUNT.dkr.ecr.REGION.amazonaws.com/"
                                                     "fsdpkit:TAG; `fsdpkit image push` prints it)\n")


# What `--explain` says for each way a value comes about, word for word: the given field, the
# planner's reasoning, or the default and why. 2 p5 nodes of 8 GPUs, Llama 3.1 8B (a 96.4 GB
# checkpoint), 8192 tokens a sequence: 131,072 tokens a step.
STEP_TOKENS = "131,072 tokens (seq_len 8192 x micro-batch 1 x accumulation 1 x 16 data-parallel ranks)"
GIVEN_STEPS = [("steps", 1000, "given", "train.max_steps"),
               ("tokens", 131_072_000, "given", f"1,000 steps x {STEP_TOKENS}")]
GRACE_500 = ("grace_seconds", 360, "plan", "360 s = 60 s + 2 x 1.4 s to finish the step + 1.5 x 193 s to write the "
             "96.4 GB checkpoint at 500 MB/s to shared storage")
EVERY_65M = ("checkpoint_every", "65m", "plan", "every 65m: writing it takes 193 s, 4.7% of the run (at most 5%, at "
             "least 10 min apart); the last step is always saved")
FSX = {"storage": {"claim": "fsx"}}
DEVICES = ("devices", "extended", "default", "no cluster read: `job submit` asks the cluster whether it offers DRA")
EXPLAINED = {
    "no storage": ({}, [
        ("grace_seconds", 30, "default", "Kubernetes' own: the job has no storage to write a stop's checkpoint to"),
        DEVICES, ("checkpoint_every", "0", "default", "no checkpoints: the job has no storage"), *GIVEN_STEPS]),
    "grace given": ({**FSX, "termination_grace_seconds": 900}, [
        ("grace_seconds", 900, "given", "termination_grace_seconds"), DEVICES, EVERY_65M, *GIVEN_STEPS]),
    "faster storage": ({"storage": {"claim": "fsx", "write_mb_per_s": 1000}}, [
        ("grace_seconds", 210, "plan", "210 s = 60 s + 2 x 1.4 s to finish the step + 1.5 x 96 s to write the 96.4 GB "
         "checkpoint at 1000 MB/s to shared storage"),    # 207.4, in tens
        DEVICES,
        ("checkpoint_every", "33m", "plan", "every 33m: writing it takes 96 s, 4.6% of the run (at most 5%, at least "
         "10 min apart); the last step is always saved"), *GIVEN_STEPS]),
    "interval given": ({**FSX, "train": {"checkpoint_every": "500"}}, [
        GRACE_500, DEVICES, ("checkpoint_every", "500", "given", "train.checkpoint_every"), *GIVEN_STEPS]),
    "last step only": ({**FSX, "train": {"checkpoint_every": "0"}}, [
        GRACE_500, DEVICES, ("checkpoint_every", "0", "default", "the last step only"), *GIVEN_STEPS]),
    "token budget": ({**FSX, "train": {"tokens": 1_000_000_000, "max_steps": None}}, [
        GRACE_500, DEVICES, EVERY_65M, ("steps", 7630, "given", "train.tokens 1,000,000,000 / 131,072 tokens a step"),
        ("tokens", 1_000_079_360, "given", f"7,630 steps x {STEP_TOKENS}")]),
    "default steps": ({**FSX, "train": {"max_steps": None}}, [
        GRACE_500, DEVICES, EVERY_65M,
        ("steps", 300, "default", "the trainer's default: set train.tokens or train.max_steps"),
        ("tokens", 39_321_600, "default", f"300 steps x {STEP_TOKENS}")]),
    "hyperpod given": ({**FSX, "backend": "hyperpod", "instance_type": "ml.p5.48xlarge", "hyperpod": {
        "startup_deadline": 1800, "fault_deadline": 2400, "hang_timeout": 900, "loss_threshold": 12}}, [
        GRACE_500, DEVICES, ("startup_deadline", 1800, "given", "hyperpod.startup_deadline"),
        ("fault_deadline", 2400, "given", "hyperpod.fault_deadline"),
        ("hang_seconds", 900, "given", "hyperpod.hang_timeout"),
        ("loss_threshold", 12, "given", "hyperpod.loss_threshold"), EVERY_65M, *GIVEN_STEPS]),
}


def test_explain_s_token_sentence_is_the_product_it_states_under_context_parallel(tmp_path):
    """Context parallel 2 over 16 ranks: 8 data-parallel ranks read the batches, and the sentence
    multiplies out to its value (it said 16 ranks beside a value of 8's)."""
    doc = {"name": "x", "backend": "pytorchjob", "image": "x:1", "instance_type": "p5.48xlarge", "nodes": 2,
           "train": {"preset": "llama3_1_8b", "max_steps": 1000, "context_parallel": 2}}
    spec = tmp_path / "job.yaml"
    spec.write_text(yaml.safe_dump(doc))
    rows = {r["name"]: r for r in _render(str(spec), "--explain")["explain"]}
    assert (rows["tokens"]["value"], rows["tokens"]["why"]) == (
        65_536_000, "1,000 steps x 65,536 tokens (seq_len 8192 x micro-batch 1 x accumulation 1 x 8 data-parallel "
        "ranks of 16)")
    assert rows["tokens"]["value"] == 8192 * 1 * 1 * 8 * 1000


@pytest.mark.parametrize("case", EXPLAINED)
def test_explain_names_where_each_value_came_from(case, tmp_path):
    change, expected = EXPLAINED[case]
    train = {k: v for k, v in {"preset": "llama3_1_8b", "max_steps": 1000, **change.get("train", {})}.items()
             if v is not None}
    doc = {"name": "x", "backend": "pytorchjob", "image": "x:1", "instance_type": "p5.48xlarge", "nodes": 2,
           **change, "train": train}
    spec = tmp_path / "job.yaml"
    spec.write_text(yaml.safe_dump(doc))
    explained = _render(str(spec), "--explain")["explain"]
    assert [(s["name"], s["value"], s["source"], s["why"]) for s in explained] == expected


def test_tiered_checkpoints_go_to_node_memory_at_their_own_cadence_and_every_nth_to_storage(tmp_path):
    """HyperPod's memory tier: 2 nodes at 1000 MB/s each write the 96.4 GB in 48 s, so every 17m;
    shared storage keeps its own 65m cadence as every 4th of them (3,900 s / 1,020 s, up), unless
    durable_every is given. The grace is the memory tier's write."""
    doc = {"name": "x", "backend": "hyperpod", "image": "x:1", "instance_type": "ml.p5.48xlarge", "nodes": 2,
           **FSX, "train": {"preset": "llama3_1_8b", "max_steps": 1000, "tiered": True}}
    for given, durable in ((None, "4"), (3, "3")):
        spec = tmp_path / "job.yaml"
        train = {**doc["train"], **({"durable_every": given} if given else {})}
        spec.write_text(yaml.safe_dump({**doc, "train": train}))
        explained = {s["name"]: (s["value"], s["source"], s["why"]) for s in _render(str(spec), "--explain")["explain"]}
        assert explained["checkpoint_every"] == ("17m", "plan", "every 17m: writing it takes 48 s, 4.5% of the run (at "
                                                 "most 5%, at least 10 min apart); the last step is always saved")
        assert explained["grace_seconds"] == (140, "plan", "140 s = 60 s + 2 x 1.4 s to finish the step + 1.5 x 48 s "
                                              "to write the 96.4 GB checkpoint at 2000 MB/s to node memory (tiered, "
                                              "1000 MB/s a node)")
        job = _render(str(spec))["manifests"][-1]
        command = job["spec"]["replicaSpecs"][0]["template"]["spec"]["containers"][0]["command"]
        assert (_flag(command, "--checkpoint-every"), _flag(command, "--durable-every")) == ("17m", durable)


def test_a_trainium_job_has_no_step_time_in_its_grace(tmp_path):
    """No NVIDIA GPU, no planned step: the grace is the write alone (60 s + 1.5 x 192.7 s = 349, in tens)."""
    spec = tmp_path / "job.yaml"
    spec.write_text(yaml.safe_dump({"name": "x", "backend": "pytorchjob", "image": "x:1", "nodes": 1, **FSX,
                                    "instance_type": "trn1.32xlarge", "train": {"preset": "llama3_1_8b",
                                                                                "max_steps": 1000}}))
    explained = {s["name"]: (s["value"], s["source"], s["why"]) for s in _render(str(spec), "--explain")["explain"]}
    assert explained["grace_seconds"] == (350, "plan", "350 s = 60 s + 1.5 x 193 s to write the 96.4 GB checkpoint "
                                          "at 500 MB/s to shared storage")
    r = cli_here("job", "render", str(spec), "--set", "train.lr=-1")
    assert (r.returncode, r.stderr) == (2, "error: train.lr: -1.0 is out of range; it must be >= 0.0\n")


@pytest.mark.parametrize("block", ["max_steps", "tokens"])
def test_plan_tokens_replace_a_budget_given_in_the_optim_section(block, tmp_path):
    """A spec's train options may nest in their sections (`optim: {max_steps: ...}`), as a run's
    config.yaml does: `plan --tokens` replaces the budget given there too, and names what it replaced."""
    doc = yaml.safe_load(HYPERPOD.read_text())
    steps = doc["train"].pop("max_steps")
    given = steps if block == "max_steps" else 5_000_000_000
    doc["train"]["optim"] = {block: given, "lr": 2e-4}
    spec = tmp_path / "nested.yaml"
    spec.write_text(yaml.safe_dump(doc))
    r = cli_here("plan", str(spec), "--tokens", "1e10", "--json")
    assert r.returncode == 0, r.stderr
    data = json.loads(r.stdout)["data"]
    assert data["run"]["steps"] == 38_147 and data["recipe"]["lr"] == 2e-4
    assert r.stderr.splitlines() == ([f"note: --tokens 10,000,000,000 replaces the spec's train.max_steps {given}; to "
                                      "run this plan, set train.tokens: 10000000000 in the spec and drop "
                                      "train.max_steps"] if block == "max_steps" else [])
