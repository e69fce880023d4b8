"""`fsdpkit mcp` driven by the MCP SDK's own client over stdio, as an agent's MCP host starts it:
the tools it lists carry the CLI's schemas, the 8B on 4 x p5 path (job init, plan, job submit
--dry-run) gives the CLI's own envelopes and files, a destructive call nobody confirmed is refused
with nothing deleted, errors carry code and hint, a long call reports progress, a cancelled one
stops its process (so does a host that dies), and a secret in the server's environment never comes
back."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from fsdpkit.cli.tools import Tool, tools
from fsdpkit.effects import CONSENT

from conftest import aws_client, processes_naming, require, run_cli

anyio = require("anyio")
mcp = require("mcp")

IMAGE = "123456789012.dkr.ecr.us-west-2.amazonaws.com/fsdpkit:v1"
INIT = {"backend": "trainjob", "instance_type": "p5.48xlarge", "nodes": "4", "preset": "llama3_1_8b",
        "storage_claim": "fsx-claim", "image": IMAGE, "out": "job.yaml"}
INIT_ARGV = ["job", "init", "--backend", "trainjob", "--instance-type", "p5.48xlarge", "--nodes", "4", "--preset",
             "llama3_1_8b", "--storage-claim", "fsx-claim", "--image", IMAGE, "--out", "job.yaml", "--json"]


def with_server(cwd: Path, body: Callable[[Any], Awaitable[Any]], env: dict[str, str] | None = None,
                mode: str = "auto", flags: tuple[str, ...] = ()) -> Any:
    """Run `body(client)` against `python -m fsdpkit mcp` started in `cwd` by the SDK's stdio client."""
    params = mcp.StdioServerParameters(command=sys.executable, args=["-m", "fsdpkit", "mcp", *flags], cwd=str(cwd),
                                       env={**os.environ, **(env or {})})

    async def main() -> Any:
        async with mcp.Client(params, read_timeout_seconds=300, mode=mode) as client:
            return await body(client)

    return anyio.run(main)


def envelope(result: Any) -> dict[str, Any]:
    """The structured result, which the text content carries too."""
    assert json.loads(result.content[0].text) == result.structured_content
    assert result.is_error == (not result.structured_content["ok"])
    return result.structured_content


def cli(cwd: Path, *argv: str) -> dict[str, Any]:
    r = run_cli(*argv, cwd=cwd)
    return json.loads(r.stdout)


def test_tools_carry_the_cli_schemas_and_the_8b_path_returns_what_the_cli_does(tmp_path):
    by_agent, by_hand = tmp_path / "agent", tmp_path / "cli"
    by_agent.mkdir()
    by_hand.mkdir()

    async def drive(client):
        listed = (await client.list_tools()).tools
        calls = [await client.call_tool("job_init", INIT),
                 await client.call_tool("plan", {"spec": "job.yaml"}),
                 await client.call_tool("job_submit", {"spec": "job.yaml", "dry_run": True})]
        return listed, [envelope(c) for c in calls]

    listed, (init, plan, submit) = with_server(by_agent, drive)
    catalogue = {t.name: t for t in tools()}
    assert {t.name for t in listed} == set(catalogue)
    for t in listed:
        assert t.input_schema == catalogue[t.name].schema(), t.name
    annotations = {t.name: t.annotations for t in listed}
    assert annotations["job_delete"].destructive_hint and annotations["plan"].read_only_hint
    assert not annotations["job_render"].destructive_hint and not annotations["job_render"].open_world_hint
    # The hints are the declared effects: image check may rewrite files (--fix), so it is not read-only.
    assert not annotations["image_check"].read_only_hint and annotations["image_check"].destructive_hint
    assert annotations["job_status"].read_only_hint and annotations["job_status"].open_world_hint

    assert init == cli(by_hand, *INIT_ARGV) and init["ok"]
    assert (by_agent / "job.yaml").read_bytes() == (by_hand / "job.yaml").read_bytes()
    assert plan == cli(by_hand, "plan", "job.yaml", "--json") and plan["data"]["nodes"] == 4
    assert plan["data"]["model"] == "llama3_1_8b" and plan["data"]["instance_type"] == "p5.48xlarge"
    assert submit == cli(by_hand, "job", "submit", "job.yaml", "--dry-run", "--json") and submit["ok"]
    assert [m["kind"] for m in submit["data"]["manifests"]] == ["TrainJob"]


