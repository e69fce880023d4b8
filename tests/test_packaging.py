"""The installed package, not the checkout: a wheel built from this tree carries the skills and the
example specs, and with it alone an agent's path runs as its skill writes it: install the skills,
then `job init` -> `plan` -> `job submit --dry-run` for Llama 3.1 8B on 4 x p5.48xlarge with an FSx
claim, and the job it renders checkpoints periodically and at its last step."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from doc_commands import command_lines, tokens

from conftest import ROOT

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """(run, workdir): the CLI of a wheel of this tree installed into a folder of its own, run from a
    folder that holds no checkout."""
    root = tmp_path_factory.mktemp("wheel")
    tree = root / "tree"  # a copy, so the build leaves nothing in the checkout
    shutil.copytree(ROOT / "src", tree / "src", ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, tree / name)
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w",
                    str(root / "dist"), str(tree)], check=True, capture_output=True)
    (wheel,) = (root / "dist").glob("fsdpkit-*.whl")
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(root / "site"),
                    str(wheel)], check=True, capture_output=True)
    work = root / "work"
    work.mkdir()
    env = {**os.environ, "PYTHONPATH": str(root / "site"), "HOME": str(root / "home"),
           "FSDPKIT_HOME": str(root / "fsdpkit-home")}

    def run(*argv: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "fsdpkit", *argv], capture_output=True, text=True, cwd=work,
                              env=env, timeout=300)
    where = subprocess.run([sys.executable, "-c", "import fsdpkit; print(fsdpkit.__file__)"], capture_output=True,
                           text=True, cwd=work, env=env).stdout
    assert where.startswith(str(root / "site")), where  # the wheel's fsdpkit, not the checkout's
    return run, work


def test_examples_and_skills_ship_in_the_wheel(installed):
    run, work = installed
    r = run("examples", "list", "--json")
    assert r.returncode == 0, r.stderr
    assert {e["name"] for e in json.loads(r.stdout)["data"]} >= {"eks-p5", "hyperpod-p5", "trainjob-p5",
                                                                  "slurm-p5", "local-tiny"}
    r = run("examples", "show", "hyperpod-p5")
    assert r.returncode == 0 and "backend: hyperpod" in r.stdout
    r = run("skills", "install", "--target", "claude", "--json")
    assert r.returncode == 0, r.stderr
    installed_skills = {p.parent.name for p in (work / ".claude" / "skills").glob("*/SKILL.md")}
    assert {"fsdpkit-job-spec", "fsdpkit-deploy-job", "fsdpkit-hyperpod", "fsdpkit-ray"} <= installed_skills


def test_job_init_plan_and_dry_run_from_the_installed_skill(installed):
    run, work = installed
    assert run("skills", "install", "--target", "claude").returncode == 0
    skill = work / ".claude" / "skills" / "fsdpkit-job-spec" / "SKILL.md"
    lines = [line for line in command_lines(skill)
             if line.startswith(("fsdpkit job init", "fsdpkit plan", "fsdpkit job submit"))]
    assert [tokens(x)[1:3] for x in lines] == [["job", "init"], ["plan", "job.yaml"], ["job", "submit"]]
    assert "--dry-run" in lines[-1] and "llama3_1_8b" in lines[0] and "--nodes 4" in lines[0]
    outputs = []
    for line in lines:
        r = run(*tokens(line)[1:])
        assert r.returncode == 0, f"`{line}`: {r.stdout[-800:]} {r.stderr[-800:]}"
        outputs.append(json.loads(r.stdout))
    plan = outputs[1]["data"]
    assert plan["nodes"] == 4 and plan["instance_type"] == "p5.48xlarge" and plan["fits"] is True
    every = plan["checkpoints"]["every"]
    assert every.endswith("m") and int(every[:-1]) >= 10   # periodic, at most 5% of the run spent saving
    assert outputs[2]["data"]["dry_run"] == "client" and outputs[2]["data"]["objects"][-1] == "PyTorchJob/llama3-1-8b"

    r = run("job", "render", "job.yaml", "--json")
    job = json.loads(r.stdout)["data"]["manifests"][-1]
    command = job["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]["containers"][0]["command"]
    flags = command[command.index("fsdpkit.train") + 1:]
    from fsdpkit.train.config import parse_args

    cfg = parse_args(flags)
    ck = cfg.checkpoint
    # Periodically on the FSx claim (the plan's interval), and at the last step: a run with a
    # checkpoint_dir always saves its last step. Every start resumes from the newest one.
    assert ck.checkpoint_every == every and ck.every_seconds == int(every[:-1]) * 60
    assert ck.checkpoint_dir == "/checkpoints/llama3-1-8b/checkpoints" and ck.resume_from_checkpoint == "auto"
    volumes = job["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]["volumes"]
    assert {"name": "checkpoints", "persistentVolumeClaim": {"claimName": "fsx-claim"}} in volumes


# What the trainer imports to open the tier (fsdpkit.train.checkpoint.tiered.MemoryTier.open).
TIER_IMPORT = ("import amzn_sagemaker_checkpointing.checkpointing.filesystem.filesystem as f, "
               "amzn_sagemaker_checkpointing.config.sagemaker_checkpoint_config; print(f.__file__)")

# What a QLoRA run imports (fsdpkit.train.model.nf4), and the torch it runs on: the base image's.
NF4_IMPORT = ("import sys, torch; from fsdpkit.train.model import nf4; n = nf4._torchao(); "
              "print(n.__file__); assert not torch.__file__.startswith(sys.prefix), torch.__file__")


def _base_layer(venv: Path, layer: Path) -> None:
    """What a base image holds before the Dockerfile runs: torch and what it requires, as installed
    here, linked into `layer`, which the venv reads as a site directory (pip sees them installed)."""
    import importlib.metadata as md
    import re

    todo, seen = ["torch"], set()
    while todo:
        name = re.split(r"[ ;<>=!~\[(]", todo.pop())[0].lower().replace("_", "-")
        if name in seen:
            continue
        seen.add(name)
        try:
            dist = md.distribution(name)
        except md.PackageNotFoundError:
            continue   # an optional or platform-only requirement
        todo += [r for r in dist.requires or [] if "extra ==" not in r]
        for top in {f.parts[0] for f in dist.files or [] if not f.parts[0].startswith("..")}:
            target = Path(dist.locate_file(top))
            if target.exists() and not (layer / top).exists():
                layer.mkdir(exist_ok=True)
                (layer / top).symlink_to(target)
    (site,) = venv.glob("lib/python*/site-packages")
    (site / "base-image.pth").write_text(f"{layer}\n")


def _image_steps(dockerfile: Path, project: Path, root: Path, env: dict[str, str]) -> None:
    """Run a Dockerfile's instructions up to the project's own files (`COPY . ...`) as `docker build`
    would on a machine whose Python is this venv: COPY into `root` (the image's filesystem), ENV into
    `env`, RUN with bash; absolute paths of the image land under `root`."""
    import re

    def here(text: str) -> str:
        return re.sub(r"(?<![\w.])/(tmp|etc)/", rf"{root}/\1/", text)

    for line in dockerfile.read_text().replace("\\\n", " ").splitlines():
        op, _, rest = line.partition(" ")
        if op == "COPY" and rest.split()[0] == ".":
            return
        if op == "COPY":
            src, dst = rest.split()
            Path(here(dst)).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(project / src, here(dst))
        elif op == "ENV":
            env.update(dict(kv.split("=", 1) for kv in here(rest).split()))
        elif op == "RUN":
            r = subprocess.run(["bash", "-c", here(rest)], capture_output=True, text=True, env=env, timeout=600)
            assert r.returncode == 0, f"RUN {rest}: {r.stdout[-1500:]} {r.stderr[-1500:]}"


def test_an_image_from_an_installed_wheel_installs_fsdpkit_in_a_clean_venv(installed, tmp_path):
    """A user with the wheel only (no checkout, and no package index that has this version): `image
    init` packs the running fsdpkit into the build context, and the Dockerfile's own install steps
    work in a fresh venv standing in for the base image (its torch is the base's). With --tiered,
    pip installs the wheel's tiered extra: the image can open HyperPod's in-memory tier; with --qlora
    its qlora extra: torchao's NF4 tensor for a QLoRA job, under the base's torch."""
    run, work = installed
    project = work / "my-project"
    r = run("image", "init", "--out", str(project), "--no-requirements", "--tiered", "--qlora", "--json")
    assert r.returncode == 0, r.stderr
    data = json.loads(r.stdout)["data"]
    assert data["fsdpkit"] == ".fsdpkit/fsdpkit-0.1.0-py3-none-any.whl"
    venv, root = tmp_path / "image-venv", tmp_path / "image-root"
    (root / "etc").mkdir(parents=True)
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    _base_layer(venv, tmp_path / "base-layer")
    env = {"PATH": f"{venv / 'bin'}:/usr/bin:/bin", "HOME": str(tmp_path / "home"),
           "PIP_DISABLE_PIP_VERSION_CHECK": "1"}
    _image_steps(project / "Dockerfile", project, root, env)
    r = subprocess.run([str(venv / "bin" / "fsdpkit"), "--version"], capture_output=True, text=True, env=env)
    assert r.returncode == 0 and r.stdout.strip() == "fsdpkit 0.1.0", r.stderr
    where = subprocess.run([str(venv / "bin" / "python"), "-c", "import fsdpkit; print(fsdpkit.__file__)"],
                           capture_output=True, text=True, env=env, cwd=tmp_path).stdout
    assert where.startswith(str(venv)), where   # installed from the wheel in the build context
    for code in (TIER_IMPORT, NF4_IMPORT):
        r = subprocess.run([str(venv / "bin" / "python"), "-c", code], capture_output=True, text=True, env=env,
                           cwd=tmp_path)
        assert r.returncode == 0 and r.stdout.startswith(str(venv)), r.stdout + r.stderr[-1500:]
    import torch

    assert (root / "etc" / "pip-constraints.txt").read_text().strip() == f"torch=={torch.__version__.split('+')[0]}"
