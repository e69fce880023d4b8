"""The `raise UserError(...)` statements of validator functions, read from their source, so a table
of negative tests can be checked to reach every one of them (a rule added without a row fails)."""

from __future__ import annotations

import ast
import inspect
import textwrap
from collections.abc import Callable


def raise_sites(*functions: Callable) -> dict[str, list[str]]:
    """`function:line` -> the literal text of that raise's message, in order (f-string holes left out)."""
    sites = {}
    for fn in functions:
        source, first = inspect.getsourcelines(fn)
        tree = ast.parse(textwrap.dedent("".join(source)))
        for node in ast.walk(tree):
            if isinstance(node, ast.Raise) and isinstance(node.exc, ast.Call) \
                    and getattr(node.exc.func, "id", None) == "UserError":
                message = node.exc.args[0]
                parts = [message.value] if isinstance(message, ast.Constant) else [
                    v.value for v in getattr(message, "values", []) if isinstance(v, ast.Constant)]
                sites[f"{fn.__qualname__}:{first + node.lineno - 1}"] = [p for p in parts if p.strip()]
    return sites


def reached(parts: list[str], messages: list[str]) -> bool:
    """Whether one of the messages holds every literal part of a site's message, in order."""
    for message in messages:
        at = 0
        for part in parts:
            at = message.find(part, at)
            if at < 0:
                break
            at += len(part)
        else:
            return True
    return False


def unreached(sites: dict[str, list[str]], messages: list[str]) -> list[str]:
    return [site for site, parts in sites.items() if not reached(parts, messages)]
