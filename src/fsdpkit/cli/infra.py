"""`fsdpkit infra up|status|down|template`: the AWS resources the image build path needs."""

from __future__ import annotations

import argparse
import sys

from fsdpkit import yamlfile
from fsdpkit.cli.output import Parser, dispatch, emit_json, progress


def cmd(args: argparse.Namespace) -> int:
    from fsdpkit.aws.infra import Infra, cloudformation

    if args.cmd == "template":
        template = cloudformation(args.repository)
        if args.json:
            return emit_json({"template": template})
        print(yamlfile.dump(template), end="")
        return 0
    from fsdpkit.aws.session import connect

    aws = connect(args.region, args.profile)
    infra = Infra(aws, args.repository, args.immutable_tags)
    say = progress(args)
    if args.cmd == "status":
        have = infra.status()
        if args.json:
            return emit_json({"account": aws.account, "region": aws.region, "resources": have})
        for k, v in have.items():
            print(f"{'present' if v else 'missing':8s} {k}")
        return 0
    done = infra.up(say, args.dry_run) if args.cmd == "up" else infra.down(say, args.delete_images, args.dry_run)
    key = ("would_create" if args.dry_run else "created") if args.cmd == "up" else \
        ("would_remove" if args.dry_run else "removed")
    if args.json:
        return emit_json({"account": aws.account, "region": aws.region, "dry_run": args.dry_run, key: done})
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="fsdpkit infra", description="S3 bucket, CodeBuild role and project, log group and ECR "
                    "repository for building images; idempotent, tagged fsdpkit:managed=true.")
    sub = parser.add_subparsers(dest="cmd", required=True, metavar="VERB", parser_class=Parser)
    for verb, text in (("up", "create what is missing (prints the plan first)"), ("status", "what exists"),
                       ("down", "remove what fsdpkit created, nothing else"),
                       ("template", "the same resources as a CloudFormation template")):
        p = sub.add_parser(verb, help=text)
        p.add_argument("--region", help="default: your AWS session's (AWS_REGION, profile)")
        p.add_argument("--profile")
        p.add_argument("--repository", default="fsdpkit", help="ECR repository name")
        p.add_argument("--immutable-tags", action="store_true", help="ECR tag immutability")
        p.add_argument("--json", action="store_true")
        if verb == "down":
            p.add_argument("--delete-images", action="store_true", help="also remove an ECR repository that "
                           "still holds images")
        if verb in ("up", "down"):
            p.add_argument("--dry-run", action="store_true", help="print the plan; create or remove nothing")
        p.set_defaults(func=cmd)
    return parser


def main(argv: list[str] | None = None) -> int:
    return dispatch(build_parser(), list(sys.argv[1:] if argv is None else argv))
