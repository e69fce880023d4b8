"""Errors that are the user's to fix: the CLI prints them as one line and exits non-zero.

Each carries a `code` from one small fixed set, so an agent can branch on it without parsing the
message, and a `hint`: the one action that fixes it. Most messages already end in that action
("...; pass --region or set AWS_REGION"): the hint is that clause unless one is given."""

from __future__ import annotations

import re

# The whole set of error codes, documented in docs/reference.md (`fsdpkit --help` links there).
CODES = {
    "bad_input": "a flag, a file or a value is wrong; nothing was changed",
    "not_found": "the named job, checkpoint, cluster or AWS resource does not exist",
    "no_credentials": "no AWS credentials, or expired ones",
    "access_denied": "AWS, the cluster or Prometheus refused: a permission (IAM, RBAC) is missing",
    "unreachable": "AWS, the Kubernetes API, Prometheus, Slurm or the Hugging Face hub could not be reached, or "
                   "kept throttling",
    "refused": "the cluster's admission (Pod Security, PriorityClass, quota, LimitRange, a webhook) refused what "
               "would be created, naming its rule; nothing was stored",
    "conflict": "something of that name already exists",
    "unconfirmed": "a command that deletes or changes what exists was not confirmed (--yes, or yes: true as a tool); "
                   "nothing was changed",
    "timeout": "waited as long as asked; the work goes on",
    "failed": "the command ran and what it checked or ran failed; the findings are in data",
}

# A clause that starts with one of these is an instruction: the hint.
_ACTIONS = ("add", "ask", "check", "choose", "create", "delete", "drop", "export", "fix", "give", "install", "keep",
            "lower", "make", "move", "pass", "pick", "point", "put", "raise", "reduce", "refresh", "remove",
            "rename", "resume", "retry", "run", "see", "set", "start", "try", "turn", "use", "wait", "write")
_CLAUSE = re.compile(r"[;:(]\s*((?:" + "|".join(_ACTIONS) + r")\b[^;]*)$", re.I)


def hint_of(message: str) -> str | None:
    """The message's closing instruction ("...; pass --region or set AWS_REGION" -> its last clause)."""
    m = _CLAUSE.search(message)
    if not m:
        return None
    clause = m.group(1).strip()
    if clause.count(")") > clause.count("("):  # the clause was "(see `...`)"
        clause = clause[:clause.rfind(")")]
    return clause.rstrip(" .")


class UserError(Exception):
    """A mistake in the user's input (a flag, a file, a value out of range), or a refusal the user
    can act on. Subclasses set their own exit code and error code."""

    exit_code = 2
    code = "bad_input"

    def __init__(self, message: str, hint: str | None = None, code: str | None = None):
        super().__init__(message)
        if code is not None:
            self.code = code
        assert self.code in CODES, self.code
        self.hint = hint or hint_of(message)


class Conflict(UserError):
    """A job, cluster or file of that name already exists."""

    code = "conflict"


class TimedOut(UserError):
    """Waited as long as asked (a --timeout, or a wait's own limit) and what was awaited has not
    happened; the work goes on. Exit 124 on every verb, as `timeout(1)` ends."""

    exit_code = 124
    code = "timeout"


class Unreachable(UserError):
    """A service the command needs (Slurm's controller, the Hugging Face hub) cannot be reached:
    exit 3, as for AWS or a cluster that cannot be."""

    exit_code = 3
    code = "unreachable"


class NotFound(UserError):
    """A job, checkpoint or file the user named does not exist."""

    code = "not_found"
