"""SKILL.md files that let AI coding agents (Claude Code, OpenCode, Cursor, VS Code, Kiro, Codex) drive fsdpkit
through its CLI, and the MCP server entry that gives the same agents its commands as tools.

Each skill is `data/<name>/SKILL.md`: YAML front matter (name, description), when to use it, the
exact commands with `--json`, how to read the result, common failures. Skills hold no logic; they
only call the CLI. `install` copies them into the folder each agent reads skills from;
`register_mcp` adds `fsdpkit mcp` to the agent's MCP configuration, keeping what else it holds.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

import tomlkit
import yaml

from fsdpkit.errors import UserError


def _mcp_servers(command: list[str]) -> dict[str, Any]:
    return {"type": "stdio", "command": command[0], "args": command[1:]}


@dataclass(frozen=True)
class Agent:
    """Where an agent reads skills (<skills>/<skill name>/SKILL.md) and its MCP servers (the JSON
    file, the key that maps server names to entries, and an entry in its format). Relative paths
    are the project's: the current directory."""

    skills: Path
    mcp_file: Path
    mcp_key: str
    entry: Callable[[list[str]], dict[str, Any]]
    toml: bool = False   # the MCP configuration is TOML (Codex), else JSON


def _command_args(command: list[str]) -> dict[str, Any]:
    return {"command": command[0], "args": command[1:]}


TARGETS = {
    # Claude Code: the project's skills and its .mcp.json.
    "claude": Agent(Path(".claude/skills"), Path(".mcp.json"), "mcpServers", _mcp_servers),
    # OpenCode: per user; a local server's command is one list.
    "opencode": Agent(Path("~/.config/opencode/skills"), Path("~/.config/opencode/opencode.json"), "mcp",
                      lambda command: {"type": "local", "command": command, "enabled": True}),
    # Cursor: the project's .cursor folder.
    "cursor": Agent(Path(".cursor/skills"), Path(".cursor/mcp.json"), "mcpServers", _command_args),
    # VS Code (Copilot): the project's .github/skills and .vscode/mcp.json.
    "vscode": Agent(Path(".github/skills"), Path(".vscode/mcp.json"), "servers", _mcp_servers),
    # Kiro (IDE and CLI): the workspace's .kiro/skills and .kiro/settings/mcp.json.
    "kiro": Agent(Path(".kiro/skills"), Path(".kiro/settings/mcp.json"), "mcpServers", _command_args),
    # Codex: the repository's .agents/skills (the Agent Skills folder it reads), and the user's
    # ~/.codex/config.toml, whose [mcp_servers.NAME] tables it reads in every project.
    "codex": Agent(Path(".agents/skills"), Path("~/.codex/config.toml"), "mcp_servers", _command_args, toml=True),
}
SERVER_NAME = "fsdpkit"


@dataclass(frozen=True)
class Skill:
    name: str
    description: str
    text: str


def parse(text: str, where: str) -> Skill:
    """A skill from its SKILL.md text: front matter between `---` lines with name and description."""
    if not text.startswith("---\n") or "\n---\n" not in text[4:]:
        raise ValueError(f"{where}: no front matter (--- ... ---) at the top")
    meta = yaml.safe_load(text[4:text.index("\n---\n", 4)])
    if not isinstance(meta, dict) or not meta.get("name") or not meta.get("description"):
        raise ValueError(f"{where}: the front matter needs a name and a description")
    return Skill(str(meta["name"]), str(meta["description"]), text)


def available() -> list[Skill]:
    root = resources.files(__name__) / "data"
    return sorted((parse((d / "SKILL.md").read_text(), d.name) for d in root.iterdir() if d.is_dir()),
                  key=lambda s: s.name)


def agent(target: str) -> Agent:
    if target not in TARGETS:
        raise UserError(f"target: {target!r} is not known; choose one of: {', '.join(TARGETS)}")
    return TARGETS[target]


def _state(path: Path, text: str) -> str:
    return "unchanged" if path.is_file() and path.read_text() == text else (
        "updated" if path.is_file() else "installed")


def mcp_config(target: str, command: list[str]) -> tuple[Path, dict[str, Any]]:
    """The agent's MCP configuration with fsdpkit's server in it, every other entry kept (and, in
    TOML, every comment); refused (nothing written) when the file is there but holds no mapping."""
    where = agent(target)
    path = where.mcp_file.expanduser().absolute()
    kind = "TOML" if where.toml else "JSON"
    config: Any = tomlkit.document() if where.toml else {}
    if path.is_file():
        try:
            config = tomlkit.parse(path.read_text()) if where.toml else json.loads(path.read_text())
        except ValueError as e:   # tomlkit's ParseError is a ValueError too
            raise UserError(f"{path}: not {kind} ({e}); fix it, or install with --no-mcp and add the server by "
                            f"hand: {' '.join(command)}") from None
    servers = config.get(where.mcp_key) if isinstance(config, dict) else None
    if not isinstance(config, dict) or not isinstance(servers, dict | None):
        raise UserError(f"{path}: expected an object with {where.mcp_key!r} mapping names to servers; fix it, or "
                        f"install with --no-mcp")
    if where.toml:
        if servers is None:
            config[where.mcp_key] = servers = tomlkit.table(is_super_table=True)
        servers[SERVER_NAME] = where.entry(command)
        return path, config
    return path, {**config, where.mcp_key: {**(servers or {}), SERVER_NAME: where.entry(command)}}


def register_mcp(path: Path, config: dict[str, Any]) -> dict[str, Any]:
    """Write the agent's MCP configuration as `mcp_config` made it (replaced whole, through a
    temporary file, so an agent never reads half a file)."""
    text = tomlkit.dumps(config) if isinstance(config, tomlkit.TOMLDocument) else json.dumps(config, indent=2) + "\n"
    state = _state(path, text)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.fsdpkit-tmp")
        tmp.write_text(text)
        os.replace(tmp, path)
    except OSError as e:
        raise UserError(f"cannot write {path}: {e.strerror}; install with --no-mcp, or fix its folder") from None
    return {"path": str(path), "state": state, "server": SERVER_NAME}


def install(target: str, directory: str | None = None) -> tuple[Path, list[dict[str, Any]]]:
    """Copy every skill to DIR/<name>/SKILL.md (DIR: the target's usual folder unless given)."""
    base = Path(directory or agent(target).skills).expanduser().absolute()
    done = []
    for skill in available():
        path = base / skill.name / "SKILL.md"
        state = _state(path, skill.text)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(skill.text)
        except OSError as e:
            raise UserError(f"dir: cannot write {path}: {e.strerror}") from None
        done.append({"name": skill.name, "path": str(path), "state": state})
    return base, done
