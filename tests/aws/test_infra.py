"""`fsdpkit infra` against moto in server mode over HTTP: up twice makes one of each resource, down
removes exactly those, the CloudFormation template declares the same; credentials, permission and
throttling failures are one line each."""

from __future__ import annotations

import http.server
import json
import sys
import threading
import time

import pytest
import yaml
from fake_tools import FAKE_DOCKER
from http_reply import XML, QuietHandler

from conftest import aws_client as client
from conftest import require, run_cli

boto3 = require("boto3")

KINDS = {"s3 bucket": "AWS::S3::Bucket", "iam role": "AWS::IAM::Role", "log group": "AWS::Logs::LogGroup",
         "codebuild project": "AWS::CodeBuild::Project", "ecr repository": "AWS::ECR::Repository"}


def test_up_twice_makes_one_of_each_and_down_removes_only_ours(moto):
    url, env = moto
    # Someone else's resources in the same account: down must leave them alone.
    client(url, "s3").create_bucket(Bucket="not-ours", CreateBucketConfiguration={"LocationConstraint": "us-west-2"})
    client(url, "ecr").create_repository(repositoryName="their-repo")

    # A dry run says what up would create, and creates nothing (the AWS calls it made only read).
    r = run_cli("infra", "create", "--dry-run", "--json", env=env)
    assert r.returncode == 0, r.stderr
    assert len(json.loads(r.stdout)["data"]["would_create"]) == 5 and "dry run: plan: create" in r.stderr
    assert [b["Name"] for b in client(url, "s3").list_buckets()["Buckets"]] == ["not-ours"]

    r = run_cli("infra", "create", "--json", env=env)
    assert r.returncode == 0, r.stderr
    created = json.loads(r.stdout)["data"]["created"]
    account = json.loads(r.stdout)["data"]["account"]
    assert [c.rsplit(" ", 1)[0] for c in created] == ["s3 bucket", "log group", "ecr repository", "iam role",
                                                      "codebuild project"]
    assert f"s3 bucket fsdpkit-build-{account}-us-west-2" in created
    r = run_cli("infra", "create", "--json", env=env)
    assert json.loads(r.stdout)["data"]["created"] == [] and "nothing to do" in r.stderr

    s3, ecr, cb = client(url, "s3"), client(url, "ecr"), client(url, "codebuild")
    assert sorted(b["Name"] for b in s3.list_buckets()["Buckets"]) == sorted(
        ["not-ours", f"fsdpkit-build-{account}-us-west-2"])
    repo = ecr.describe_repositories(repositoryNames=["fsdpkit"])["repositories"][0]
    assert repo["imageScanningConfiguration"] == {"scanOnPush": True}
    assert json.loads(ecr.get_lifecycle_policy(repositoryName="fsdpkit")["lifecyclePolicyText"])["rules"][0][
        "selection"]["countNumber"] == 50
    project = cb.batch_get_projects(names=["fsdpkit-image-build"])["projects"][0]
    assert project["environment"]["privilegedMode"] is True
    spec = yaml.safe_load(project["source"]["buildspec"])
    assert set(spec["phases"]) == {"pre_build", "build", "post_build"}
    assert any("docker push $IMAGE_URI" in c for c in spec["phases"]["post_build"]["commands"])
    policy = client(url, "iam").get_role_policy(RoleName="fsdpkit-codebuild-us-west-2", PolicyName="fsdpkit-codebuild")
    actions = {a for s in policy["PolicyDocument"]["Statement"] for a in s["Action"]}
    assert "ecr:PutImage" in actions and not any(a.endswith("*") for a in actions)  # least privilege

    r = run_cli("infra", "status", "--json", env=env)
    assert all(json.loads(r.stdout)["data"]["resources"].values())
    r = run_cli("infra", "delete", "--json", env=env)   # the bucket goes with every object version: asked first
    assert r.returncode == 2 and "add --yes to confirm" in json.loads(r.stdout)["error"]["message"]
    assert all(json.loads(run_cli("infra", "status", "--json", env=env).stdout)["data"]["resources"].values())
    r = run_cli("infra", "delete", "--yes", "--json", env=env)
    assert r.returncode == 0, r.stderr
    assert len(json.loads(r.stdout)["data"]["removed"]) == 5
    assert [b["Name"] for b in s3.list_buckets()["Buckets"]] == ["not-ours"]
    assert [x["repositoryName"] for x in ecr.describe_repositories()["repositories"]] == ["their-repo"]
    assert cb.batch_get_projects(names=["fsdpkit-image-build"])["projects"] == []
    r = run_cli("infra", "status", "--json", env=env)
    assert not any(json.loads(r.stdout)["data"]["resources"].values())


