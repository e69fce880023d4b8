"""Files a command makes (fsdpkit.cli.output.write_new): one that exists stays unless --force says to
replace it, at the CLI and as an agent's tool call (where --force needs the user's `yes`)."""

from __future__ import annotations

import pytest

from fsdpkit.cli.tools import tools

from conftest import cli_here

# Each command that writes a file the user names, with {out} for it. image init keeps its own rule
# (a Dockerfile as it wrote it is written again): tests/image/test_image.py.
WRITERS = {
    "job_init": ["job", "init", "--backend", "local", "--out", "{out}"],
    "cluster_config": ["cluster", "config", "--name", "llm", "--region", "us-west-2", "--instance-type",
                       "p5.48xlarge", "--nodes", "2", "--out", "{out}"],
    "examples_show": ["examples", "show", "local-tiny", "--out", "{out}"],
    # Refused before the first query: a Prometheus that is not there is never asked.
    "metrics": ["metrics", "j", "--prometheus", "http://127.0.0.1:9", "--out", "{out}"],
}
BY_NAME = {t.name: t for t in tools()}


@pytest.mark.parametrize("tool", sorted(WRITERS))
def test_a_file_the_user_has_is_kept_without_force_and_an_agent_needs_yes_to_force(tool, tmp_path):
    out = tmp_path / "mine.yaml"
    out.write_text("hand-edited\n")
    argv = [a.replace("{out}", str(out)) for a in WRITERS[tool]]
    r = cli_here(*argv)
    assert (r.returncode, r.stderr) == (2, f"error: {out} already exists; pass --force to overwrite it, or --out "
                                           "elsewhere\n")
    assert out.read_text() == "hand-edited\n" and sorted(p.name for p in tmp_path.iterdir()) == ["mine.yaml"]
    if tool != "metrics":   # with --force it would ask Prometheus
        r = cli_here(*argv, "--force")
        assert r.returncode == 0, r.stderr
        assert out.read_text() != "hand-edited\n" and sorted(p.name for p in tmp_path.iterdir()) == ["mine.yaml"]
    # Over MCP the same call is made; with force it overwrites, which the user must agree to first.
    call = {"out": str(out)}
    assert BY_NAME[tool].unconfirmed(call) is None
    assert str(BY_NAME[tool].unconfirmed({**call, "force": True})) == (
        f"{tool}: overwrites local files, and nobody confirmed it")
