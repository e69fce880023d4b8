"""One output contract for every command: human text, or with --json one envelope
`{"ok": bool, "data": ..., "error": {"code", "message", "hint"}}` on stdout.

Outside `fsdpkit.cli` so that the training side (`fsdpkit selftest` runs inside bare images) can
answer in the same envelope without importing the CLI.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import re
import sys
from collections.abc import Callable, Iterator, Sequence
from typing import Any, NoReturn

from fsdpkit.durations import seconds
from fsdpkit.errors import CODES, UserError

# A value that starts with a minus sign: a number or a duration, never an option's name.
_NEGATIVE = re.compile(r"^-[\d.]")


class Parser(argparse.ArgumentParser):
    """argparse that reports a usage mistake as a UserError: one line, exit 2, like any bad input."""

    def error(self, message: str) -> NoReturn:
        raise UserError(f"{message} (see `{self.prog} --help`)")

    def parse_known_args(self, args: Sequence[str] | None = None,  # type: ignore[override]
                         namespace: argparse.Namespace | None = None) -> tuple[argparse.Namespace, list[str]]:
        """`--timeout -5m` and `--lr -1e-3` reach the option's type, which names the allowed range:
        argparse would take the value for an option and say only "expected one argument"."""
        given = list(sys.argv[1:] if args is None else args)
        joined: list[str] = []
        for arg in given:
            action = self._option_string_actions.get(joined[-1]) if joined else None
            if action is not None and action.nargs is None and action.option_strings and _NEGATIVE.match(arg):
                joined[-1] = f"{joined[-1]}={arg}"
            else:
                joined.append(arg)
        return super().parse_known_args(joined, namespace)

    def add_spec_overrides(self) -> None:
        """`--set KEY=VALUE`, the same on every command that reads a job spec."""
        self.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                          help="override a job spec field, dotted for sections, kebab or snake case "
                               "(train.max-steps=100, hyperpod.auto_resume=false); repeatable")

    def add_training_option(self, flag: str, *aliases: str, group: argparse._ActionsContainer | None = None,
                            **kwargs: Any) -> None:
        """A kebab-case option named after a training option, listed (in `group` if given): its
        snake-case spelling, which a YAML file and a spec's `train:` use, and `aliases` (the
        reference FSDP example's names) are taken too, unlisted. The one place the naming rule is
        applied, for `fsdpkit train` and for the commands that share its options."""
        action = (group or self).add_argument(flag, **kwargs)
        hidden = [h for h in dict.fromkeys(["--" + flag[2:].replace("-", "_"), *(f"--{a}" for a in aliases)])
                  if h != flag]
        if hidden:
            keep = {k: v for k, v in kwargs.items() if k in ("type", "choices", "metavar", "action", "nargs")}
            (group or self).add_argument(*hidden, dest=action.dest, default=argparse.SUPPRESS,
                                         help=argparse.SUPPRESS, **keep)


def duration(raw: str) -> float:
    """argparse's type for a wait or a window: seconds, or 30s, 15m, 2h, 1d."""
    try:
        return seconds(raw)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


class LineHandler(logging.Handler):
    """fsdpkit's diagnostics, one plain line each (a warning as `warning: ...`), handed to `write`:
    the CLI writes them to stderr, so stdout stays the verb's output or its one envelope; the
    trainer beside its metric lines, where a job's log and HyperPod's log rules read them."""

    def __init__(self, write: Callable[[str], None]):
        super().__init__()
        self.write = write

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        self.write(f"warning: {message}" if record.levelno >= logging.WARNING else message)


@contextlib.contextmanager
def said_once_accepted() -> Iterator[None]:
    """What fsdpkit's loggers say inside is held, and said only if nothing inside fails: a command
    whose input is refused prints its error alone, not the notes that led up to it."""
    handler = next((h for h in logging.getLogger("fsdpkit").handlers if isinstance(h, LineHandler)), None)
    if handler is None:
        yield
        return
    write, held = handler.write, list[str]()
    handler.write = held.append
    try:
        yield
    finally:
        handler.write = write
    for line in held:
        write(line)


def show_diagnostics(write: Callable[[str], None]) -> LineHandler:
    """Send what the `fsdpkit` loggers say (info and up; debug with --verbose) through one
    LineHandler, in place of any before it: the one way diagnostics leave fsdpkit."""
    logger = logging.getLogger("fsdpkit")
    for old in [h for h in logger.handlers if isinstance(h, LineHandler)]:
        logger.removeHandler(old)
    handler = LineHandler(write)
    logger.addHandler(handler)
    if logger.level == logging.NOTSET or logger.level > logging.INFO:
        logger.setLevel(logging.INFO)
    logger.propagate = False
    return handler


def _print(ok: bool, data: Any, error: dict[str, Any] | None) -> None:
    print(json.dumps({"ok": ok, "data": data, "error": error}, indent=2, default=str))


def emit_json(data: Any, exit_code: int = 0, message: str | None = None, code: str = "failed",
              hint: str | None = None) -> int:
    """The envelope of a command that ran: `ok` exactly when it exits 0. A check that found
    problems, or a job that failed or was stopped, still carries its findings in `data`, with
    `error` saying what failed (`message`) and what to do (`hint`)."""
    if exit_code == 0:
        _print(True, data, None)
    else:
        assert code in CODES, code
        _print(False, data, {"code": code, "message": message or f"failed (exit {exit_code})", "hint": hint})
    return exit_code


def emit_error(err: UserError, as_json: bool) -> int:
    """A command that could not do its work: one line on stderr, or the envelope with no data."""
    if as_json:
        _print(False, None, {"code": err.code, "message": str(err), "hint": err.hint})
    else:
        print(f"error: {err}", file=sys.stderr)
    return err.exit_code
