"""Image builds without Docker on the laptop: zip the build context (honouring .dockerignore), put it
in the infra bucket, start the CodeBuild project with the image URI, follow its CloudWatch log live,
and report the build's result. Also the ECR side of `image push`: the repository with its policies,
tag strategies, and the registry login."""

from __future__ import annotations

import datetime as dt
import fnmatch
import hashlib
import io
import json
import re
import subprocess
import time
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

from fsdpkit import yamlfile
from fsdpkit.aws.infra import LIFECYCLE, TAG_KEY, TAG_VALUE, Names
from fsdpkit.aws.session import Aws, aws_errors
from fsdpkit.errors import NotFound, UserError

TAG_STRATEGIES = ("auto", "git-sha", "semantic", "latest")


def _ignored(rel: str, patterns: list[str]) -> bool:
    ignored = False
    for pat in patterns:
        negate = pat.startswith("!")
        pat = pat[1:] if negate else pat
        pat = pat.strip("/")
        hit = any(fnmatch.fnmatch(candidate, pat) or fnmatch.fnmatch(candidate, f"**/{pat}")
                  or fnmatch.fnmatch(candidate, pat.removeprefix("**/"))
                  for candidate in _prefixes(rel))
        if hit:
            ignored = not negate
    return ignored


def _prefixes(rel: str) -> list[str]:
    parts = rel.split("/")
    return ["/".join(parts[:i]) for i in range(1, len(parts) + 1)]


def zip_context(context: Path) -> bytes:
    """The build context as a zip, without what .dockerignore excludes; deterministic bytes."""
    ignore = context / ".dockerignore"
    patterns = [ln.strip() for ln in ignore.read_text().splitlines() if ln.strip() and not ln.startswith("#")] \
        if ignore.is_file() else []
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED) as zf:
        for path in sorted(context.rglob("*")):
            rel = path.relative_to(context).as_posix()
            if path.is_file() and not _ignored(rel, patterns):
                info = zipfile.ZipInfo(rel, date_time=(1980, 1, 1, 0, 0, 0))
                info.external_attr = (path.stat().st_mode & 0o777) << 16
                zf.writestr(info, path.read_bytes(), zipfile.ZIP_DEFLATED)
    return buf.getvalue()


def image_name(context: Path) -> str:
    """Default repository name: the directory's name, made a valid ECR name."""
    name = re.sub(r"[^a-z0-9._/-]+", "-", context.resolve().name.lower()).strip("-._/")
    return name or "fsdpkit"


def tag_for(strategy: str, context: Path) -> str:
    if strategy not in TAG_STRATEGIES:
        raise UserError(f"--tag-strategy: {strategy!r}; choose one of: {', '.join(TAG_STRATEGIES)}")
    if strategy == "latest":
        return "latest"
    if strategy == "semantic":
        pyproject = context / "pyproject.toml"
        m = re.search(r'^version\s*=\s*"([^"]+)"', pyproject.read_text(), re.M) if pyproject.is_file() else None
        if not m:
            raise UserError("--tag-strategy semantic: no version in pyproject.toml; use auto or git-sha")
        return m.group(1)
    sha = subprocess.run(["git", "-C", str(context), "rev-parse", "--short=12", "HEAD"], capture_output=True,
                         text=True)
    if sha.returncode == 0:
        dirty = subprocess.run(["git", "-C", str(context), "status", "--porcelain"], capture_output=True,
                               text=True).stdout.strip()
        return sha.stdout.strip() + ("-dirty" if dirty else "")
    if strategy == "git-sha":
        raise UserError(f"--tag-strategy git-sha: {context} is not a git checkout; use auto or semantic")
    return dt.datetime.now(dt.timezone.utc).strftime("%Y%m%d-%H%M%S")


def repository_uri(aws: Aws, name: str) -> str:
    """An ECR repository's URI, as ECR names it (account and region of the session)."""
    return f"{aws.account}.dkr.ecr.{aws.region}.amazonaws.com/{name}"


def ensure_repository(aws: Aws, name: str, immutable: bool = False, say: Callable[[str], None] = print) -> str:
    """The ECR repository (scan on push, lifecycle policy, optional tag immutability); its URI."""
    ecr = aws.client("ecr")
    with aws_errors(f"reading repository {name}", "ecr"):
        try:
            repo = ecr.describe_repositories(repositoryNames=[name])["repositories"][0]
            say(f"repository {name} exists")
        except ecr.exceptions.RepositoryNotFoundException:
            repo = ecr.create_repository(
                repositoryName=name, imageScanningConfiguration={"scanOnPush": True},
                imageTagMutability="IMMUTABLE" if immutable else "MUTABLE",
                tags=[{"Key": TAG_KEY, "Value": TAG_VALUE}])["repository"]
            ecr.put_lifecycle_policy(repositoryName=name, lifecyclePolicyText=json.dumps(LIFECYCLE))
            say(f"created repository {name} (scan on push, {'immutable' if immutable else 'mutable'} tags, "
                "keeps the newest 50 images)")
    return cast("str", repo["repositoryUri"])


