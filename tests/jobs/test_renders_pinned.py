"""Every rendered job pinned to the byte: the manifests, sbatch script and Ray objects of each shipped
example and of the variants that take other branches of the renderers (elastic nodes, tiered
checkpoints, a token Secret, restricted security, a Kueue queue, a PVC made for the job, HyperPod
without auto-resume, GPUs without EFA, Trainium, Slurm with a time limit or a container, Ray from a
HyperPod spec), as `--json` gives them.

tests/jobs hold these renders to the operators' own schemas and parsers, kubectl's reading and the
rules each value follows; this file holds them exactly, so that a change to any field shows here,
named by case, and is a bug or a deliberate change, recorded by running

    FSDPKIT_UPDATE_RENDERS=1 python -m pytest -p no:xdist tests/jobs/test_renders_pinned.py

and committing tests/jobs/renders.json with the change that moved them. Each render is made in its
own test, in this process (so a mutation tool sees which test reaches what)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from pinned import holds_recorded

from conftest import ROOT, cli_here

RENDERS = Path(__file__).with_name("renders.json")
EXAMPLES = ROOT / "examples" / "jobs"


def _render(*args: str) -> list[str]:
    return ["job", "render", str(EXAMPLES / args[0]), *args[1:]]


CASES: dict[str, list[str]] = {
    # The cluster examples (local-tiny's render is this machine's own paths and Python).
    **{f"{p.stem}": _render(p.name) for p in sorted(EXAMPLES.glob("*.yaml")) if p.stem not in ("ray-p5", "local-tiny")},
    "eks-p5 elastic": _render("eks-p5.yaml", "--set", "nodes=2:4"),
    "eks-p5 token": _render("eks-p5.yaml", "--set", "hf_token_env=HF_TOKEN"),
    "eks-p5 restricted": _render("eks-p5.yaml", "--set", "security=restricted"),
    "eks-p5 queue": _render("eks-p5.yaml", "--set", "queue=team-a", "--set", "priority_class=urgent"),
    "eks-p5 new pvc": _render("eks-p5.yaml", "--set", "storage.claim=", "--set", "storage.size=1200Gi",
                              "--set", "storage.storage_class=fsx-sc"),
    "eks-p5 g5 one node": _render("eks-p5.yaml", "--set", "instance_type=g5.12xlarge", "--set", "nodes=1"),
    "eks-p5 trainium": _render("eks-p5.yaml", "--set", "instance_type=trn1.32xlarge"),
    "hyperpod-p5 tiered": _render("hyperpod-p5.yaml", "--set", "train.tiered=true"),
    "hyperpod-p5 no auto-resume": _render("hyperpod-p5.yaml", "--set", "hyperpod.auto_resume=false"),
    "trainjob-p5 one node": _render("trainjob-p5.yaml", "--set", "nodes=1"),
    "trainjob-p5 token": _render("trainjob-p5.yaml", "--set", "hf_token_env=HF_TOKEN"),
    "slurm-p5 time limit": _render("slurm-p5.yaml", "--set", "slurm.time=48:00:00", "--set", "slurm.partition=gpu"),
    "slurm-p5 container": _render("slurm-p5.yaml", "--set", "slurm.container_image=nvcr.io#nvidia/pytorch:25.01-py3"),
    "ray-p5 cluster": ["ray", "create", str(EXAMPLES / "ray-p5.yaml"), "--dry-run"],
    "ray from hyperpod": ["ray", "create", str(EXAMPLES / "hyperpod-p5.yaml"), "--dry-run"],
    "ray-p5 job": ["ray", "submit", str(EXAMPLES / "ray-p5.yaml"), "--dry-run", "--job-name", "grpo",
                   "--entrypoint-gpus", "1", "--", "python3", "-m", "verl.trainer.main_ppo"],
}


def rendered(argv: list[str]) -> dict:
    cut = argv.index("--") if "--" in argv else len(argv)   # --json goes before a command's own arguments
    r = cli_here(*argv[:cut], "--json", *argv[cut:])
    assert r.returncode == 0, r.stdout + r.stderr
    envelope = json.loads(r.stdout)
    # Where the examples live differs from clone to clone: the pins hold it as EXAMPLES.
    return json.loads(json.dumps(envelope["data"]).replace(str(EXAMPLES), "EXAMPLES"))


@pytest.mark.parametrize("case", list(CASES))
def test_every_render_is_the_one_recorded(case):
    holds_recorded(RENDERS, case, rendered(CASES[case]), "FSDPKIT_UPDATE_RENDERS")


def test_render_warns_as_submit_does_of_a_job_that_cannot_fit():
    """Manifests applied by hand (kubectl apply of a render) skip submit's capacity check: render
    says it too, on stderr, so stdout stays YAML for kubectl."""
    r = cli_here(*CASES["eks-p5 g5 one node"])
    assert r.returncode == 0 and r.stdout.startswith("apiVersion:"), r.stderr
    assert ("warning: plan: does not fit: needs 35.8 GiB per GPU, 20.6 usable; fits with --cpu-offload true (8.7 GiB "
            "per GPU, 1 node(s)); see `fsdpkit plan SPEC` (--strict refuses such jobs)") in r.stderr.splitlines()
    assert not any(line.startswith("warning: plan:") for line in cli_here(*CASES["eks-p5"]).stderr.splitlines())