def test_template_declares_the_same_resources_as_up():
    r = run_cli("infra", "template")
    doc = yaml.safe_load(r.stdout)
    assert sorted(res["Type"] for res in doc["Resources"].values()) == sorted(KINDS.values())
    project = doc["Resources"]["Project"]["Properties"]
    assert set(yaml.safe_load(project["Source"]["BuildSpec"])["phases"]) == {"pre_build", "build", "post_build"}


def test_missing_region_and_credentials_are_one_line(moto, tmp_path):
    _, env = moto
    r = run_cli("infra", "status", env={**env, "AWS_REGION": "", "AWS_DEFAULT_REGION": ""})
    assert r.returncode == 2 and r.stderr.strip().startswith("error: no AWS region: pass --region or set AWS_REGION")
    r = run_cli("infra", "status", env={**env, "AWS_ACCESS_KEY_ID": "", "AWS_SECRET_ACCESS_KEY": ""})
    assert r.returncode == 3
    assert "no AWS credentials found" in r.stderr and len(r.stderr.strip().splitlines()) == 1
    # Neither (a fresh laptop): exit 3 as every AWS command without credentials, not the region's 2.
    r = run_cli("image", "push", "fsdpkit:v1", env={**env, "AWS_ACCESS_KEY_ID": "", "AWS_SECRET_ACCESS_KEY": "",
                                                    "AWS_REGION": "", "AWS_DEFAULT_REGION": ""})
    assert r.returncode == 3
    assert r.stderr.strip().splitlines() == [
        "error: no AWS credentials found and no AWS region: run `aws configure` or `aws sso login`, or set "
        "AWS_PROFILE / AWS_ACCESS_KEY_ID and AWS_REGION"]


class _Denying(QuietHandler):
    """An AWS endpoint that answers every call with one error code (what IAM or a throttled API says)."""

    code, status, seen = "AccessDenied", 403, []

    def _answer(self):
        self.seen.append(self.path)
        body = (f"<ErrorResponse><Error><Type>Sender</Type><Code>{self.code}</Code><Message>User: arn:aws:iam::"
                f"000000000000:user/dev is not authorized</Message></Error></ErrorResponse>").encode()
        self.reply(self.status, body, XML)

    do_GET = do_POST = _answer


@pytest.mark.parametrize(("code", "status", "expect"), [
    ("AccessDenied", 403, "access denied for sts:GetCallerIdentity; your role needs that IAM permission"),
    ("Throttling", 400, "AWS kept throttling GetCallerIdentity after retries with backoff"),
])
def test_denied_and_throttled_calls_are_one_line(moto, code, status, expect):
    _, env = moto
    handler = type("H", (_Denying,), {"code": code, "status": status, "seen": []})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        endpoint = f"http://127.0.0.1:{server.server_port}"
        env = {**env, "FSDPKIT_AWS_ENDPOINT_URL": endpoint, "AWS_MAX_ATTEMPTS": "3"}
        r = run_cli("infra", "status", env=env)
        calls = len(handler.seen)
        error = json.loads(run_cli("infra", "status", "--json", env=env).stdout)["error"]
    finally:
        server.shutdown()
    # An agent branches on the code and follows the hint.
    assert error["code"] == ("access_denied" if code == "AccessDenied" else "unreachable")
    assert error["hint"] == ("grant sts:GetCallerIdentity to your IAM role or user" if code == "AccessDenied"
                             else "try again in a minute, or ask for a higher API rate limit")
    assert r.returncode == 3
    assert expect in r.stderr and len(r.stderr.strip().splitlines()) == 1
    # Throttling was retried with backoff (botocore's standard mode); a denial was not.
    assert calls >= 3 if code == "Throttling" else calls == 1