def follow_logs(logs: Any, group: str, stream: str, finished: Callable[[], bool], say: Callable[[str], None],
                poll: float = 3.0) -> int:
    """Print a CloudWatch stream as it grows until `finished()` and nothing new is left; lines printed."""
    token, printed = None, 0
    while True:
        done = finished()  # asked before reading, so the last lines written before the end are read
        try:
            kw = {"nextToken": token} if token else {"startFromHead": True}
            page = logs.get_log_events(logGroupName=group, logStreamName=stream, **kw)
        except logs.exceptions.ResourceNotFoundException:  # the stream appears once the build starts logging
            page = {"events": [], "nextForwardToken": token}
        for ev in page["events"]:
            say(ev["message"].rstrip("\n"))
            printed += 1
        new_token = page.get("nextForwardToken")
        if done and (not page["events"] or new_token == token):
            return printed
        token = new_token or token
        if not page["events"]:
            time.sleep(poll)


def test_buildspec(image_uri: str, level: str) -> dict[str, Any]:
    """Pull an image and run its own selftest (what `fsdpkit image test --codebuild` runs)."""
    return {"version": 0.2, "env": {"shell": "bash"}, "phases": {
        "pre_build": {"commands": [
            "REGISTRY=${IMAGE_URI%%/*}",
            "aws ecr get-login-password --region $AWS_REGION | docker login --username AWS --password-stdin "
            "$REGISTRY"]},
        "build": {"commands": ["docker pull $IMAGE_URI",
                               f"docker run --rm $IMAGE_URI fsdpkit selftest --level {level}"]},
    }}


def codebuild(aws: Aws, context: Path | None, image_uri: str, selftest: str = "quick",
              say: Callable[[str], None] = print, poll: float = 3.0, test_only: bool = False) -> dict[str, Any]:
    """Build `context` into `image_uri` (or with test_only, run the pushed image's selftest) in CodeBuild."""
    n = Names.of(aws)
    s3, cb, logs = aws.client("s3"), aws.client("codebuild"), aws.client("logs")
    with aws_errors("reading the CodeBuild project", "codebuild"):
        if not cb.batch_get_projects(names=[n.project]).get("projects"):
            raise NotFound(f"CodeBuild project {n.project} not found: run `fsdpkit infra create` first")
    env = [{"name": "IMAGE_URI", "value": image_uri, "type": "PLAINTEXT"},
           {"name": "SELFTEST_LEVEL", "value": selftest, "type": "PLAINTEXT"}]
    if test_only:

        key = None
        kw = {"sourceTypeOverride": "NO_SOURCE",
              "buildspecOverride": yamlfile.dump(test_buildspec(image_uri, selftest))}
    else:
        assert context is not None  # only a test of a pushed image has no context
        data = zip_context(context)
        key = f"contexts/{hashlib.sha256(data).hexdigest()[:16]}.zip"
        with aws_errors(f"uploading the build context to s3://{n.bucket}/{key}", "s3"):
            s3.put_object(Bucket=n.bucket, Key=key, Body=data)
        say(f"uploaded the build context ({len(data) / 1024:.0f} KiB) to s3://{n.bucket}/{key}")
        kw = {"sourceLocationOverride": f"{n.bucket}/{key}"}
    with aws_errors(f"starting a build of {n.project}", "codebuild"):
        build = cb.start_build(projectName=n.project, environmentVariablesOverride=env, **kw)["build"]
    build_id = build["id"]
    say(f"build {build_id} started for {image_uri}")
    state = {"status": build.get("buildStatus", "IN_PROGRESS")}

    def finished() -> bool:
        with aws_errors("reading the build", "codebuild"):
            b = cb.batch_get_builds(ids=[build_id])["builds"][0]
        state["status"] = b["buildStatus"]
        return bool(b["buildStatus"] != "IN_PROGRESS")
    group = (build.get("logs") or {}).get("groupName") or n.log_group
    stream = (build.get("logs") or {}).get("streamName") or build_id.split(":")[-1]
    with aws_errors("reading the build log", "logs"):
        lines = follow_logs(logs, group, stream, finished, say, poll)
    say(f"build {build_id}: {state['status']}")
    return {"build": build_id, "status": state["status"], "image": image_uri,
            "context": f"s3://{n.bucket}/{key}" if key else None, "log_lines": lines}
