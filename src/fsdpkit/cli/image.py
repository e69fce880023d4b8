"""`fsdpkit image init|check`: a Dockerfile on a known-good base, and conflict analysis."""

from __future__ import annotations

import argparse
import re
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Any

from fsdpkit.cli.output import Parser, dispatch, emit_json, progress
from fsdpkit.effects import Effect, declare
from fsdpkit.envelope import duration
from fsdpkit.errors import Conflict, NotFound, UserError
from fsdpkit.image import pins
from fsdpkit.image.dockerfile import BASES, DEFAULT_BASE


def cmd_init(args: argparse.Namespace) -> int:
    from fsdpkit.image.dockerfile import DOCKERIGNORE, WHEEL_DIR, render
    from fsdpkit.image.package import for_image

    out = Path(args.out)
    reqs = None if args.no_requirements else args.requirements or "requirements.txt"
    if reqs and not (out / reqs).is_file():
        if args.requirements:  # named, so meant
            raise UserError(f"--requirements: {out / reqs} not found (or pass --no-requirements)")
        reqs = None  # the default file is simply not there: nothing of the project's to install
    files = {out / "Dockerfile": "", out / ".dockerignore": DOCKERIGNORE}   # the Dockerfile's text comes below
    # Files exactly as an earlier `image init` wrote them are written again (adding --tiered, say):
    # nothing of the user's is lost. Anything else needs --force.
    existing = [str(p) for p in files if p.exists() and not _as_written(p, args.base, reqs)]
    if existing and not args.force:
        raise Conflict(f"{', '.join(existing)} already exists and was changed since `fsdpkit image init` wrote it; "
                       "pass --force to overwrite")
    try:
        out.mkdir(parents=True, exist_ok=True)  # a new project folder is fine
        fsdpkit, how = for_image(args.fsdpkit, out, WHEEL_DIR)
        files[out / "Dockerfile"] = render(args.base, reqs, fsdpkit, hyperpod_agent=args.hyperpod, tiered=args.tiered,
                                           qlora=args.qlora)
        for path, text in files.items():
            path.write_text(text)
    except OSError as e:
        raise UserError(f"--out: cannot write into {out}: {e.strerror}") from None
    written = [str(p) for p in files] + ([str(out / fsdpkit)] if fsdpkit.endswith(".whl") else [])
    if args.json:
        return emit_json({"written": written, "fsdpkit": fsdpkit, "requirements": reqs})
    print(f"wrote {', '.join(written)}; fsdpkit in the image: {how}"
          + ("" if reqs else "; no requirements file (add one and run again with --force)"))
    print(f"check it with: fsdpkit image check {out / 'Dockerfile'}")
    return 0


def _as_written(path: Path, base: str, requirements: str | None) -> bool:
    """The file is what `image init` writes for this base and requirements file (with any fsdpkit
    source, with or without HyperPod's agent, the tiered writer and QLoRA's torchao)."""
    from fsdpkit.image.dockerfile import BASES, DOCKERIGNORE, render

    text = path.read_text(errors="replace")
    if path.name == ".dockerignore":
        return text == DOCKERIGNORE
    m = re.search(r'^(?:COPY (\S+\.whl) /tmp/|RUN pip install --no-cache-dir "?fsdpkit(?:\[[a-z,]+\])?(==[^\s"]+))',
                  text, re.M)
    if m is None or base not in BASES:
        return False
    fsdpkit = m.group(1) or f"fsdpkit{m.group(2)}"
    return any(text == render(base, requirements, fsdpkit, hyperpod_agent=agent, tiered=tiered, qlora=qlora)
               for agent in (False, True) for tiered in (False, True) for qlora in (False, True))


