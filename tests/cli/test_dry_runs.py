"""Where something would be created, `--dry-run` says what, on a machine with no AWS credentials,
no region and no kubeconfig: an agent or a person can see the plan before they have an account."""

from __future__ import annotations

import json

import pytest
import yaml

from fsdpkit.cluster import pod_rules

from conftest import run_cli
from manifest_schemas import kubectl_reads, pod_of, validate_builtin

pytestmark = pytest.mark.slow


@pytest.fixture
def offline(tmp_path):
    """An environment with nothing to reach: no AWS credentials or region, no kubeconfig, and AWS's
    instance metadata service not asked (there is none here)."""
    return {"AWS_CONFIG_FILE": str(tmp_path / "none"), "AWS_SHARED_CREDENTIALS_FILE": str(tmp_path / "none"),
            "AWS_ACCESS_KEY_ID": "", "AWS_SECRET_ACCESS_KEY": "", "AWS_REGION": "", "AWS_DEFAULT_REGION": "",
            "AWS_EC2_METADATA_DISABLED": "true", "KUBECONFIG": str(tmp_path / "none"),
            "FSDPKIT_HOME": str(tmp_path / "home")}


def test_image_build_push_and_infra_up_print_their_plan_without_aws(tmp_path, offline):
    (tmp_path / "Dockerfile").write_text("FROM x\n")
    r = run_cli("image", "build", str(tmp_path), "--repository", "my-llm", "--tag-strategy", "latest", "--dry-run",
                "--json", env=offline)
    assert r.returncode == 0, r.stderr
    plan = json.loads(r.stdout)["data"]
    assert plan["dry_run"] is True and plan["image"] == "ACCOUNT.dkr.ecr.REGION.amazonaws.com/my-llm:latest"
    assert plan["where"] == "codebuild" and "CodeBuild builds it" in plan["steps"][1]
    assert "dry run without AWS" in r.stderr and "ACCOUNT and REGION stand for yours" in r.stderr

    r = run_cli("image", "push", "my-llm:v1", "--region", "us-east-1", "--dry-run", "--json", env=offline)
    assert r.returncode == 0, r.stderr
    plan = json.loads(r.stdout)["data"]
    assert plan["image"] == "ACCOUNT.dkr.ecr.us-east-1.amazonaws.com/my-llm:v1"
    assert plan["steps"][2:4] == ["docker tag my-llm:v1 ACCOUNT.dkr.ecr.us-east-1.amazonaws.com/my-llm:v1",
                                  "docker push ACCOUNT.dkr.ecr.us-east-1.amazonaws.com/my-llm:v1"]

    r = run_cli("infra", "create", "--dry-run", "--json", env=offline)
    assert r.returncode == 0, r.stderr
    data = json.loads(r.stdout)["data"]
    assert data["offline"] is True and data["would_create"] == [
        "s3 bucket fsdpkit-build-ACCOUNT-REGION", "iam role fsdpkit-codebuild-REGION", "log group /fsdpkit/codebuild",
        "codebuild project fsdpkit-image-build", "ecr repository fsdpkit"]
    # Without --dry-run the missing credentials are the answer, in one line.
    r = run_cli("infra", "create", "--region", "us-west-2", env=offline)
    assert r.returncode == 3 and "no AWS credentials found" in r.stderr and r.stderr.count("\n") == 1


def test_validate_nccl_and_ray_submit_print_what_they_would_create_without_a_cluster(tmp_path, offline):
    r = run_cli("cluster", "validate", "nccl", "--nodes", "2", "--instance-type", "p5.48xlarge", "--dry-run",
                env=offline)
    assert r.returncode == 0, r.stderr
    (job,) = kubectl_reads(r.stdout)
    assert job["kind"] == "MPIJob" and job["spec"]["mpiReplicaSpecs"]["Worker"]["replicas"] == 2
    for _, template in pod_rules.templates(job):
        assert not pod_rules.pod_errors(template["spec"])
        validate_builtin(pod_of(template))
    spec = tmp_path / "job.yaml"
    spec.write_text(yaml.safe_dump({"name": "verl", "image": "x/y:1", "instance_type": "p5.48xlarge", "nodes": 2}))
    r = run_cli("ray", "submit", str(spec), "--dry-run", "--json", "--", "python", "-m", "train", env=offline)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["data"]["manifest"]["spec"]["entrypoint"] == "python -m train"
