"""`fsdpkit mcp`: the CLI's commands as MCP tools over stdio (the official `mcp` SDK), for agents
that speak MCP (Claude Code, opencode, Cursor, VS Code; `fsdpkit skills install` registers it).

Each call runs `fsdpkit <command> ... --json` as a process of its own, so its result is the
command's own envelope (`ok`, `data`, `error.code`, `error.hint`), the data the CLI prints; a
training run or an image build cannot write into the protocol's stdout, and what it prints on
stderr reaches the caller as progress. A call the caller cancels, or a server whose
client went away, stops its process (SIGTERM first: a trainer saves on it). A destructive call
needs `yes: true` (or `dry_run: true`) before anything runs, and values of secret-named
environment variables are masked in everything sent back.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
from collections.abc import Callable
from typing import Any

from fsdpkit import __version__
from fsdpkit.cli.output import Parser, dispatch
from fsdpkit.cli.tools import Tool, tools
from fsdpkit.errors import UserError
from fsdpkit.jobs.spec import SECRET_NAME

INSTRUCTIONS = """\
fsdpkit trains LLMs with PyTorch FSDP2 from a laptop to EKS, HyperPod and Slurm clusters. Each tool is
one `fsdpkit` command (job_submit is `fsdpkit job submit`); its result is the command's JSON envelope:
ok, data, and error {code, message, hint}, where hint is the action that fixes it. Typical path:
presets / plan -> job_init -> job_render -> job_submit with dry_run: true -> job_submit -> job_watch.
Destructive tools (deletes, cluster fixes) are refused unless called with yes: true after the user
agreed, or with dry_run: true, which changes nothing."""
# How long a stopped command has to end after SIGTERM (a trainer's checkpoint) before SIGKILL.
STOP_GRACE_S = 30.0
_MASK = "***"


def secrets_of(env: dict[str, str]) -> list[str]:
    """Values that must never be sent back: those of secret-named variables (long enough to be
    one; `1` or `true` would mask every count)."""
    return sorted({v for k, v in env.items() if SECRET_NAME.search(k) and len(v) >= 8}, key=len, reverse=True)


def masked(text: str, secrets: list[str]) -> str:
    for s in secrets:
        text = text.replace(s, _MASK)
    return text


def failure(code: str, message: str, hint: str | None = None) -> dict[str, Any]:
    return {"ok": False, "data": None, "error": {"code": code, "message": message, "hint": hint}}


def refusal(err: UserError) -> dict[str, Any]:
    return failure(err.code, str(err), err.hint)


def check_arguments(tool: Tool, arguments: dict[str, Any]) -> UserError | None:
    """Arguments against the tool's schema, as one line naming the argument."""
    from jsonschema import Draft202012Validator
    from jsonschema.exceptions import best_match

    error = best_match(Draft202012Validator(tool.schema()).iter_errors(arguments))
    if error is None:
        return tool.unconfirmed(arguments)
    where = ".".join(map(str, error.absolute_path)) or "arguments"
    return UserError(f"{tool.name}: {where}: {error.message}; see the tool's input schema")


async def run_command(argv: list[str], on_line: Callable[[str], Any], secrets: list[str]) -> dict[str, Any]:
    """`fsdpkit ARGV` in its own process group, its stderr lines handed to `on_line` as they come;
    the envelope it printed, or a `failed` one with its last stderr line."""
    import anyio

    tail: list[str] = []
    async with await anyio.open_process([sys.executable, "-m", "fsdpkit", *argv], stdin=subprocess.DEVNULL,
                                        start_new_session=True) as proc:
        out = bytearray()

        async def read_out() -> None:
            assert proc.stdout is not None
            async for chunk in proc.stdout:
                out.extend(chunk)

        async def read_err() -> None:
            assert proc.stderr is not None
            pending = b""
            async for chunk in proc.stderr:
                *lines, pending = (pending + chunk).split(b"\n")
                for raw in lines:
                    if line := masked(raw.decode(errors="replace").rstrip(), secrets):
                        tail[:] = [*tail[-19:], line]
                        await on_line(line)

        try:
            async with anyio.create_task_group() as group:
                group.start_soon(read_out)
                group.start_soon(read_err)
            code = await proc.wait()
        except BaseException:
            with anyio.CancelScope(shield=True):
                await _stop(proc)
            raise
    text = masked(out.decode(errors="replace"), secrets)
    try:
        envelope = json.loads(text)
    except ValueError:
        envelope = None
    if isinstance(envelope, dict) and {"ok", "data", "error"} <= envelope.keys():
        return envelope
    last = tail[-1] if tail else f"fsdpkit {' '.join(argv[:2])} ended with exit {code} and no envelope"
    return failure("failed", last)


async def _stop(proc: Any) -> None:
    """SIGTERM to the command's process group (its workers too), SIGKILL after the grace."""
    import anyio

    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        with anyio.move_on_after(STOP_GRACE_S):
            await proc.wait()
            return


def build_server(catalogue: list[Tool], env: dict[str, str]) -> Any:
    """The lowlevel MCP server: tools/list from the catalogue, tools/call runs the command."""
    import mcp_types as types
    from mcp.server.lowlevel import Server

    by_name = {t.name: t for t in catalogue}
    secrets = secrets_of(env)
    listed = [types.Tool(
        name=t.name, title=f"fsdpkit {' '.join(t.words)}", description=t.description, input_schema=t.schema(),
        annotations=types.ToolAnnotations(title=f"fsdpkit {' '.join(t.words)}", read_only_hint=t.read_only,
                                          destructive_hint=t.destructive))
        for t in catalogue]

    def result(envelope: dict[str, Any]) -> types.CallToolResult:
        return types.CallToolResult(content=[types.TextContent(text=json.dumps(envelope, indent=2))],
                                    structured_content=envelope, is_error=not envelope["ok"])

    async def list_tools(ctx: Any, params: Any) -> types.ListToolsResult:
        return types.ListToolsResult(tools=listed)

    async def call_tool(ctx: Any, params: types.CallToolRequestParams) -> types.CallToolResult:
        tool = by_name.get(params.name)
        if tool is None:
            return result(failure("bad_input", f"no tool {params.name!r}", "pick one that tools/list names"))
        arguments = dict(params.arguments or {})
        if refused := check_arguments(tool, arguments):
            return result(refusal(refused))
        lines = 0

        async def progress(line: str) -> None:
            # Progress counts lines (no total is known); a short command's lines are not progress.
            nonlocal lines
            lines += 1
            if tool.long:
                await ctx.session.report_progress(lines, None, line)

        return result(await run_command(tool.argv(arguments), progress, secrets))

    return Server("fsdpkit", version=__version__, title="fsdpkit", instructions=INSTRUCTIONS,
                  on_list_tools=list_tools, on_call_tool=call_tool)


def serve(args: argparse.Namespace) -> int:
    try:
        import anyio
        from mcp.server.stdio import stdio_server
    except ImportError:
        raise UserError("mcp: the MCP SDK is not installed; install fsdpkit[mcp]") from None

    server = build_server(tools(), dict(os.environ))

    async def main() -> None:
        async with stdio_server() as (read, write):
            await server.run(read, write, server.create_initialization_options())

    anyio.run(main)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="fsdpkit mcp", description="Serve fsdpkit's commands as MCP tools over stdio, for AI "
                    "agents (register it with `fsdpkit skills install`). Each tool returns the command's --json "
                    "envelope.")
    parser.set_defaults(func=serve)
    return parser


def main(argv: list[str]) -> int:
    return dispatch(build_parser(), argv)