def cmd_check(args: argparse.Namespace) -> int:
    from fsdpkit.image.conflicts import check, fix

    dockerfile = Path(args.dockerfile)
    reqs = [Path(r) for r in args.requirements or []]
    for p in [dockerfile, *reqs]:
        if not p.is_file():
            raise NotFound(f"{p}: file not found")
    changes = fix(dockerfile, reqs) if args.fix else []
    changed = sorted({c.file for c in changes})
    found = check(dockerfile, reqs)
    if args.json:
        return emit_json({"conflicts": [c.to_dict() for c in found], "fixed_files": changed,
                          "changes": [asdict(c) for c in changes]}, 1 if found else 0,
                         f"{len(found)} conflict(s) found: {found[0].detail}" + (" ..." if len(found) > 1 else "")
                         if found else None, hint=found[0].fix if found else None)
    for c in found:
        print(f"{c.kind}: {c.file}:{c.line}: {c.detail}\n  fix: {c.fix}")
    for ch in changes:
        if ch.before is None:
            what = f"added {ch.after!r}"
        elif ch.after is None:
            what = f"removed {ch.before!r}"
        else:
            what = f"{ch.before!r} -> {ch.after!r}"
        print(f"--fix: {ch.file}:{ch.line}: {what}")
    print("no conflicts" if not found else f"{len(found)} conflict(s)")
    return 1 if found else 0


def _docker_engine() -> bool:
    import shutil
    import subprocess

    return shutil.which("docker") is not None and subprocess.run(
        ["docker", "info"], capture_output=True).returncode == 0


def cmd_build(args: argparse.Namespace) -> int:
    import subprocess

    from fsdpkit.aws import build as b
    from fsdpkit.aws.session import connect_for

    context = Path(args.context)
    if not (context / "Dockerfile").is_file():
        raise NotFound(f"{context / 'Dockerfile'} not found: write one with `fsdpkit image init`")
    repo = args.repository or b.image_name(context)
    tag = b.tag_for(args.tag_strategy, context)
    say = progress(args)
    aws = connect_for(args.region, args.profile, args.dry_run, say)
    if args.dry_run:
        local = not args.codebuild and _docker_engine()
        uri = f"{b.repository_uri(aws, repo)}:{tag}"
        return _plan(args, {"image": uri, "where": "local" if local else "codebuild", "steps": [
            f"ECR repository {repo}: created if missing (scan on push, lifecycle policy)",
            f"docker buildx build --load -t {uri} {context}" if local else
            f"{context} zipped (.dockerignore) to the build bucket; CodeBuild builds it",
            f"the image's own selftest (--level {args.selftest}) before it is pushed" if not local else
            f"docker push {uri} with `fsdpkit image push`"]})
    uri = f"{b.ensure_repository(aws, repo, args.immutable_tags, say)}:{tag}"
    if not args.codebuild and _docker_engine():
        say(f"building {uri} with the local Docker engine")
        rc = subprocess.run(["docker", "buildx", "build", "--load", "-t", uri, str(context)]).returncode
        out = {"image": uri, "status": "SUCCEEDED" if rc == 0 else "FAILED", "where": "local"}
    else:
        if not args.codebuild:
            say("no Docker engine here: building in AWS CodeBuild")
        out = {**b.codebuild(aws, context, uri, args.selftest, say, poll=args.poll), "where": "codebuild"}
    return _build_result(out, args.json)


def _plan(args: argparse.Namespace, plan: dict[str, Any]) -> int:
    """A dry run's plan: the steps it would take, nothing done."""
    if args.json:
        return emit_json({"dry_run": True, **plan})
    print(f"dry run: {plan['image']}" + (f" ({plan['where']})" if "where" in plan else ""))
    for step in plan["steps"]:
        print(f"  {step}")
    return 0


def _build_result(out: dict[str, Any], as_json: bool) -> int:
    """A build or test that ran: exit 0 only when it SUCCEEDED."""
    code = 0 if out["status"] == "SUCCEEDED" else 1
    if as_json:
        return emit_json(out, code, f"the build ended {out['status']}",
                         hint="read its log lines above (CodeBuild: the logs link in data)")
    return code


