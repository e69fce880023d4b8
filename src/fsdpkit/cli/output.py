"""Running a verb under the output contract of fsdpkit.envelope (re-exported here for the verbs)."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

from fsdpkit.aws import session as aws_session
from fsdpkit.cluster import client as cluster_client
from fsdpkit.cluster import kubeconfig
from fsdpkit.envelope import Parser, emit_error, emit_json, show_diagnostics
from fsdpkit.errors import Conflict, UserError

__all__ = ["Parser", "add_namespace", "add_spec_namespace", "confirmed", "context_namespace", "delete_asked",
           "dispatch", "emit_error", "emit_json", "finding_message", "print_findings", "progress", "write_new"]


def add_namespace(p: argparse.ArgumentParser, what: str = "the job's", when: str | None = None) -> None:
    """`-n/--namespace`, resolved as kubectl resolves it before the verb runs (dispatch): the flag,
    else the kubeconfig context's namespace, else default. `when`: the option without which the verb
    touches no cluster (`ckpt list --pvc`), so no kubeconfig is read."""
    p.add_argument("-n", "--namespace", help=f"{what} Kubernetes namespace (default: the kubeconfig context's, "
                   "else default)")
    p.set_defaults(resolve_namespace=when or True)


def add_spec_namespace(p: argparse.ArgumentParser, what: str) -> None:
    """`-n/--namespace` of a verb that reads a spec: an override of the spec's `namespace:`, so not
    resolved here; where neither names one, the spec's load asks `context_namespace(args)`."""
    p.add_argument("-n", "--namespace", help=f"{what} namespace (default: the spec's, else the kubeconfig "
                   "context's, else default)")


def context_namespace(args: argparse.Namespace) -> Callable[[], str | None]:
    """The kubeconfig context's namespace, read only when asked (load_job's `namespace`)."""
    return lambda: kubeconfig.context_namespace(getattr(args, "context", None), getattr(args, "kubeconfig", None))


def resolve_namespace(args: argparse.Namespace) -> None:
    """args.namespace as the verb acts in it (add_namespace), so its output says the one it used."""
    when = getattr(args, "resolve_namespace", False)
    if when is True or (isinstance(when, str) and getattr(args, when, None)):
        args.namespace = kubeconfig.namespace(args.namespace, getattr(args, "context", None),
                                              getattr(args, "kubeconfig", None))


def progress(args: argparse.Namespace) -> Callable[[str], None]:
    """Where a verb's progress lines go: stderr under --json, so stdout stays one envelope."""
    out = sys.stderr if getattr(args, "json", False) else sys.stdout
    return lambda message: print(message, file=out, flush=True)


def confirmed(args: argparse.Namespace, what: str, question: str, verb: str = "delete") -> bool:
    """Consent to destroy something (or, `verb` "create", to start what bills): --yes, or "y" at a
    terminal. Under --json or without a terminal nobody can answer, so that is a one-line error
    naming --yes, not a silent no."""
    if getattr(args, "yes", False):
        return True
    if getattr(args, "json", False) or not sys.stdin.isatty():
        said = f"removes {what}" if verb == "delete" else f"makes {what}, which can cost money"
        raise UserError(f"{verb}: {said}; add --yes to confirm", code="unconfirmed")
    if input(f"{question} [y/N] ").strip().lower() in ("y", "yes"):
        return True
    print(f"nothing {verb}d")
    return False


def delete_asked(args: argparse.Namespace, targets: list[str], delete: Callable[[], list[str]], question: str,
                 ask: bool = True) -> int:
    """The one flow of a verb that deletes, given what it would delete: `--dry-run` lists that and
    stops; otherwise (with `ask`) the user confirms or passes --yes, then `delete()` runs and what
    went is said."""
    if args.dry_run:
        if args.json:
            return emit_json({"dry_run": True, "would_delete": targets})
        print(f"would delete {', '.join(targets) or 'nothing'}")
        return 0
    if ask and targets and not confirmed(args, ", ".join(targets), question):
        return 1
    deleted = delete()
    if args.json:
        return emit_json({"deleted": deleted})
    print(f"deleted {', '.join(deleted)}")
    return 0


def check_new(path: Path, force: bool) -> None:
    """A file the command will make is not there yet, or --force says to replace it (checked before
    any work, so a refusal costs nothing)."""
    if path.exists() and not force:
        raise Conflict(f"{path} already exists; pass --force to overwrite it, or --out elsewhere")


def write_new(path: Path, text: str, force: bool) -> None:
    """Write a file the command makes (a spec, a config, an example), never over one that exists
    unless --force; whole or not at all (a half-written config must never reach eksctl)."""
    check_new(path, force)
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        tmp.write_text(text)
        os.replace(tmp, path)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        raise UserError(f"--out: cannot write {path}: {e.strerror}") from None


def finding_message(f: dict[str, Any]) -> str:
    """A finding (`jobs.health.Finding` as a dict) as one line: what the envelope's message says."""
    return f"{f['kind']} {f['pod']}: {f['detail']}"


def print_findings(findings: list[dict[str, Any]]) -> None:
    """Findings under a command's human output, each with its fix."""
    for f in findings:
        print(f"  ! {finding_message(f)}" + (f"\n    fix: {f['fix']}" if f.get("fix") else ""), flush=True)


def cloud_error(e: BaseException, what: str) -> UserError | None:
    """An AWS or Kubernetes client failure as its one-line error, else None (a bug: let it show)."""
    package = type(e).__module__.split(".")[0]
    if package == "botocore":
        return aws_session.translate(e, what)
    if package in ("kubernetes", "urllib3"):
        return cluster_client.translate(e, what)
    return None


def _to_stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)  # the stream of the moment (tests swap it)


def show_notes() -> None:
    """fsdpkit's notes and warnings (its logger) on stderr, whatever stream is stderr at the time."""
    show_diagnostics(_to_stderr)


def dispatch(parser: argparse.ArgumentParser, argv: list[str]) -> int:
    """Parse, run the chosen `func(args) -> int`, and turn a UserError into the error contract."""
    show_notes()
    args = None
    try:
        args = parser.parse_args(argv)
        resolve_namespace(args)
        return cast("int", args.func(args))
    except UserError as e:
        return emit_error(e, getattr(args, "json", "--json" in argv))
    except Exception as e:
        # The one error path for AWS and Kubernetes: whatever no narrower handler caught (a
        # credential lookup inside a token refresh, an endpoint that is down) is still one line.
        err = cloud_error(e, parser.prog)
        if err is None:
            raise
        return emit_error(err, getattr(args, "json", "--json" in argv))
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