def test_a_client_of_the_handshake_era_gets_the_same_tools_and_envelopes(tmp_path):
    """Agents' hosts that still open with `initialize` (protocol 2025-11-25 and before)."""
    async def drive(client):
        listed = (await client.list_tools()).tools
        return client.protocol_version, listed, envelope(await client.call_tool("presets", {}))

    version, listed, presets = with_server(tmp_path, drive, mode="legacy")
    assert version < "2026" and {t.name: t.input_schema for t in listed} == {t.name: t.schema() for t in tools()}
    assert presets == cli(tmp_path, "presets", "--json") and presets["ok"]


def fabricate_checkpoints(root: Path) -> dict[Path, bytes]:
    for step in (10, 20):
        d = root / f"step-{step:08d}"
        d.mkdir(parents=True)
        (d / "fsdpkit.json").write_text(json.dumps({"step": step, "world_size": 1, "loss": 3.0}))
        (d / "__0_0.distcp").write_bytes(b"x" * 1000)
    return {p: p.read_bytes() for p in root.rglob("*") if p.is_file()}


def test_a_destructive_call_without_consent_is_refused_and_errors_carry_code_and_hint(tmp_path):
    root = tmp_path / "ckpt"
    before = fabricate_checkpoints(root)

    async def drive(client):
        refused = envelope(await client.call_tool("ckpt_prune", {"directory": str(root), "keep": 1}))
        after_refusal = {p: p.read_bytes() for p in root.rglob("*") if p.is_file()}
        dry = envelope(await client.call_tool("ckpt_prune", {"directory": str(root), "keep": 1, "dry_run": True}))
        bad = envelope(await client.call_tool("ckpt_prune", {"directory": str(root), "keep": -1, "yes": True}))
        unknown = envelope(await client.call_tool("job_explode", {}))
        conflict = [envelope(await client.call_tool("job_init", INIT)) for _ in range(2)][1]
        done = envelope(await client.call_tool("ckpt_prune", {"directory": str(root), "keep": 1, "yes": True}))
        return refused, after_refusal, dry, bad, unknown, conflict, done

    refused, after_refusal, dry, bad, unknown, conflict, done = with_server(tmp_path, drive)
    assert refused["error"]["code"] == "unconfirmed" and refused["data"] is None
    assert "yes: true" in refused["error"]["hint"] and "dry_run: true" in refused["error"]["hint"]
    assert after_refusal == before
    assert dry["ok"] and [c["name"] for c in dry["data"]] == ["step-00000010"] and after_refusal == before
    # The schema's bound, before anything runs: which argument, and what to do.
    assert bad["error"]["code"] == "bad_input" and "keep" in bad["error"]["message"] and bad["error"]["hint"]
    assert unknown["error"] == {"code": "bad_input", "message": "no tool 'job_explode'",
                                "hint": "pick one that tools/list names"}
    # The command's own refusal comes through whole: its code and its hint.
    assert conflict["error"]["code"] == "conflict" and "--force" in conflict["error"]["hint"]
    assert done["ok"] and not (root / "step-00000010").exists() and (root / "step-00000020").is_dir()


