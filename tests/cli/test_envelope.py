"""Every command group answers `--json` with one envelope, on success and on error:
`{"ok": bool, "data": ..., "error": null | {"code", "message", "hint"}}` and nothing else on stdout."""

from __future__ import annotations

import json

import pytest

from conftest import FAST, ROOT, run_cli

pytestmark = pytest.mark.slow

SPEC = str(ROOT / "examples" / "jobs" / "local-tiny.yaml")
CLUSTER_SPEC = str(ROOT / "examples" / "jobs" / "eks-p5.yaml")
OFFLINE_AWS = {"FSDPKIT_AWS_ENDPOINT_URL": "http://127.0.0.1:9", "AWS_MAX_ATTEMPTS": "1", "AWS_REGION": "us-west-2",
               "AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing"}

# group -> (a command that succeeds offline, a command that fails on bad input); {tmp} and {run} are filled in.
# `cluster check` succeeding needs a cluster: its envelope is checked against kmock in test_cluster_check.py.
# `storage fsx create` and `cluster addons install` succeeding for real: test_provision.py (moto, kmock).
# `deploy` succeeding needs a cluster and an operator: test_deploy.py checks that envelope on kmock.
CASES = {
    # Two processes under torchrun: stdout must still be rank 0's envelope alone.
    "train": (["train", "--nproc", "2", *FAST, "--max_steps", "2", "--tensorboard", "0", "--run_dir", "{tmp}/t"],
              ["train", "--lr", "-1"]),
    "presets": (["presets"], ["presets", "--bogus"]),
    "plan": (["plan", "--preset", "llama3_1_8b", "--instance-type", "p5.48xlarge"], ["plan", "--nodes", "0"]),
    "ckpt": (["ckpt", "list", "{run}/ckpt"], ["ckpt", "show", "{tmp}/missing"]),
    "export": (["export", "{run}/ckpt", "{tmp}/hf"], ["export", "{tmp}/missing", "{tmp}/hf2"]),
    # `eval` succeeding needs lm-evaluation-harness and a task: tests/train/test_evaluate.py checks its envelope.
    "eval": (None, ["eval", "{tmp}/missing", "--tasks", "hellaswag"]),
    "data": (["data", "prepare", "--dataset", "{tmp}/docs.jsonl", "--out", "{tmp}/shards"],
             ["data", "prepare", "--dataset", "{tmp}/missing.jsonl", "--out", "{tmp}/shards2"]),
    "tokenizer": (["tokenizer", "train", "--dataset", "{tmp}/docs.jsonl", "--vocab_size", "300", "--out", "{tmp}/tok"],
                  ["tokenizer", "train", "--dataset", "{tmp}/docs.jsonl", "--vocab_size", "0", "--out", "{tmp}/t2"]),
    "job": (["job", "render", SPEC], ["job", "render", SPEC, "--set", "nodes=0"]),
    "ray": (["ray", "create", CLUSTER_SPEC, "--dry-run"], ["ray", "create", "{tmp}/missing.yaml", "--dry-run"]),
    "deploy": (None, ["deploy", "{tmp}/missing.yaml"]),
    "cluster": (["cluster", "config", "--name", "llm", "--region", "us-west-2", "--instance-type", "p5.48xlarge",
                 "--nodes", "2"], ["cluster", "check", "--kubeconfig", "{tmp}/no-kubeconfig"]),
    "storage": (["storage", "fsx", "create", "ckpt", "--dry-run"],
                ["storage", "fsx", "create", "ckpt", "--size", "3000"]),
    "image": (["image", "init", "--no-requirements", "--out", "{tmp}/img"],
              ["image", "check", "{tmp}/missing/Dockerfile"]),
    "infra": (["infra", "template"], ["infra", "status"]),
    "report": (["report", "{run}/run"], ["report", "{tmp}"]),
    "skills": (["skills", "list"], ["skills", "install", "--target", "vim"]),
    "selftest": (["selftest", "--level", "quick"], ["selftest", "--level", "bogus"]),
}


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    """A one-step training run with a checkpoint, for the commands that read runs and checkpoints."""
    root = tmp_path_factory.mktemp("envelope")
    r = run_cli("train", *FAST, "--max_steps", "2", "--logging_freq", "1", "--tensorboard", "0",
                "--run_dir", str(root / "run"), "--checkpoint_dir", str(root / "ckpt"), "--checkpoint_freq", "2")
    assert r.returncode == 0, r.stderr[-2000:]
    return root


