"""`fsdpkit mcp`: the CLI's commands as MCP tools over stdio (the official `mcp` SDK), for agents
that speak MCP (Claude Code, opencode, Cursor, VS Code; `fsdpkit skills install` registers it).

Each call runs `fsdpkit <command> ... --json` as a process of its own, so its result is the
command's own envelope (`ok`, `data`, `error.code`, `error.hint`), the data the CLI prints; a
training run or an image build cannot write into the protocol's stdout, and what it prints on
stderr reaches the caller as progress. A call the caller cancels, or a server whose
client went away, stops its process (SIGTERM first: a trainer saves on it). A call that would create, delete, cost
money or overwrite files (the command's declared effects, fsdpkit.effects) needs `yes: true` (or
`dry_run: true`) before anything runs; `--read-only` serves only the tools that change nothing. Every
call is appended to an audit log in FSDPKIT_HOME, and values of secret-named environment variables
and arguments are masked there and in everything sent back.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from fsdpkit import __version__
from fsdpkit.cli.output import Parser, dispatch
from fsdpkit.cli.tools import Tool, tools
from fsdpkit.errors import UserError
from fsdpkit.home import home, make_dir
from fsdpkit.jobs.spec import SECRET_NAME

INSTRUCTIONS = """\
fsdpkit trains LLMs with PyTorch FSDP2 from a laptop to EKS, HyperPod and Slurm clusters. Each tool is
one `fsdpkit` command (job_submit is `fsdpkit job submit`); its result is the command's JSON envelope:
ok, data, and error {code, message, hint}, where hint is the action that fixes it. Typical path:
presets / plan -> job_init -> job_render -> job_submit with dry_run: true -> job_submit -> job_watch.
A call that creates or deletes cloud or cluster resources, starts what AWS bills, or overwrites files
is refused unless called with yes: true after the user agreed, or with dry_run: true, which changes
nothing; each tool's description of `yes` says what it would do."""
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


# A secret-named key given a value inside an argument (`--set env.HF_TOKEN=...`, `HF_TOKEN: ...`).
_SECRET_ASSIGNMENT = re.compile(rf"([\w.-]*{SECRET_NAME.pattern}[\w.-]*\s*[=:]\s*)\S+", re.I)


def masked_arguments(arguments: Any, secrets: list[str]) -> Any:
    """A call's arguments as the audit log keeps them: secret-named ones, secret values and secret
    assignments inside strings masked."""
    if isinstance(arguments, dict):
        return {k: _MASK if SECRET_NAME.search(str(k)) else masked_arguments(v, secrets) for k, v in arguments.items()}
    if isinstance(arguments, list):
        return [masked_arguments(v, secrets) for v in arguments]
    if isinstance(arguments, str):
        return _SECRET_ASSIGNMENT.sub(lambda m: m.group(1) + _MASK, masked(arguments, secrets))
    return arguments


def audit_path() -> Path:
    return home() / "mcp" / "audit.jsonl"


def audit(tool: str, arguments: Any, envelope: dict[str, Any], secrets: list[str]) -> None:
    """One line per call: when, which tool, its arguments (masked), and how it ended."""
    error = envelope.get("error") or {}
    record = {"time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "tool": tool,
              "arguments": masked_arguments(arguments, secrets), "ok": bool(envelope.get("ok")),
              "code": error.get("code")}
    make_dir(audit_path().parent)
    with audit_path().open("a") as f:
        f.write(json.dumps(record) + "\n")


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
                                          destructive_hint=t.destructive, open_world_hint=t.open_world))
        for t in catalogue]

    def result(envelope: dict[str, Any]) -> types.CallToolResult:
        return types.CallToolResult(content=[types.TextContent(text=json.dumps(envelope, indent=2))],
                                    structured_content=envelope, is_error=not envelope["ok"])

    async def list_tools(ctx: Any, params: Any) -> types.ListToolsResult:
        return types.ListToolsResult(tools=listed)

    async def call_tool(ctx: Any, params: types.CallToolRequestParams) -> types.CallToolResult:
        # A call the caller cancels leaves through the finally with this envelope: audited too.
        envelope = failure("cancelled", f"the caller cancelled {params.name} before it ended")
        try:
            envelope = await answer(ctx, params)
        finally:
            audit(params.name, params.arguments or {}, envelope, secrets)
        return result(envelope)

    async def answer(ctx: Any, params: types.CallToolRequestParams) -> dict[str, Any]:
        tool = by_name.get(params.name)
        if tool is None:
            return failure("bad_input", f"no tool {params.name!r}", "pick one that tools/list names")
        arguments = dict(params.arguments or {})
        if refused := check_arguments(tool, arguments):
            return refusal(refused)
        lines = 0

        async def progress(line: str) -> None:
            # Progress counts lines (no total is known); a short command's lines are not progress.
            nonlocal lines
            lines += 1
            if tool.long:
                await ctx.session.report_progress(lines, None, line)

        return await run_command(tool.argv(arguments), progress, secrets)

    return Server("fsdpkit", version=__version__, title="fsdpkit", instructions=INSTRUCTIONS,
                  on_list_tools=list_tools, on_call_tool=call_tool)


# JSON-RPC 2.0's own error codes (section 5.1 of the specification).
PARSE_ERROR, INVALID_REQUEST, INVALID_PARAMS = -32700, -32600, -32602
MAX_LINE = 8 * 2**20   # a message longer than this is refused unread (no MCP message comes near it)
MAX_DEPTH = 64         # arrays and objects within each other: an MCP message nests a handful deep