def test_a_long_call_reports_progress_and_a_cancelled_one_stops_its_process(tmp_path):
    finished, stopped = tmp_path / "finished", tmp_path / "stopped"
    train = {"preset": "tiny", "seq_len": 64, "train_batch_size": 2, "validation_freq": 0, "progress": "off",
             "logging_freq": 1}

    async def drive(client):
        seen: list[str] = []

        async def progress(done, total, message):
            seen.append(message)

        result = envelope(await client.call_tool("train", {**train, "max_steps": 3, "run_dir": str(finished)},
                                                 progress_callback=progress))
        started, ended = anyio.Event(), []

        async def first_line(done, total, message):
            started.set()

        async def long_run():
            ended.append(await client.call_tool("train", {**train, "max_steps": 1_000_000, "run_dir": str(stopped)},
                                                progress_callback=first_line))
            started.set()

        with anyio.fail_after(120):
            async with anyio.create_task_group() as group:
                group.start_soon(long_run)
                await started.wait()
                group.cancel_scope.cancel()
        return result, seen, ended

    home = tmp_path / "home"
    result, seen, ended = with_server(tmp_path, drive, env={"FSDPKIT_HOME": str(home)})
    assert result["ok"] and result["data"]["steps"] == 3, result
    assert any("step" in line for line in seen) and len(seen) >= 3
    assert ended == []   # cancelled while it ran, not ended on its own
    deadline = time.monotonic() + 60
    while processes_naming(stopped) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert processes_naming(stopped) == []
    # Both calls are in the audit log, the cancelled one as cancelled.
    audit = [json.loads(line) for line in (home / "mcp" / "audit.jsonl").read_text().splitlines()]
    assert [(a["tool"], a["ok"], a["code"]) for a in audit] == [("train", True, None), ("train", False, "cancelled")]
    assert audit[1]["arguments"]["run_dir"] == str(stopped)


def test_secrets_in_the_servers_environment_never_come_back(tmp_path):
    secret = "wJalrXUtnFEMI-K7MDENG-bPxRfiCYEXAMPLEKEY"

    async def drive(client):
        return await client.call_tool("ckpt_list", {"directory": str(tmp_path / secret)})

    result = with_server(tmp_path, drive, env={"AWS_SECRET_ACCESS_KEY": secret})
    text = json.dumps(result.model_dump(mode="json"))
    assert secret not in text and "***" in result.structured_content["error"]["message"]


