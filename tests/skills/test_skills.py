"""The agent skills parse, cover each capability, and install where OpenCode and Claude Code look."""

from __future__ import annotations

import json
import re

from fsdpkit.skills import available

from conftest import run_cli

CAPABILITIES = {"train-locally", "fine-tune", "build-image", "test-image", "push-image", "check-cluster",
                "validate-nccl-efa", "deploy-job", "watch-job", "checkpoints", "ray", "hyperpod", "infra",
                "provision-cluster", "plan-capacity", "job-spec"}


def test_every_skill_has_front_matter_the_agents_accept():
    skills = available()
    assert {s.name.removeprefix("fsdpkit-") for s in skills} == CAPABILITIES
    for s in skills:
        # Both agents: lowercase words joined by hyphens, at most 64 characters, description <= 1024.
        assert re.fullmatch(r"[a-z0-9]+(-[a-z0-9]+)*", s.name) and len(s.name) <= 64
        assert 20 < len(s.description) <= 1024
        assert "--json" in s.text and "## When to use" in s.text and "## Common failures" in s.text


def test_skills_list_json():
    r = run_cli("skills", "list", "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["ok"] and {d["name"] for d in out["data"]} == {s.name for s in available()}


def test_install_lays_out_each_agents_folder(tmp_path):
    home, project = tmp_path / "home", tmp_path / "project"
    project.mkdir()
    env = {"HOME": str(home)}
    expected = {s.name: s.text for s in available()}
    for target, base in (("claude", project / ".claude" / "skills"), ("opencode", home / ".config/opencode/skills")):
        # Default folders: Claude Code's in the current project, OpenCode's in the user's config.
        r = run_cli("skills", "install", "--target", target, "--json", env=env, cwd=project)
        assert r.returncode == 0, r.stderr
        data = json.loads(r.stdout)["data"]
        assert data["dir"] == str(base) and {d["state"] for d in data["skills"]} == {"installed"}
        assert {p.parent.name: p.read_text() for p in base.glob("*/SKILL.md")} == expected
        again = json.loads(run_cli("skills", "install", "--target", target, "--json", env=env, cwd=project).stdout)
        assert {d["state"] for d in again["data"]["skills"]} == {"unchanged"}
    custom = tmp_path / "elsewhere"
    r = run_cli("skills", "install", "--target", "opencode", "--dir", str(custom))
    assert r.returncode == 0 and len(list(custom.glob("*/SKILL.md"))) == len(expected)


def test_install_into_an_unwritable_place_is_one_line(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    r = run_cli("skills", "install", "--dir", str(blocker / "skills"), "--json")
    assert r.returncode == 2
    assert json.loads(r.stdout)["error"]["code"] == "bad_input"
