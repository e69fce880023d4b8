"""YAML in and out: reading a file that must hold a mapping, with one-line errors that name the
file, and writing documents a person or `kubectl apply` reads (no anchors, keys in order)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import yaml

from fsdpkit.errors import UserError


def load_mapping(path: str | os.PathLike, label: str, holds: str) -> dict[str, Any]:
    """The mapping in `path`; `label` starts each error ("config", "job spec"), `holds` says what
    the mapping should contain."""
    p = Path(path)
    if not p.is_file():
        raise UserError(f"{label}: file not found: {p}")
    try:
        doc = yaml.safe_load(p.read_text()) or {}
    except yaml.YAMLError as e:
        raise UserError(f"{label}: {p} is not valid YAML: {describe_yaml_error(e)}") from None
    if not isinstance(doc, dict):
        raise UserError(f"{label}: {p} must hold a mapping of {holds}")
    return doc


def describe_yaml_error(e: yaml.YAMLError) -> str:
    """`line L, column C: what` (1-based, where the parser noticed), so the error points into the file."""
    mark = getattr(e, "problem_mark", None) or getattr(e, "context_mark", None)
    what = " ".join(x for x in (getattr(e, "context", None), getattr(e, "problem", None)) if x)
    what = what or str(e).splitlines()[0]
    return f"line {mark.line + 1}, column {mark.column + 1}: {what}" if mark else what


class _PlainDumper(yaml.SafeDumper):
    """A dict used twice (two replicas' pod templates) is written twice, not as &id001 / *id001:
    anchors are valid YAML but unreadable in a manifest, and some tools reject them."""

    def ignore_aliases(self, data: Any) -> bool:
        return True


def dump(doc: Any) -> str:
    return yaml.dump(doc, Dumper=_PlainDumper, sort_keys=False)


def dump_all(docs: list[Any]) -> str:
    return yaml.dump_all(docs, Dumper=_PlainDumper, sort_keys=False)
