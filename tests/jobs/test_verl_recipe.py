"""The VERL GRPO recipe that docs/ray.md and the Ray skill give, checked by VERL itself: its
overrides through VERL 0.5.0's Hydra config and the trainer's config checks (tests/verl_config_check.py,
run with the VERL that `make venv` puts in .venv/verl-check), offline; its GPU count against the job
spec the same document writes; and the Ray workers it runs on (no allocator setting vLLM refuses, no
NCCL plugin forced onto an image without one)."""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from doc_commands import command_lines

from fsdpkit.hardware.instances import lookup
from fsdpkit.jobs.ray import raycluster_manifest
from fsdpkit.jobs.resolved import load_job

from conftest import ROOT, cli_here, unavailable

DOCS = [ROOT / "docs" / "ray.md", ROOT / "src" / "fsdpkit" / "skills" / "data" / "fsdpkit-ray" / "SKILL.md"]
VERL = Path(sys.executable).parent.parent / "verl-check"
ENTRY = "verl.trainer.main_ppo"


def recipe(doc: Path) -> tuple[list[str], list[str]]:
    """(the `job init` line's argv, the GRPO entrypoint's overrides) of a document."""
    lines = [shlex.split(x, comments=True) for x in command_lines(doc)]
    (grpo,) = [a for a in lines if ENTRY in a]
    init = next(a for a in lines if a[1:3] == ["job", "init"] and "verl-grpo" in a)
    return init, grpo[grpo.index(ENTRY) + 1:]


def verl_checks(overrides: list[str]) -> subprocess.CompletedProcess:
    if not (VERL / "verl").is_dir():
        unavailable(f"VERL is not installed in {VERL} (make venv installs it)")
    return subprocess.run([sys.executable, str(ROOT / "tests" / "verl_config_check.py"), *overrides],
                          capture_output=True, text=True, timeout=300, cwd=ROOT,
                          env={**os.environ, "PYTHONPATH": str(VERL), "HF_HUB_OFFLINE": "1"})


@pytest.mark.parametrize("doc", DOCS, ids=[d.name for d in DOCS])
def test_the_grpo_overrides_pass_verls_own_config_checks(doc):
    init, overrides = recipe(doc)
    r = verl_checks(overrides)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "All configuration checks passed" in r.stdout
    # The GPUs VERL is told of are the workers' GPUs: nodes x the instance's GPUs.
    given = dict(o.split("=", 1) for o in overrides)
    nodes, instance = int(init[init.index("--nodes") + 1]), lookup(init[init.index("--instance-type") + 1])
    assert int(given["trainer.nnodes"]) * int(given["trainer.n_gpus_per_node"]) == nodes * instance.accelerators


def test_ray_submit_refuses_the_batch_verl_s_own_check_refuses_before_a_pod_starts(tmp_path):
    """A batch that does not divide over the GPUs: VERL's own check refuses it once the job runs in
    the cluster; `ray submit` refuses it first, with VERL's words and figures (its dry run asks no
    cluster), and submits the recipe as it is."""
    _, overrides = recipe(DOCS[0])
    uneven = [*[o for o in overrides if not o.startswith("data.train_batch_size=")], "data.train_batch_size=1030"]
    theirs = verl_checks(uneven)
    assert theirs.returncode != 0
    assert "real_train_batch_size (5150) must be divisible by minimal possible batch size (16)" in theirs.stderr, \
        theirs.stderr[-2000:]
    spec = tmp_path / "verl.yaml"
    spec.write_text("name: verl\nimage: x:1\ninstance_type: p5.48xlarge\nnodes: 2\n")
    r = cli_here("ray", "submit", str(spec), "--dry-run", "--", "python3", "-m", ENTRY, *uneven)
    assert (r.returncode, r.stderr) == (2, "error: ray submit: VERL refuses data.train_batch_size x rollout.n = 1030 x "
                                           "5 = 5150 sequences a step over 16 GPUs: real_train_batch_size (5150) "
                                           "must be divisible by minimal possible batch size (16)\n")
    assert cli_here("ray", "submit", str(spec), "--dry-run", "--", "python3", "-m", ENTRY, *overrides).returncode == 0


def test_verls_checks_refuse_the_recipe_without_its_micro_batch_sizes():
    """The check can fail: the recipe as it was (no micro-batch sizes) is what VERL refuses at start."""
    _, overrides = recipe(DOCS[0])
    r = verl_checks([o for o in overrides if "micro_batch_size" not in o])
    assert r.returncode != 0
    assert "Please set at least one of 'actor_rollout_ref.actor.micro_batch_size' or " \
           "'actor_rollout_ref.actor.micro_batch_size_per_gpu'" in r.stderr
    r = verl_checks([*overrides, "trainer.no_such_field=1"])   # Hydra refuses a key VERL's config lacks
    assert r.returncode != 0 and "no_such_field" in r.stderr


def _worker_env(image: str, **extra) -> tuple[dict[str, str | None], dict]:
    spec = load_job(None, [("name", "verl-grpo"), ("backend", "hyperpod"), ("image", image), ("nodes", 2),
                            ("instance_type", "ml.p5.48xlarge"), ("storage", {"claim": "fsx-claim"}),
                            ("command", ["unused"]), *extra.items()])
    worker = raycluster_manifest(spec)["spec"]["workerGroupSpecs"][0]["template"]["spec"]["containers"][0]
    return {e["name"]: e.get("value") for e in worker["env"]}, worker["resources"]["requests"]


def test_ray_workers_carry_no_setting_vllm_or_the_image_cannot_take():
    """vLLM's sleep mode (VERL's default) asserts expandable_segments is off; VERL's image has no
    aws-ofi-nccl, where a forced NCCL_NET stops NCCL ("network not found") instead of using sockets."""
    env, requests = _worker_env("verlai/verl:app-verl0.5-transformers4.55.4-vllm0.10.0-mcore0.13.0-te2.2")
    assert "PYTORCH_CUDA_ALLOC_CONF" not in env and "NCCL_NET" not in env and env["FI_PROVIDER"] == "efa"
    assert env["TORCH_NCCL_DUMP_ON_TIMEOUT"] == "1"          # the rest of the GPU settings stay
    # A share of the node, as AWS's VERL reference asks: not BestEffort, the first evicted under pressure.
    assert requests == {"nvidia.com/gpu": 8, "vpc.amazonaws.com/efa": 32, "cpu": "153", "memory": "1638Gi"}
    # The image `image init --base verl-0.5` builds (pushed under the user's name): the plugin is forced.
    env, _ = _worker_env("123456789012.dkr.ecr.us-west-2.amazonaws.com/my-verl:1")
    assert env["NCCL_NET"] == "AWS Libfabric" and "PYTORCH_CUDA_ALLOC_CONF" not in env
    # A value the spec itself gives is the user's choice, and kept.
    env, _ = _worker_env("x/y:1", env={"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"})
    assert env["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:True"