def test_a_host_that_dies_mid_call_leaves_no_command_running(tmp_path):
    """The agent's host is killed while a training run is a call in flight: the server reads the end
    of its stdin, stops the run (SIGTERM, on which the trainer ends cleanly: its summary is written)
    and exits."""
    run_dir = tmp_path / "orphan"
    server = subprocess.Popen([sys.executable, "-m", "fsdpkit", "mcp"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              stderr=subprocess.DEVNULL, cwd=tmp_path)

    def send(message: dict) -> None:
        server.stdin.write((json.dumps({"jsonrpc": "2.0", **message}) + "\n").encode())
        server.stdin.flush()

    send({"id": 1, "method": "initialize", "params": {"protocolVersion": "2025-06-18", "capabilities": {},
                                                      "clientInfo": {"name": "host", "version": "0"}}})
    assert json.loads(server.stdout.readline())["result"]["serverInfo"]["name"] == "fsdpkit"
    send({"method": "notifications/initialized"})
    send({"id": 2, "method": "tools/call", "params": {"name": "train", "arguments": {
        "preset": "tiny", "max_steps": 1_000_000, "run_dir": str(run_dir), "logging_freq": 1, "progress": "off"}}})
    # Until a step has been logged: the run is training (a run still starting has nothing to save).
    metrics = run_dir / "metrics.jsonl"
    deadline = time.monotonic() + 120
    while not (metrics.is_file() and '"kind": "train"' in metrics.read_text()) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert processes_naming(run_dir), "the run never started"
    server.stdin.close()   # the host is gone
    assert server.wait(timeout=90) == 0
    assert processes_naming(run_dir) == []
    assert json.loads((run_dir / "summary.json").read_text())["steps"] < 1_000_000


def minimal_call(tool: Tool) -> dict[str, Any]:
    """The least a schema admits, with every argument that adds a consent effect set."""
    schema = tool.schema()
    by_type = {"string": "x", "integer": 1, "number": 1, "boolean": True}
    arguments: dict[str, Any] = {}
    for name in schema["required"]:
        prop = schema["properties"][name]
        if "enum" in prop:
            arguments[name] = prop["enum"][0]
        elif prop.get("type") == "array":
            arguments[name] = ["x"]
        else:
            arguments[name] = by_type[prop["type"] if isinstance(prop["type"], str) else prop["type"][0]]
    for name, effect in tool.effects.when:
        if effect & CONSENT:
            arguments[name] = True
    return arguments


def test_every_call_that_would_create_delete_cost_or_overwrite_is_refused_without_yes_and_audited(
        tmp_path, moto, kube):
    """Each tool whose declared effects need consent, called with no `yes`: refused with
    `unconfirmed` before anything runs (moto holds nothing, kmock saw no request, no file was
    written), and every call is in the audit log with its secrets masked."""
    url, aws_env = moto
    consenting = [t for t in tools() if t.consents]
    assert {"cluster_create", "storage_fsx_create", "job_submit", "deploy", "image_build", "ray_create",
            "image_check", "job_init", "skills_install"} <= {t.name for t in consenting}
    work, home = tmp_path / "work", tmp_path / "home"
    work.mkdir()
    env = {**aws_env, **kube.env, "FSDPKIT_HOME": str(home), "HF_TOKEN": "hf_fromtheenvironment"}
    secret_call = {"spec": "job.yaml", "set": ["env.HF_TOKEN=hf_givenintheargs", "train.lr=1e-4"]}

    async def drive(client):
        answers = {t.name: envelope(await client.call_tool(t.name, minimal_call(t))) for t in consenting}
        answers["secret"] = envelope(await client.call_tool("job_submit", secret_call))
        return answers

    answers = with_server(work, drive, env=env)
    for name, answer in answers.items():
        assert answer["ok"] is False and answer["error"]["code"] == "unconfirmed", (name, answer)
        assert answer["error"]["hint"].startswith("ask the user, then call it again with yes: true")
    assert answers["secret"]["error"]["message"] == ("job_submit: creates or changes cloud or cluster resources, "
                                                      "starts what AWS bills, and nobody confirmed it")
    assert answers["job_submit"]["error"]["message"].startswith("job_submit: deletes what it names, creates")
    assert kube.requests() == []
    assert aws_client(url, "eks").list_clusters()["clusters"] == []
    assert aws_client(url, "fsx").describe_file_systems()["FileSystems"] == []
    assert aws_client(url, "codebuild").list_projects()["projects"] == []
    assert aws_client(url, "ecr").describe_repositories()["repositories"] == []
    assert list(work.iterdir()) == []
    audit = [json.loads(line) for line in (home / "mcp" / "audit.jsonl").read_text().splitlines()]
    assert [a["tool"] for a in audit] == [t.name for t in consenting] + ["job_submit"]
    assert all((a["ok"], a["code"]) == (False, "unconfirmed") for a in audit)
    assert audit[-1]["arguments"] == {"spec": "job.yaml", "set": ["env.HF_TOKEN=***", "train.lr=1e-4"]}
    assert "hf_" not in (home / "mcp" / "audit.jsonl").read_text()


def test_a_read_only_server_lists_and_runs_only_what_changes_nothing(tmp_path):
    async def drive(client):
        listed = {t.name for t in (await client.list_tools()).tools}
        return listed, envelope(await client.call_tool("job_delete", {"name": "j", "yes": True})), \
            envelope(await client.call_tool("presets", {}))

    listed, refused, presets = with_server(tmp_path, drive, env={"FSDPKIT_HOME": str(tmp_path / "home")},
                                           flags=("--read-only",))
    assert listed == {t.name for t in tools() if t.read_only}
    assert {"plan", "presets", "job_status", "job_render", "ckpt_list"} <= listed
    assert not listed & {"job_delete", "job_submit", "image_check", "train", "job_init"}
    assert refused["error"] == {"code": "bad_input", "message": "no tool 'job_delete'",
                                "hint": "pick one that tools/list names"}
    assert presets["ok"]


def nested(depth: int) -> Any:
    value: Any = 0
    for _ in range(depth):
        value = [value]
    return value


def test_lines_that_are_not_json_rpc_get_the_specification_s_errors_and_the_server_goes_on(tmp_path):
    """Raw lines, as a broken or hostile host might send them: each gets JSON-RPC's own error (with
    the request's id where it has one; a notification gets none), one line on stderr says what came,
    and a request after them is answered."""
    server = subprocess.Popen([sys.executable, "-m", "fsdpkit", "mcp"], cwd=tmp_path, stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              env={**os.environ, "FSDPKIT_HOME": str(tmp_path / "home")})
    init = {"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {
        "protocolVersion": "2025-06-18", "capabilities": {}, "clientInfo": {"name": "raw", "version": "0"}}}
    lines = [json.dumps(init).encode(), b'{"jsonrpc": "2.0", "method": "notifications/initialized"}',
             b"garbage{", b"\xff\xfe\x00binary", b"[1, 2]", b'{"id": 4, "hello": 1}',
             b'{"jsonrpc": "2.0", "id": 5, "method": "tools/list", "params": "x"}',
             b'{"jsonrpc": "2.0", "method": "notifications/cancelled", "params": 3}',
             b"x" * (30 * 2**20), b"[" * 20_000 + b"]" * 20_000,
             json.dumps({"jsonrpc": "2.0", "id": 7, "method": "ping", "params": {"x": nested(100)}}).encode(),
             b'{"jsonrpc": "2.0", "id": 6, "method": "ping"}',
             # Garbage as stdin ends: answered, while the session is ending, without a traceback.
             *[b"garbage{"] * 3]
    assert server.stdin is not None and server.stdout is not None
    server.stdin.write(b"\n".join(lines) + b"\n")
    server.stdin.flush()
    replies = []
    while not replies or replies[-1].get("id") != 6:
        replies.append(json.loads(server.stdout.readline()))
    out, err = server.communicate(timeout=60)
    assert server.returncode == 0, err.decode()[-3000:]
    # The bad lines' errors come in their lines' order; the SDK's answers may come between them.
    replies += [json.loads(line) for line in out.splitlines()]
    assert [r["id"] for r in replies if "result" in r] == [1, 6]
    errors = [(r["id"], r["error"]["code"], r["error"]["message"]) for r in replies if "error" in r]
    assert errors == [
        (None, -32700, "Parse error: Expecting value: line 1 column 1 (char 0)"),
        (None, -32700, "Parse error: Expecting value: line 1 column 1 (char 0)"),
        (None, -32600, "Invalid Request: not a JSON-RPC 2.0 request, notification or response"),
        (4, -32600, "Invalid Request: not a JSON-RPC 2.0 request, notification or response"),
        (5, -32602, "Invalid params: tools/list's params must be an object"),
        (None, -32600, "Invalid Request: a message of 31,457,281 characters (at most 8,388,608)"),
        (None, -32600, "Invalid Request: arrays and objects nested more than 64 deep"),
        (7, -32600, "Invalid Request: arrays and objects nested more than 64 deep")] + [
        (None, -32700, "Parse error: Expecting value: line 1 column 1 (char 0)")] * 3
    assert replies[0]["id"] == 1 and "result" in replies[0]
    assert {"jsonrpc": "2.0", "id": 6, "result": {}} in replies
    assert err.decode().splitlines() == [
        "mcp: a line that is not JSON (Expecting value: line 1 column 1 (char 0))",
        "mcp: a line that is not JSON (Expecting value: line 1 column 1 (char 0))",
        "mcp: a line that is JSON but not JSON-RPC 2.0", "mcp: a line that is JSON but not JSON-RPC 2.0",
        "mcp: tools/list with params that are not an object",
        "mcp: notifications/cancelled with params that are not an object",
        "mcp: refused a 31,457,281-character line unread", "mcp: refused a line nested more than 64 deep",
        "mcp: refused a line nested more than 64 deep"] + [
        "mcp: a line that is not JSON (Expecting value: line 1 column 1 (char 0))"] * 3
