"""YAML in and out: reading a file that must hold a mapping, with one-line errors that name the
file, and writing documents a person or `kubectl apply` reads (no anchors, keys in order)."""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

import yaml

from fsdpkit.errors import NotFound, UserError


class _Loader(yaml.SafeLoader):
    """YAML without 1.1's base-60 numbers: `nodes: 2:4` is the range 2 to 4 (as YAML 1.2 and every
    reader but PyYAML see it), not 124 nodes."""


_INT, _FLOAT = "tag:yaml.org,2002:int", "tag:yaml.org,2002:float"
_Loader.yaml_implicit_resolvers = {
    first: [(tag, rx) for tag, rx in resolvers if tag not in (_INT, _FLOAT)]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()}
_Loader.add_implicit_resolver(_INT, re.compile(
    r"^(?:[-+]?0b[0-1_]+|[-+]?0[0-7_]+|[-+]?(?:0|[1-9][0-9_]*)|[-+]?0x[0-9a-fA-F_]+)$"), list("-+0123456789"))
_Loader.add_implicit_resolver(_FLOAT, re.compile(
    r"^(?:[-+]?(?:[0-9][0-9_]*)\.[0-9_]*(?:[eE][-+][0-9]+)?|\.[0-9_]+(?:[eE][-+][0-9]+)?|[-+]?\.(?:inf|Inf|INF)"
    r"|\.(?:nan|NaN|NAN))$"), list("-+0123456789."))


def load(text: str) -> Any:
    """Parse YAML the way fsdpkit reads every user file and `--set` value."""
    return yaml.load(text, Loader=_Loader)


def load_mapping(path: str | os.PathLike, label: str, holds: str) -> dict[str, Any]:
    """The mapping in `path`; `label` starts each error ("config", "job spec"), `holds` says what
    the mapping should contain."""
    p = Path(path)
    if not p.is_file():
        raise NotFound(f"{label}: file not found: {p}")
    try:
        doc = load(p.read_text()) or {}
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


# Plain scalars that some reader takes for something other than a string: YAML 1.2's core schema
# (kubectl, Go's YAML libraries: `1e-08`, `0o17`, `.5`), YAML 1.1 (PyYAML, older Go: `yes`, `on`,
# `y`, `1_000`, `1:30`). PyYAML's dumper quotes only what YAML 1.1 as PyYAML reads it would change,
# so `1e-08` went out plain and kubectl read a number where the pod's command needs a string.
_NOT_A_STRING = re.compile(r"""^(?:
    [-+]?(?:[0-9][0-9_]*(?:\.[0-9_]*)?|\.[0-9][0-9_]*)(?:[eE][-+]?[0-9]+)?   # 1, 1.5, .5, 1e-08, 1_000
  | [-+]?0(?:[bB][01_]+|[oO]?[0-7_]+|[xX][0-9a-fA-F_]+)                  # 0b101, 0o17, 017, 0x1f
  | [-+]?[0-9][0-9_]*(?::[0-5]?[0-9])+(?:\.[0-9_]*)?                     # 1:30 (base 60)
  | [-+]?\.(?:inf|Inf|INF) | \.(?:nan|NaN|NAN)
  | y|Y|yes|Yes|YES|n|N|no|No|NO|true|True|TRUE|false|False|FALSE|on|On|ON|off|Off|OFF
  | ~|null|Null|NULL|=|<<
)$""", re.X)


class _PlainDumper(yaml.SafeDumper):
    """A dict used twice (two replicas' pod templates) is written twice, not as &id001 / *id001:
    anchors are valid YAML but unreadable in a manifest, and some tools reject them. A string that
    any YAML reader could take for a number, bool or null is quoted."""

    def ignore_aliases(self, data: Any) -> bool:
        return True


def _represent_str(dumper: yaml.SafeDumper, data: str) -> yaml.Node:
    if _NOT_A_STRING.match(data):
        return dumper.represent_scalar("tag:yaml.org,2002:str", data, style="'")
    return dumper.represent_str(data)


_PlainDumper.add_representer(str, _represent_str)


def dump(doc: Any) -> str:
    return yaml.dump(doc, Dumper=_PlainDumper, sort_keys=False)


def dump_all(docs: list[Any]) -> str:
    return yaml.dump_all(docs, Dumper=_PlainDumper, sort_keys=False)
