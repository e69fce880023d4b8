"""Job specs and the training operator's side of a PyTorchJob, for the tests that submit to kmock."""

from __future__ import annotations

import datetime as dt

import yaml

from conftest import run_cli

TOKEN = "hf_s3cr3t_V4lue_never_printed"


GROUP, VERSION, PLURAL = "kubeflow.org", "v1", "pytorchjobs"


def write_spec(tmp_path, **fields):
    doc = {
        "name": "llama-tiny", "backend": "pytorchjob",
        "image": "123456789012.dkr.ecr.us-west-2.amazonaws.com/fsdpkit:1",
        "instance_type": "p5.48xlarge", "nodes": 2, "hf_token_env": "MY_HF_TOKEN",
        "storage": {"size": "1200Gi", "storage_class": "fsx-sc"},
        "train": {"preset": "tiny", "max_steps": 50, "checkpoint_freq": 10},
        **fields,
    }
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


def job_cli(kube, *args, env=None):
    return run_cli("job", *args, env={**kube.env, "MY_HF_TOKEN": TOKEN, **(env or {})}, timeout=120)


def writes(kube):
    return [(m, p.split("?")[0]) for m, p, _ in kube.requests() if m in ("POST", "PATCH", "PUT", "DELETE")]


def set_conditions(kube, name, *types):
    """Play the training operator: it patches the job's status subresource with its conditions."""
    from kubernetes import client

    conds = [{"type": t, "status": "True" if i == len(types) - 1 or t == "Created" else "False",
              "reason": f"PyTorchJob{t}", "message": f"PyTorchJob {name} is {t.lower()}.",
              "lastTransitionTime": f"2026-11-22T10:00:{i:02d}Z"} for i, t in enumerate(types)]
    client.CustomObjectsApi(kube.api()).patch_namespaced_custom_object_status(
        GROUP, VERSION, "default", PLURAL, name, {"status": {"conditions": conds}})


def stamp(seconds_ago: float) -> str:
    t = dt.datetime.now(dt.timezone.utc) - dt.timedelta(seconds=seconds_ago)
    return t.strftime("%Y-%m-%dT%H:%M:%S.%f") + "123Z"  # nanoseconds, as the kubelet writes them
