"""The agent skills parse, cover each capability, and install where Claude Code, OpenCode, Cursor and
VS Code look, with fsdpkit's MCP server in each agent's configuration."""

from __future__ import annotations

import json
import re
import sys

import pytest
import tomllib

from fsdpkit.skills import available

from conftest import require, run_cli

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


AGENTS = {  # target: (skills folder, MCP file, key of the servers, the entry's command as the agent reads it)
    "claude": (".claude/skills", ".mcp.json", "mcpServers", lambda e: [e["command"], *e["args"]]),
    "opencode": ("home/.config/opencode/skills", "home/.config/opencode/opencode.json", "mcp", lambda e: e["command"]),
    "cursor": (".cursor/skills", ".cursor/mcp.json", "mcpServers", lambda e: [e["command"], *e["args"]]),
    "vscode": (".github/skills", ".vscode/mcp.json", "servers", lambda e: [e["command"], *e["args"]]),
    "kiro": (".kiro/skills", ".kiro/settings/mcp.json", "mcpServers", lambda e: [e["command"], *e["args"]]),
    "codex": (".agents/skills", "home/.codex/config.toml", "mcp_servers", lambda e: [e["command"], *e["args"]]),
}
# Codex's configuration is TOML: the user's own, with a comment that must survive.
CODEX_CONFIG = '# my settings\nmodel = "gpt-5"\n\n[mcp_servers.other]\ncommand = "other-server"\nargs = ["--stdio"]\n'


def read_config(path) -> dict:
    return tomllib.loads(path.read_text()) if path.suffix == ".toml" else json.loads(path.read_text())


@pytest.mark.parametrize("target", sorted(AGENTS))
def test_install_registers_the_mcp_server_keeping_the_agents_other_servers(tmp_path, target):
    mcp = require("mcp")
    anyio = require("anyio")
    skills_dir, config_file, key, command_of = AGENTS[target]
    project = tmp_path / "project"
    project.mkdir()
    config = (project if not config_file.startswith("home/") else tmp_path) / config_file
    config.parent.mkdir(parents=True, exist_ok=True)
    other = {"command": "other-server", "args": ["--stdio"]}
    config.write_text(CODEX_CONFIG if target == "codex" else json.dumps({"theme": "dark", key: {"other": other}}))
    env = {"HOME": str(tmp_path / "home")}
    r = run_cli("skills", "install", "--target", target, "--json", env=env, cwd=project)
    assert r.returncode == 0, r.stderr
    data = json.loads(r.stdout)["data"]
    assert data["mcp"]["path"] == str(config) and data["mcp"]["state"] == "updated"
    assert len(list(((tmp_path if skills_dir.startswith("home/") else project) / skills_dir).glob("*/SKILL.md"))) \
        == len(available())
    written = read_config(config)
    assert written[key]["other"] == other   # nothing of the user's lost
    if target == "codex":
        assert config.read_text().startswith(CODEX_CONFIG) and written["model"] == "gpt-5"
    else:
        assert written["theme"] == "dark"
    entry = written[key]["fsdpkit"]
    again = json.loads(run_cli("skills", "install", "--target", target, "--json", env=env, cwd=project).stdout)
    assert again["data"]["mcp"]["state"] == "unchanged"

    # The entry starts a server, as the agent would from the project: the SDK's client lists its tools.
    command = command_of(entry)
    params = mcp.StdioServerParameters(command=command[0], args=command[1:], cwd=str(project))

    async def listed():
        async with mcp.Client(params) as client:
            return {t.name for t in (await client.list_tools()).tools}

    assert {"job_submit", "plan", "train"} <= anyio.run(listed)


def test_a_config_that_is_not_json_is_refused_before_anything_is_written(tmp_path):
    (tmp_path / ".mcp.json").write_text("{ // a comment\n}")
    r = run_cli("skills", "install", "--json", cwd=tmp_path)
    assert r.returncode == 2 and json.loads(r.stdout)["error"]["code"] == "bad_input"
    assert "--no-mcp" in json.loads(r.stdout)["error"]["message"]
    assert not (tmp_path / ".claude").exists() and (tmp_path / ".mcp.json").read_text() == "{ // a comment\n}"
    r = run_cli("skills", "install", "--no-mcp", "--json", cwd=tmp_path)
    assert r.returncode == 0 and json.loads(r.stdout)["data"]["mcp"] is None and (tmp_path / ".claude").is_dir()


def test_codex_gets_its_servers_table_in_a_config_that_has_none(tmp_path):
    env = {"HOME": str(tmp_path / "home")}
    r = run_cli("skills", "install", "--target", "codex", "--json", env=env, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    config = tmp_path / "home" / ".codex" / "config.toml"
    entry = tomllib.loads(config.read_text())["mcp_servers"]["fsdpkit"]
    assert entry == {"command": sys.executable, "args": ["-m", "fsdpkit", "mcp"]}
    assert "[mcp_servers.fsdpkit]" in config.read_text()
    assert len(list((tmp_path / ".agents" / "skills").glob("*/SKILL.md"))) == len(available())
    (config).write_text("model = [unclosed\n")
    r = run_cli("skills", "install", "--target", "codex", "--json", env=env, cwd=tmp_path)
    assert r.returncode == 2 and json.loads(r.stdout)["error"]["message"].startswith(f"{config}: not TOML (")


def test_show_prints_a_skill_as_shipped_and_names_the_skills_for_an_unknown_one(tmp_path):
    skill = available()[0]
    r = run_cli("skills", "show", skill.name)
    assert r.returncode == 0 and r.stdout == skill.text
    r = run_cli("skills", "show", "no-such-skill", "--json")
    error = json.loads(r.stdout)["error"]
    assert r.returncode == 2 and error["message"].startswith("no skill named 'no-such-skill'; `fsdpkit skills list` "
                                                             f"names them: {skill.name}, ")