def _run(argv: list[str], tmp, run) -> tuple[int, dict]:
    args = [a.format(tmp=tmp, run=run) for a in argv] + ["--json"]
    r = run_cli(*args, env=OFFLINE_AWS, timeout=120)
    envelope = json.loads(r.stdout)  # the whole of stdout is one JSON document
    assert set(envelope) == {"ok", "data", "error"}, r.stdout[:500]
    return r.returncode, envelope


@pytest.mark.parametrize("group", CASES)
def test_json_envelope_on_success_and_on_error(group, run_dir, tmp_path):
    (tmp_path / "docs.jsonl").write_text("".join(json.dumps({"text": f"document {i} " * 20}) + "\n"
                                                 for i in range(50)))
    ok_argv, bad_argv = CASES[group]
    if ok_argv:
        code, env = _run(ok_argv, tmp_path, run_dir)
        assert code == 0 and env["ok"] is True and env["error"] is None, env
    code, env = _run(bad_argv, tmp_path, run_dir)
    assert code != 0 and env["ok"] is False and env["data"] is None, env
    error = env["error"]
    assert set(error) == {"code", "message", "hint"}
    assert error["code"] and isinstance(error["code"], str) and error["message"] and "\n" not in error["message"]


# -- the rules an agent branches on: a fixed set of codes, a hint with the action, ok iff exit 0 ------
def test_error_codes_are_one_fixed_documented_set():
    from fsdpkit.errors import CODES

    assert set(CODES) == {"bad_input", "not_found", "no_credentials", "access_denied", "unreachable", "refused",
                          "conflict", "unconfirmed", "timeout", "failed"}
    reference = (ROOT / "docs" / "reference.md").read_text()
    assert all(f"`{code}`" in reference for code in CODES)


# argv -> (exit code, error code, a piece of the hint); {tmp} is a fresh folder.
CODED = {
    "bad_input": (["job", "render", SPEC, "--set", "nodes=0"], 2, "bad_input", None),
    "unknown flag": (["job", "render", "--bogus"], 2, "bad_input", "see `fsdpkit job --help`"),
    "not_found": (["ckpt", "list", "{tmp}/missing"], 2, "not_found", None),
    "unreachable": (["infra", "status"], 3, "unreachable", "check the region and your network"),
    "conflict": (["image", "init", "--no-requirements", "--out", "{tmp}/taken"], 2, "conflict", "pass --force"),
    "failed": (["image", "check", "{tmp}/img/Dockerfile", "-r", "{tmp}/img/requirements.txt"], 1, "failed",
               "torch"),
}


@pytest.fixture(scope="module")
def images(tmp_path_factory):
    root = tmp_path_factory.mktemp("images")
    for name in ("taken", "img"):
        assert run_cli("image", "init", "--no-requirements", "--out", str(root / name)).returncode == 0
    (root / "img" / "requirements.txt").write_text("torch==2.5.1\n")  # not the base image's torch
    with (root / "taken" / "Dockerfile").open("a") as f:  # the user's own line: init must not overwrite it
        f.write("RUN pip install my-extra\n")
    return root


@pytest.mark.parametrize("case", CODED)
def test_error_code_hint_and_ok_follow_the_exit_code(case, images):
    argv, exit_code, code, hint = CODED[case]
    got, envelope = _run(argv, images, images)
    assert got == exit_code and envelope["ok"] is False, envelope
    error = envelope["error"]
    assert error["code"] == code and error["message"] and "\n" not in error["message"]
    assert (hint is None and error["hint"] is None) or hint in (error["hint"] or ""), error
    if code == "failed":  # the command ran: what it found is the data
        assert envelope["data"]["conflicts"][0]["kind"] == "torch-pin"
    else:
        assert envelope["data"] is None
