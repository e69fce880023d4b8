"""`fsdpkit infra create|status|delete|template`: the AWS resources the image build path needs."""

from __future__ import annotations

import argparse
import sys

from fsdpkit import yamlfile
from fsdpkit.cli.output import Parser, confirmed, dispatch, emit_json, progress
from fsdpkit.effects import Effect, declare


def cmd(args: argparse.Namespace) -> int:
    from fsdpkit.aws.infra import Infra, Names, cloudformation

    if args.cmd == "template":
        template = cloudformation(args.repository)
        if args.json:
            return emit_json({"template": template})
        print(yamlfile.dump(template), end="")
        return 0
    from fsdpkit.aws.session import connect, connect_for

    say = progress(args)
    if args.cmd == "create" and args.dry_run:
        aws = connect_for(args.region, args.profile, True, say)
        if aws.session is None:   # no AWS to ask what exists: the whole plan, as it would be made
            plan = Names.of(aws, args.repository).resources()
            say("dry run: plan: create what is missing of " + ", ".join(plan))
            if args.json:
                return emit_json({"account": aws.account, "region": aws.region, "dry_run": True,
                                  "offline": True, "would_create": plan})
            return 0
    else:
        aws = connect(args.region, args.profile)
    infra = Infra(aws, args.repository, args.immutable_tags)
    if args.cmd == "status":
        have = infra.status()
        if args.json:
            return emit_json({"account": aws.account, "region": aws.region, "resources": have})
        for k, v in have.items():
            print(f"{'present' if v else 'missing':8s} {k}")
        return 0
    if args.cmd == "delete" and not args.dry_run:
        plan = infra.delete(say, args.delete_images, dry_run=True)
        # The bucket goes with every object version in it (build contexts, logs): asked first.
        if plan and not confirmed(args, ", ".join(plan), f"remove {', '.join(plan)} (the bucket with every "
                                  "object version in it)?"):
            return 1
    done = infra.create(say, args.dry_run) if args.cmd == "create" else \
        infra.delete(say, args.delete_images, args.dry_run)
    key = ("would_create" if args.dry_run else "created") if args.cmd == "create" else \
        ("would_remove" if args.dry_run else "removed")
    if args.json:
        return emit_json({"account": aws.account, "region": aws.region, "dry_run": args.dry_run, key: done})
    return 0

# What each infra verb does (CodeBuild, IAM, S3, ECR: billed only by use, so creating them costs nothing).
INFRA_EFFECTS = {"create": Effect.REMOTE | Effect.CREATES | Effect.LONG, "status": Effect.REMOTE,
                 "delete": Effect.REMOTE | Effect.DELETES | Effect.LONG, "template": Effect.NONE}


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="fsdpkit infra", description="S3 bucket, CodeBuild role and project, log group and ECR "
                    "repository for building images; idempotent, tagged fsdpkit:managed=true.")
    sub = parser.add_subparsers(dest="cmd", required=True, metavar="VERB", parser_class=Parser)
    for verb, text in (("create", "create what is missing (prints the plan first)"), ("status", "what exists"),
                       ("delete", "remove what fsdpkit created, nothing else: the CodeBuild project, the IAM role, "
                        "the log group, the S3 bucket with every object version, the ECR repository if it holds "
                        "no images (asks first)"),
                       ("template", "the same resources as a CloudFormation template")):
        p = sub.add_parser(verb, help=text)
        p.add_argument("--region", help="default: your AWS session's (AWS_REGION, profile)")
        p.add_argument("--profile")
        p.add_argument("--repository", default="fsdpkit", help="ECR repository name")
        p.add_argument("--immutable-tags", action="store_true", help="ECR tag immutability")
        p.add_argument("--json", action="store_true")
        if verb == "delete":
            p.add_argument("--delete-images", action="store_true", help="also remove an ECR repository that "
                           "still holds images")
            p.add_argument("--yes", action="store_true", help="do not ask for confirmation")
        if verb in ("create", "delete"):
            p.add_argument("--dry-run", action="store_true", help="print the plan; create or remove nothing")
        p.set_defaults(func=cmd)
        declare(p, INFRA_EFFECTS[verb])
    return parser


def main(argv: list[str] | None = None) -> int:
    return dispatch(build_parser(), list(sys.argv[1:] if argv is None else argv))
