"""`fsdpkit skills list|show|install`: the SKILL.md files that let AI coding agents run fsdpkit."""

from __future__ import annotations

import argparse
import sys

from fsdpkit.cli.output import Parser, dispatch, emit_json
from fsdpkit.effects import Effect, declare
from fsdpkit.errors import NotFound
from fsdpkit.skills import TARGETS, available, install, mcp_config, register_mcp


def list_(args: argparse.Namespace) -> int:
    skills = available()
    if args.json:
        return emit_json([{"name": s.name, "description": s.description} for s in skills])
    for s in skills:
        print(f"{s.name:28} {s.description}")
    return 0


def show(args: argparse.Namespace) -> int:
    """One skill's SKILL.md, as an agent reads it."""
    by_name = {s.name: s for s in available()}
    if args.name not in by_name:
        raise NotFound(f"no skill named {args.name!r}; `fsdpkit skills list` names them: {', '.join(by_name)}")
    skill = by_name[args.name]
    if args.json:
        return emit_json({"name": skill.name, "description": skill.description, "text": skill.text})
    print(skill.text, end="")
    return 0


def install_(args: argparse.Namespace) -> int:
    # The server as this environment runs it: no PATH needed, and the agent gets this fsdpkit.
    command = [sys.executable, "-m", "fsdpkit", "mcp"]
    # Read first: a configuration it cannot update is refused before anything is written.
    config = None if args.no_mcp else mcp_config(args.target, command)
    base, done = install(args.target, args.dir)
    mcp = None if config is None else {**register_mcp(*config), "command": command}
    if args.json:
        return emit_json({"target": args.target, "dir": str(base), "skills": done, "mcp": mcp})
    for d in done:
        print(f"{d['state']:10} {d['path']}")
    print(f"{len(done)} skills in {base} for {args.target}")
    if mcp:
        print(f"{mcp['state']:10} {mcp['path']}: MCP server {mcp['server']!r} ({' '.join(command)})")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="fsdpkit skills", description="Skills (SKILL.md) for AI coding agents (Claude Code, OpenCode, "
                    "Cursor, VS Code, Kiro, Codex), and fsdpkit's MCP server in each agent's configuration.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    p = sub.add_parser("list", help="the skills fsdpkit ships")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=list_)
    declare(p, Effect.NONE)
    p = sub.add_parser("show", help="print one skill's SKILL.md")
    p.add_argument("name", help="the skill's name (`fsdpkit skills list`)")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=show)
    declare(p, Effect.NONE)
    p = sub.add_parser("install", help="copy the skills where an agent reads them and register `fsdpkit mcp` as "
                       "its MCP server")
    p.add_argument("--target", choices=tuple(TARGETS), default="claude",
                   help="claude: ./.claude/skills and ./.mcp.json (this project); opencode: "
                        "~/.config/opencode/skills and opencode.json there; cursor: ./.cursor/skills and "
                        "./.cursor/mcp.json; vscode: ./.github/skills and ./.vscode/mcp.json; kiro: ./.kiro/skills "
                        "and ./.kiro/settings/mcp.json; codex: ./.agents/skills and ~/.codex/config.toml")
    p.add_argument("--dir", help="install the skills into this folder instead (DIR/<skill>/SKILL.md)")
    p.add_argument("--no-mcp", action="store_true", help="the skills only: leave the agent's MCP configuration "
                   "alone")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=install_)
    declare(p, Effect.WRITES | Effect.OVERWRITES)   # the agent's own config files
    return parser


def main(argv: list[str]) -> int:
    return dispatch(build_parser(), argv)