def cmd_push(args: argparse.Namespace) -> int:
    """Push a locally built image: the repository (with its policies), registry login, push, and the
    pushed digest checked against ECR's."""
    import base64
    import subprocess

    from fsdpkit.aws import build as b
    from fsdpkit.aws.session import aws_errors, connect_for

    say = progress(args)
    aws = connect_for(args.region, args.profile, args.dry_run, say)
    local = args.image
    repo = args.repository or local.split("/")[-1].split(":")[0]
    tag = b.tag_for(args.tag_strategy, Path(".")) if args.tag_strategy else (local.split(":")[-1] if ":" in
                                                                            local.split("/")[-1] else "latest")
    if args.dry_run:
        uri = f"{b.repository_uri(aws, repo)}:{tag}"
        return _plan(args, {"image": uri, "steps": [
            f"ECR repository {repo}: created if missing (scan on push, lifecycle policy)",
            f"docker login to {uri.split('/')[0]}", f"docker tag {local} {uri}", f"docker push {uri}",
            "the pushed digest checked against ECR's and recorded: jobs with this tag run that digest"]})
    uri = f"{b.ensure_repository(aws, repo, args.immutable_tags, say)}:{tag}"
    if not _docker_engine():
        raise UserError(f"no Docker engine here to push {local} from; the repository is ready: {uri.split(':')[0]} "
                        "(or build and push in CodeBuild: fsdpkit image build --codebuild)")
    ecr = aws.client("ecr")
    with aws_errors("getting a registry login", "ecr"):
        auth = ecr.get_authorization_token()["authorizationData"][0]
    user, password = base64.b64decode(auth["authorizationToken"]).decode().split(":", 1)
    login = subprocess.run(["docker", "login", "--username", user, "--password-stdin", auth["proxyEndpoint"]],
                           input=password, text=True, capture_output=True)
    if login.returncode != 0:
        raise UserError(f"docker login to {auth['proxyEndpoint']} failed: {login.stderr.strip()}")
    for cmd in (["docker", "tag", local, uri], ["docker", "push", uri]):
        if subprocess.run(cmd).returncode != 0:
            raise UserError(f"{' '.join(cmd[:2])} failed for {uri}")
    with aws_errors("reading the pushed image", "ecr"):
        digest = ecr.describe_images(repositoryName=repo, imageIds=[{"imageTag": tag}])["imageDetails"][0][
            "imageDigest"]
    local_digest = subprocess.run(["docker", "inspect", "--format", "{{index .RepoDigests 0}}", uri],
                                  capture_output=True, text=True).stdout.strip().split("@")[-1]
    if local_digest and local_digest != digest:
        raise UserError(f"pushed digest {local_digest} differs from ECR's {digest}")
    pinned = pins.record(uri, digest)  # `job submit` of this tag then runs exactly this image
    if args.json:
        return emit_json({"image": uri, "digest": digest, "pinned": pinned})
    print(f"pushed {uri} ({digest}); jobs submitted with this tag run {pinned}")
    return 0