def test_image_build_in_codebuild_uploads_the_context_and_reports_the_build(moto, tmp_path):
    import io
    import zipfile

    url, env = moto
    assert run_cli("infra", "create", env=env).returncode == 0
    ctx = tmp_path / "my-trainer"
    (ctx / "src").mkdir(parents=True)
    (ctx / "src" / "train.py").write_text("print('hi')\n")
    (ctx / "runs").mkdir()
    (ctx / "runs" / "big.bin").write_bytes(b"x" * 1000)
    (ctx / "requirements.txt").write_text("datasets\n")
    assert run_cli("image", "init", "--out", str(ctx)).returncode == 0
    r = run_cli("image", "build", str(ctx), "--codebuild", "--tag-strategy", "latest", "--poll", "0.1", "--json",
                env=env, timeout=120)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)["data"]
    assert out["status"] == "SUCCEEDED" and out["where"] == "codebuild"
    assert out["image"].endswith(".amazonaws.com/my-trainer:latest")
    bucket, key = out["context"].removeprefix("s3://").split("/", 1)
    body = client(url, "s3").get_object(Bucket=bucket, Key=key)["Body"].read()
    names = sorted(zipfile.ZipFile(io.BytesIO(body)).namelist())
    # runs/ is ignored; the fsdpkit wheel `image init` built travels with the project it installs into.
    wheels = [n for n in names if n.startswith(".fsdpkit/")]
    assert len(wheels) == 1 and wheels[0].endswith(".whl"), names
    assert sorted(set(names) - set(wheels)) == [".dockerignore", "Dockerfile", "requirements.txt", "src/train.py"]
    builds = client(url, "codebuild").list_builds_for_project(projectName="fsdpkit-image-build")["ids"]
    assert builds == [out["build"]]
    repo = client(url, "ecr").describe_repositories(repositoryNames=["my-trainer"])["repositories"][0]
    assert repo["imageScanningConfiguration"] == {"scanOnPush": True}


def test_build_log_is_followed_until_the_build_ends(moto):
    """CodeBuild writes its log while it runs; moto ends builds at once, so the test writes the
    stream and says when the build is over, and the follower must print every line exactly once."""
    from fsdpkit.aws.build import follow_logs

    url, _ = moto
    logs = client(url, "logs")
    logs.create_log_group(logGroupName="/fsdpkit/codebuild")
    logs.create_log_stream(logGroupName="/fsdpkit/codebuild", logStreamName="b1")
    script = [["[Container] Entering phase PRE_BUILD"], [], ["Step 1/9 : FROM ...", "Step 2/9 : ENV ..."],
              ["PASS  imports", "[Container] Phase complete: POST_BUILD State: SUCCEEDED"]]
    seen, polls = [], {"n": 0}
    now = int(time.time() * 1000)  # CloudWatch drops events older than 14 days

    def finished():
        i = polls["n"]
        polls["n"] += 1
        if i < len(script) and script[i]:
            logs.put_log_events(logGroupName="/fsdpkit/codebuild", logStreamName="b1", logEvents=[
                {"timestamp": now + i * 10 + j, "message": m} for j, m in enumerate(script[i])])
        return i >= len(script) - 1
    n = follow_logs(logs, "/fsdpkit/codebuild", "b1", finished, seen.append, poll=0)
    assert seen == [m for lines in script for m in lines] and n == 5


def test_push_creates_the_repository_with_its_policies(moto):
    url, env = moto
    r = run_cli("image", "push", "my-trainer:v1", "--immutable-tags", env={**env, "PATH": "/usr/bin:/bin"})
    repo = client(url, "ecr").describe_repositories(repositoryNames=["my-trainer"])["repositories"][0]
    assert repo["imageTagMutability"] == "IMMUTABLE" and repo["imageScanningConfiguration"] == {"scanOnPush": True}
    assert client(url, "ecr").get_lifecycle_policy(repositoryName="my-trainer")["lifecyclePolicyText"]
    if r.returncode != 0:  # no Docker engine on this machine: said in one line, the repository is ready
        assert "no Docker engine here" in r.stderr and len(r.stderr.strip().splitlines()) == 1


