"""Every command line of every SKILL.md runs as written, in order, in a folder of the skill's own,
as an agent following it would: local commands on this machine; cluster commands against kmock,
scripted as a healthy EKS cluster whose operators and kubelet the test plays; AWS commands against
moto in server mode; `docker` as a stand-in that pushes into moto's ECR. A line that creates cloud
resources runs with `--dry-run` where it has one (and must still succeed). Each must succeed with
`ok: true`, unless EXPECT says what the skill documents instead. A skill that names a missing file
or a flag that fails, fails here. A training line that leaves the sequence length to its preset
trains at 128 tokens (doc_commands.short_sequences, as the docs' walk does); its steps are as
written, since later lines name the checkpoints they leave."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import time
from pathlib import Path

import pytest
from cluster_world import SCHEMAS, cluster_world, line_argv
from doc_commands import command_lines, short_sequences

from conftest import ROOT, require, run_cli, unavailable
from finetune_fixtures import chat_records, local_task, tiny_qwen
from torch_pass import names_training

pytestmark = pytest.mark.slow
require("kmock")
require("moto.server")

SKILLS = sorted((ROOT / "src" / "fsdpkit" / "skills" / "data").glob("*/SKILL.md"))
LINES = [(p.parent.name, line) for p in SKILLS for line in command_lines(p)]

# What a skill documents other than success: (exit code, a piece of the error message or output).
EXPECT = {
    # The EKS cluster is found by name (moto's EKS answers with its endpoint and CA), but its API
    # endpoint is in no network reachable from here.
    r"^fsdpkit cluster check --eks-cluster": (3, "cannot reach the Kubernetes API"),
    # moto's EKS reports no cluster security group (every real EKS cluster has one): the command
    # names the flag that gives it.
    r"^fsdpkit storage fsx storage-class .* --eks-cluster llm": (2, "has no cluster security group; give "
                                                                    "--security-group-id"),
    # `storage fsx create` ran as a dry run above: there is no file system to show, and it says how to make one.
    r"^fsdpkit storage fsx status ckpt": (2, "no FSx file system named 'ckpt' (fsdpkit storage fsx create ckpt"),
    # The recorded DCGM series hold one node at about 58% against the others' 95%: the skill says
    # what a straggler finding means.
    r"^fsdpkit metrics my-job": (1, "straggler"),
    # The 70B on one p5 does not fit: the skill shows the plan that fails, with the change as its hint.
    r"^fsdpkit plan --preset llama3_1_70b --instance-type p5.48xlarge --nodes 1 --json": (1, "plan again with"),
}


# Lines that install operators: the world's kubectl and helm (tests/fake_tools.py) create their CRDs
# from ../shared/schemas, as the upstream manifests they stand for would (no network here).
INSTALLS = re.compile(r"^fsdpkit cluster addons install\b")


def test_every_skill_line_is_covered():
    assert len(LINES) >= 70 and {s for s, _ in LINES} == {p.parent.name for p in SKILLS}


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """moto with fsdpkit's build infrastructure, kmock as a cluster with every operator fsdpkit
    drives and a finished job `my-job`, a Prometheus with its GPUs' series, and the environment
    that reaches them (tests/cluster_world.py)."""
    with cluster_world(tmp_path_factory.mktemp("world")) as w:
        yield w


def world_for(skill: str, request):
    """The world, where it can give what the skill's lines need: a skill that installs operators is
    unavailable without their CRDs (skipped with the reason; failed under CI=true)."""
    if not SCHEMAS.is_dir() and any(INSTALLS.match(line) for s, line in LINES if s == skill):
        unavailable(f"{skill} installs operators whose CRDs are in {SCHEMAS}, absent here (a clone outside the "
                    "project's workspace)")
    return request.getfixturevalue("world")


@pytest.fixture
def fine_tune_project():
    """What a fine-tuning user's folder holds before an agent starts: a model downloaded from the hub
    (tiny, of Qwen2.5's form), chat records, preference pairs and an evaluation task of their own.
    Asked for by the fine-tune walk alone (transformers loads here)."""
    def make(folder: Path) -> None:
        tiny_qwen(folder / "models" / "Qwen2.5-0.5B-Instruct", require("transformers"))
        (folder / "data").mkdir()
        (folder / "data" / "chat.jsonl").write_text("".join(json.dumps(r) + "\n" for r in chat_records()))
        prefs = [{"prompt": [{"role": "user", "content": f"What is {i} plus 1?"}],
                  "chosen": [{"role": "assistant", "content": f"{i + 1}."}],
                  "rejected": [{"role": "assistant", "content": "zebra."}]} for i in range(100)]
        (folder / "data" / "prefs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in prefs))
        local_task(folder / "tasks", [(f"What is {i} plus 1?", [f"{i + 1}.", "zebra."], 0) for i in range(20)],
                   "my_task")
    return make


def walk(skill: str):
    """A skill's walk; one whose lines train (`fsdpkit train ...`) runs on the newest torch too: the
    lines, not the skill's name, say so (tests/torch_pass.py)."""
    trains = any(names_training(line) for s, line in LINES if s == skill)
    return pytest.param(skill, id=skill, marks=[pytest.mark.torch] if trains else [])


def walk_argv(line: str) -> list[str]:
    """A line's arguments as the walk runs them: cloud creation as a dry run (line_argv), training
    at the walk's sequence length where the line names none (short_sequences)."""
    argv = line_argv(line)
    return short_sequences(argv) if argv[0] == "train" else argv


def prepare_project(skill: str, folder: Path, world, request) -> None:
    """What a user's project holds before an agent starts: their requirements, a run config, and the
    files of their own a skill's lines name."""
    (folder / "requirements.txt").write_text("rich==13.9.4\n")
    (folder / "run.yaml").write_text("preset: tiny\noptim:\n  max_steps: 10\n")
    if skill == "fsdpkit-train-locally" and not (folder / "my-text").exists():
        # Text of the user's own, with a validation split of its own.
        for split, files in (("train", sorted(Path(json.__file__).parent.parent.glob("*.py"))[:40]),
                             ("validation", sorted(Path(json.__file__).parent.glob("*.py")))):
            (folder / "my-text" / split).mkdir(parents=True)
            for f in files:
                (folder / "my-text" / split / f"{f.stem}.txt").write_text(f.read_text(errors="replace"))
    if skill == "fsdpkit-checkpoints":  # the job's folder on the volume, as the helper pod sees it
        (world.volume / "my-job").mkdir(parents=True, exist_ok=True)
    if skill == "fsdpkit-validate-nccl-efa":   # a rank's log the user saved, NCCL's INFO lines on EFA
        shutil.copy(ROOT / "tests" / "data" / "nccl" / "p5-efa.log", folder / "rank0.log")
    if skill == "fsdpkit-fine-tune" and not (folder / "models").exists():
        request.getfixturevalue("fine_tune_project")(folder)


@pytest.mark.parametrize("skill", [walk(s) for s in sorted({s for s, _ in LINES})])
def test_skill_commands_run_as_written(skill, request):
    world = world_for(skill, request)
    env = world.env
    folder = world.root.parent / skill
    folder.mkdir(exist_ok=True)
    prepare_project(skill, folder, world, request)
    # fsdpkit's build infrastructure, as `fsdpkit infra create` leaves it (the infra skill takes it down).
    assert run_cli("infra", "create", env=env, timeout=120).returncode == 0
    if not (folder / ".git").exists():  # a project under git (--tag-strategy git-sha)
        for git in (["init", "-q"], ["add", "-A"], ["-c", "user.email=a@b", "-c", "user.name=a", "commit", "-qm", "x"]):
            subprocess.run(["git", *git], cwd=folder, check=True, capture_output=True)
    for _, line in [x for x in LINES if x[0] == skill]:
        argv = walk_argv(line)
        world.settle()
        t0 = time.monotonic()
        r = run_cli(*argv, cwd=folder, env=env, timeout=600)
        print(f"{time.monotonic() - t0:6.1f}s exit {r.returncode}  {line}")
        if skill == "fsdpkit-checkpoints" and argv[:2] == ["train", "--max-steps"] and r.returncode == 0:
            # The volume the helper pod mounts holds this job's checkpoints.
            _mirror(folder / "ckpts", world.volume / "my-job" / "checkpoints")
        code, says = next((v for rx, v in EXPECT.items() if re.search(rx, line)), (0, None))
        where = f"{skill}: `{line}`"
        assert r.returncode == code, f"{where} exited {r.returncode}, not {code}:\n{r.stdout[-1500:]}\n" \
                                     f"{r.stderr[-2000:]}"
        if "--json" in argv:
            envelope = json.loads(r.stdout)
            assert envelope["ok"] is (code == 0), f"{where}: {envelope}"
        if says:
            assert says in r.stdout + r.stderr, f"{where}: no {says!r} in\n{r.stdout[-1500:]}\n{r.stderr[-1500:]}"


def _mirror(src: Path, dst: Path) -> None:
    import shutil

    if dst.exists():
        shutil.rmtree(dst)
    shutil.copytree(src, dst)