def cmd_test(args: argparse.Namespace) -> int:
    """The image's own `fsdpkit selftest --level L`: with the local Docker engine, or in CodeBuild."""
    import subprocess

    if not args.codebuild and _docker_engine():
        cmd = ["docker", "run", "--rm", *(["--gpus", "all"] if args.gpus else []), args.image,
               "fsdpkit", "selftest", "--level", args.level, *(["--json"] if args.json else [])]
        return subprocess.run(cmd).returncode
    from fsdpkit.aws.build import codebuild
    from fsdpkit.aws.session import connect

    say = progress(args)
    if not args.codebuild:
        say("no Docker engine here: testing in AWS CodeBuild")
    out = codebuild(connect(args.region, args.profile), None, args.image, args.level, say, args.poll, test_only=True)
    return _build_result(out, args.json)


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="fsdpkit image", description="Container images for training.")
    sub = parser.add_subparsers(dest="cmd", required=True, metavar="VERB", parser_class=Parser)
    p = sub.add_parser("init", help="write a Dockerfile and .dockerignore on a known-good base")
    p.add_argument("--base", default=DEFAULT_BASE, help=f"{DEFAULT_BASE} (default); also "
                   f"{', '.join(k for k in BASES if k != DEFAULT_BASE)} (verl-0.5: VERL's image with EFA added, for "
                   "`fsdpkit ray`)")
    p.add_argument("--requirements", help="the project's requirements file (default: requirements.txt when present)")
    p.add_argument("--no-requirements", action="store_true")
    p.add_argument("--fsdpkit", choices=("auto", "wheel", "release"), default="auto",
                   help="fsdpkit in the image: a wheel of the fsdpkit that runs (into .fsdpkit/: built from its "
                   "checkout, or packed from its installed files; auto and wheel are the same), or release: this "
                   "version from the package index")
    p.add_argument("--hyperpod", action="store_true", help="add hyperpod-elastic-agent (HyperPodPyTorchJob)")
    p.add_argument("--tiered", action="store_true", help="add fsdpkit's tiered extra, the writer of HyperPod's "
                   "in-memory checkpoints (a job with train.tiered needs it)")
    p.add_argument("--qlora", action="store_true", help="add fsdpkit's qlora extra, torchao's NF4 tensor (a job with "
                   "train.base_dtype nf4 needs it)")
    p.add_argument("--out", default=".")
    p.add_argument("--force", action="store_true")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_init)
    declare(p, Effect.WRITES, force=Effect.OVERWRITES)
    p = sub.add_parser("check", help="PyTorch / CUDA / EFA conflicts in a Dockerfile and requirements")
    p.add_argument("dockerfile", nargs="?", default="Dockerfile")
    p.add_argument("-r", "--requirements", action="append", help="a requirements file (repeatable)")
    p.add_argument("--fix", action="store_true", help="rewrite the files so that no conflict is left")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_check)
    declare(p, Effect.NONE, fix=Effect.OVERWRITES)   # --fix rewrites the requirements

    def aws_args(p: argparse.ArgumentParser) -> None:
        p.add_argument("--repository", help="ECR repository (default: the directory's / image's name)")
        p.add_argument("--dry-run", action="store_true", help="print the plan; nothing is created, built or "
                       "pushed (without AWS credentials too)")
        p.add_argument("--immutable-tags", action="store_true")
        p.add_argument("--region")
        p.add_argument("--profile")
        p.add_argument("--json", action="store_true")

    p = sub.add_parser("build", help="build the image: local Docker if there is an engine, else AWS CodeBuild")
    p.add_argument("context", nargs="?", default=".")
    p.add_argument("--codebuild", action="store_true", help="build in CodeBuild even with a local engine")
    p.add_argument("--tag-strategy", default="auto", help="auto (git sha, else time), git-sha, semantic, latest")
    p.add_argument("--selftest", default="quick", choices=("quick", "standard", "full"),
                   help="the image's selftest level run before pushing")
    p.add_argument("--poll", type=duration, default=3.0, help=argparse.SUPPRESS)
    aws_args(p)
    p.set_defaults(func=cmd_build)
    declare(p, Effect.REMOTE | Effect.CREATES | Effect.COSTS | Effect.LONG)   # CodeBuild bills
    p = sub.add_parser("push", help="push a local image to ECR (creating the repository with its policies)")
    p.add_argument("image", help="local image name[:tag]")
    p.add_argument("--tag-strategy", help="retag: auto, git-sha, semantic, latest (default: keep the tag)")
    aws_args(p)
    p.set_defaults(func=cmd_push)
    declare(p, Effect.REMOTE | Effect.CREATES | Effect.LONG)
    p = sub.add_parser("test", help="run an image's selftest: locally with Docker, or in CodeBuild")
    p.add_argument("image")
    p.add_argument("--level", default="standard", choices=("quick", "standard", "full"))
    p.add_argument("--codebuild", action="store_true")
    p.add_argument("--gpus", action="store_true", help="local Docker: pass the GPUs in (--gpus all)")
    p.add_argument("--poll", type=duration, default=3.0, help=argparse.SUPPRESS)
    p.add_argument("--region")
    p.add_argument("--profile")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_test)
    declare(p, Effect.REMOTE | Effect.COSTS | Effect.LONG)   # in CodeBuild without Docker here
    return parser


def main(argv: list[str] | None = None) -> int:
    return dispatch(build_parser(), list(sys.argv[1:] if argv is None else argv))