def _deeper_than(value: Any, limit: int) -> bool:
    """Whether arrays and objects nest more than `limit` deep in `value` (walked without recursion)."""
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict | list):
            if depth > limit:
                return True
            stack.extend((child, depth + 1) for child in (item.values() if isinstance(item, dict) else item))
    return False


def _id_of(message: Any) -> int | str | None:
    found = message.get("id") if isinstance(message, dict) else None
    return found if isinstance(found, int | str) and not isinstance(found, bool) else None


def check_line(line: str) -> tuple[dict[str, Any] | None, str] | None:
    """None for a line that is a JSON-RPC message; else the error reply the specification gives it
    (None for a notification, which gets none) and what to say on stderr."""
    def error(code: int, message: str, of: Any = None) -> dict[str, Any]:
        return {"jsonrpc": "2.0", "id": _id_of(of), "error": {"code": code, "message": message}}

    if len(line) > MAX_LINE:
        return error(INVALID_REQUEST, f"Invalid Request: a message of {len(line):,} characters (at most "
                     f"{MAX_LINE:,})"), f"mcp: refused a {len(line):,}-character line unread"
    too_deep = f"Invalid Request: arrays and objects nested more than {MAX_DEPTH} deep"
    try:
        message = json.loads(line)
    except RecursionError:   # the parser's own stack: far deeper than MAX_DEPTH
        return error(INVALID_REQUEST, too_deep), f"mcp: refused a line nested more than {MAX_DEPTH} deep"
    except ValueError as e:
        return error(PARSE_ERROR, f"Parse error: {e}"), f"mcp: a line that is not JSON ({e})"
    if _deeper_than(message, MAX_DEPTH):
        return error(INVALID_REQUEST, too_deep, message), f"mcp: refused a line nested more than {MAX_DEPTH} deep"
    if not isinstance(message, dict) or message.get("jsonrpc") != "2.0" or not (
            isinstance(message.get("method"), str) or "result" in message or "error" in message):
        return error(INVALID_REQUEST, "Invalid Request: not a JSON-RPC 2.0 request, notification or response",
                     message), "mcp: a line that is JSON but not JSON-RPC 2.0"
    if "method" in message and "params" in message and not isinstance(message["params"], dict):
        reply = error(INVALID_PARAMS, f"Invalid params: {message['method']}'s params must be an object",
                      message) if "id" in message else None
        return reply, f"mcp: {message['method']} with params that are not an object"
    return None


class CheckedLines:
    """stdin's lines as the SDK's transport reads them, each one a JSON-RPC message: what is not
    is answered here, as JSON-RPC answers it (`replies`), and said on stderr; the SDK only logs it."""

    def __init__(self, lines: Any):
        import anyio

        self.lines = lines
        self._send, self.replies = anyio.create_memory_object_stream[dict[str, Any]](64)
        self.answered = anyio.Event()   # set by whoever sends `replies`, once they are all sent

    def __aiter__(self) -> Any:
        return self._checked()

    async def _checked(self) -> Any:
        import anyio

        async with self._send:
            async for line in self.lines:
                if not line.strip():
                    continue
                if (problem := check_line(line)) is None:
                    yield line
                    continue
                reply, note = problem
                print(note, file=sys.stderr, flush=True)
                if reply is not None:
                    await self._send.send(reply)
        # stdin has ended: the replies owed go out before the session hears of the end (it then
        # closes its writer; a reply after that would be lost, or raise).
        with anyio.move_on_after(5):
            await self.answered.wait()


def serve(args: argparse.Namespace) -> int:
    try:
        import anyio
        import mcp_types as types
        from mcp.server.stdio import stdio_server
        from mcp.shared.message import SessionMessage
    except ImportError:
        raise UserError("mcp: the MCP SDK is not installed; install fsdpkit[mcp]") from None

    catalogue = [t for t in tools() if t.read_only or not args.read_only]
    server = build_server(catalogue, dict(os.environ))
    # Read here, not by the transport (it would pass on what is not JSON-RPC without a reply).
    stdin = CheckedLines(anyio.wrap_file(io.TextIOWrapper(sys.stdin.buffer, encoding="utf-8", errors="replace")))

    async def main() -> None:
        async with stdio_server(stdin=stdin) as (read, write):   # type: ignore[arg-type]
            async def answer_bad_lines() -> None:
                async for reply in stdin.replies:
                    await write.send(SessionMessage(types.jsonrpc_message_adapter.validate_python(reply)))
                stdin.answered.set()

            async with anyio.create_task_group() as group:
                group.start_soon(answer_bad_lines)
                await server.run(read, write, server.create_initialization_options())
                group.cancel_scope.cancel()

    anyio.run(main)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="fsdpkit mcp", description="Serve fsdpkit's commands as MCP tools over stdio, for AI "
                    "agents (register it with `fsdpkit skills install`). Each tool returns the command's --json "
                    "envelope. Every call, refused and cancelled ones too, is one line of "
                    "FSDPKIT_HOME/mcp/audit.jsonl (FSDPKIT_HOME: ~/.fsdpkit unless set), secrets masked.")
    parser.add_argument("--read-only", action="store_true", help="serve only the tools that change nothing (no "
                        "writes, creates, deletes or costs), for an agent that may only look")
    parser.set_defaults(func=serve)
    return parser


def main(argv: list[str]) -> int:
    return dispatch(build_parser(), argv)
