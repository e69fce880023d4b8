"""SKILL.md files that let AI coding agents (OpenCode, Claude Code) drive fsdpkit through its CLI.

Each skill is `data/<name>/SKILL.md`: YAML front matter (name, description), when to use it, the
exact commands with `--json`, how to read the result, common failures. Skills hold no logic; they
only call the CLI. `install` copies them into the folder each agent reads skills from.
"""

from __future__ import annotations

from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

import yaml

from fsdpkit.errors import UserError

# Where each agent looks for skills: <dir>/<skill name>/SKILL.md.
TARGETS = {
    "claude": Path(".claude") / "skills",  # Claude Code, per project (relative to the current directory)
    "opencode": Path("~/.config/opencode/skills"),  # OpenCode, per user
}


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


def install(target: str, directory: str | None = None) -> tuple[Path, list[dict[str, Any]]]:
    """Copy every skill to DIR/<name>/SKILL.md (DIR: the target's usual folder unless given)."""
    if target not in TARGETS:
        raise UserError(f"target: {target!r} is not known; choose one of: {', '.join(TARGETS)}")
    base = Path(directory or TARGETS[target]).expanduser().absolute()
    done = []
    for skill in available():
        path = base / skill.name / "SKILL.md"
        state = "unchanged" if path.is_file() and path.read_text() == skill.text else (
            "updated" if path.is_file() else "installed")
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(skill.text)
        except OSError as e:
            raise UserError(f"dir: cannot write {path}: {e.strerror}") from None
        done.append({"name": skill.name, "path": str(path), "state": state})
    return base, done
