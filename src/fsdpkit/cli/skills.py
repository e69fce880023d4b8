"""`fsdpkit skills list|install`: the SKILL.md files that let AI coding agents run fsdpkit."""

from __future__ import annotations

import argparse

from fsdpkit.cli.output import Parser, dispatch, emit_json


def list_(args: argparse.Namespace) -> int:
    from fsdpkit.skills import available

    skills = available()
    if args.json:
        return emit_json([{"name": s.name, "description": s.description} for s in skills])
    for s in skills:
        print(f"{s.name:28} {s.description}")
    return 0


def install_(args: argparse.Namespace) -> int:
    from fsdpkit.skills import install

    base, done = install(args.target, args.dir)
    if args.json:
        return emit_json({"target": args.target, "dir": str(base), "skills": done})
    for d in done:
        print(f"{d['state']:10} {d['path']}")
    print(f"{len(done)} skills in {base} for {args.target}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="fsdpkit skills", description="Skills (SKILL.md) for AI coding agents: OpenCode, Claude Code.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    p = sub.add_parser("list", help="the skills fsdpkit ships")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=list_)
    p = sub.add_parser("install", help="copy the skills where an agent reads them")
    p.add_argument("--target", choices=("claude", "opencode"), default="claude",
                   help="claude: ./.claude/skills (this project); opencode: ~/.config/opencode/skills")
    p.add_argument("--dir", help="install into this folder instead (DIR/<skill>/SKILL.md)")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=install_)
    return parser


def main(argv: list[str]) -> int:
    return dispatch(build_parser(), argv)