def test_push_records_the_digest_and_a_submitted_job_runs_exactly_it(moto, tmp_path):
    url, env = moto
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "docker").write_text(FAKE_DOCKER.format(python=sys.executable))
    (bin_dir / "docker").chmod(0o755)
    env = {**env, "PATH": f"{bin_dir}:/usr/bin:/bin", "FSDPKIT_HOME": str(tmp_path / "home")}
    r = run_cli("image", "push", "my-trainer:v1", "--json", env=env)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)["data"]
    ecr_digest = client(url, "ecr").describe_images(repositoryName="my-trainer")["imageDetails"][0]["imageDigest"]
    assert out["digest"] == ecr_digest and out["pinned"] == out["image"].rsplit(":", 1)[0] + "@" + ecr_digest
    spec = tmp_path / "job.yaml"
    spec.write_text(f"name: j\nbackend: pytorchjob\nimage: {out['image']}\ntrain: {{preset: tiny}}\n")

    def container(*extra):
        r = run_cli("job", "render", str(spec), "--json", *extra, env=env)
        assert r.returncode == 0, r.stderr
        job = json.loads(r.stdout)["data"]["manifests"][-1]
        return job["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]["containers"][0]
    pinned = container()
    assert (pinned["image"], pinned["imagePullPolicy"]) == (out["pinned"], "IfNotPresent")
    # An image given on the command line wins; a tag is mutable, so nodes must pull it every time.
    given = container("--set", f"image={out['image']}")
    assert (given["image"], given["imagePullPolicy"]) == (out["image"], "Always")


def test_image_test_in_codebuild_runs_the_images_selftest(moto):
    url, env = moto
    assert run_cli("infra", "create", env=env).returncode == 0
    image = "000000000000.dkr.ecr.us-west-2.amazonaws.com/my-trainer:latest"
    r = run_cli("image", "test", image, "--codebuild", "--level", "full", "--poll", "0.1", "--json", env=env)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)["data"]
    assert out["status"] == "SUCCEEDED" and out["context"] is None
    assert client(url, "codebuild").list_builds_for_project(projectName="fsdpkit-image-build")["ids"] == [
        out["build"]]
    # Testing an image uploads no build context. (moto does not keep a build's overrides, so the
    # buildspec it runs is checked on its own below.)
    bucket = next(b["Name"] for b in client(url, "s3").list_buckets()["Buckets"] if b["Name"].startswith("fsdpkit"))
    assert client(url, "s3").list_objects_v2(Bucket=bucket).get("KeyCount", 0) == 0


def test_test_buildspec_runs_the_selftest():
    from fsdpkit.aws.build import test_buildspec

    spec = yaml.safe_load(yaml.safe_dump(test_buildspec("r/i:t", "full")))
    assert spec["phases"]["build"]["commands"] == ["docker pull $IMAGE_URI",
                                                   "docker run --rm $IMAGE_URI fsdpkit selftest --level full"]


def test_down_keeps_a_repository_that_holds_images(moto):
    url, env = moto
    assert run_cli("infra", "create", env=env).returncode == 0
    client(url, "ecr").put_image(repositoryName="fsdpkit", imageTag="v1", imageManifest=json.dumps(
        {"schemaVersion": 2, "mediaType": "application/vnd.docker.distribution.manifest.v2+json",
         "config": {"mediaType": "application/vnd.docker.container.image.v1+json", "size": 1,
                    "digest": "sha256:" + "0" * 64}, "layers": []}))
    r = run_cli("infra", "delete", "--dry-run", "--json", env=env)
    would = json.loads(r.stdout)["data"]["would_remove"]
    assert r.returncode == 0 and len(would) == 4 and "ecr repository fsdpkit" not in would
    status = json.loads(run_cli("infra", "status", "--json", env=env).stdout)["data"]["resources"]
    assert len(status) == 5 and all(status.values())   # nothing removed
    r = run_cli("infra", "delete", "--yes", "--json", env=env)
    assert r.returncode == 0 and "kept ecr repository fsdpkit: it holds 1 image(s)" in r.stderr
    assert [x["repositoryName"] for x in client(url, "ecr").describe_repositories()["repositories"]] == ["fsdpkit"]
    r = run_cli("infra", "delete", "--delete-images", "--yes", "--json", env=env)
    assert json.loads(r.stdout)["data"]["removed"] == ["ecr repository fsdpkit"]
