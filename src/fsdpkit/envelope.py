"""One output contract for every command: human text, or with --json one envelope
`{"ok": bool, "data": ..., "error": {"code", "message", "hint"}}` on stdout.

Outside `fsdpkit.cli` so that the training side (`fsdpkit selftest` runs inside bare images) can
answer in the same envelope without importing the CLI.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from fsdpkit.errors import UserError


class Parser(argparse.ArgumentParser):
    """argparse that reports a usage mistake as a UserError: one line, exit 2, like any bad input."""

    def error(self, message: str):
        raise UserError(f"{message} (see `{self.prog} --help`)")


def emit_json(data: Any) -> int:
    print(json.dumps({"ok": True, "data": data, "error": None}, indent=2, default=str))
    return 0


def emit_error(err: UserError, as_json: bool, code: str = "bad_input", hint: str | None = None) -> int:
    if as_json:
        print(json.dumps({"ok": False, "data": None,
                          "error": {"code": code, "message": str(err), "hint": hint}}, indent=2))
    else:
        print(f"error: {err}", file=sys.stderr)
    return err.exit_code
