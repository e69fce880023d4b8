"""YAML in and out: reading a file that must hold a mapping, with one-line errors that name the
file, and writing documents a person or `kubectl apply` reads (no anchors, keys in order).

Every YAML fsdpkit reads (configs, job specs, `--set` values, a run's config.yaml) goes through
`load`: a key given twice is refused (PyYAML would keep the last silently), a document whose
aliases would expand past MAX_NODES nodes is refused before anything walks it (an alias bomb is a
few hundred bytes that grow to gigabytes), and a file over MAX_BYTES is refused before it is read."""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any, cast

import yaml

from fsdpkit.errors import NotFound, UserError

MAX_BYTES = 4 * 2**20   # configs and specs are kilobytes; a 50 MB spec took 80 s and 1.5 GB to accept
MAX_NODES = 200_000     # nodes of the document with every alias expanded


class _Loader(yaml.SafeLoader):
    """YAML read as YAML 1.2 reads it where 1.1 differs: `nodes: 2:4` is the range 2 to 4, not 124
    nodes (no base-60 numbers), and `yes`/`on` are strings. Duplicate keys and alias bombs are
    refused."""

    def compose_document(self) -> yaml.Node | None:
        node = super().compose_document()
        if node is not None:
            _check_expanded_size(node)
        return node

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        if isinstance(node, yaml.MappingNode):
            seen: set[Any] = set()
            for key_node, _ in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":
                    continue
                key = self.construct_object(key_node, deep=True)
                if isinstance(key, list):
                    continue  # an unhashable key: SafeConstructor says so itself
                if key in seen:
                    raise yaml.constructor.ConstructorError(
                        None, None, f"{key!r} is given twice in one mapping (keep one)", key_node.start_mark)
                seen.add(key)
        return cast("dict[str, Any]", super().construct_mapping(node, deep=deep))


def _check_expanded_size(root: yaml.Node) -> None:
    """Refuse a document that would have more than MAX_NODES nodes once its aliases are expanded.
    Each node is sized once (aliases share the node they point to), so this is linear in the
    document as written, however far it would expand."""
    sizes: dict[int, int] = {}
    open_nodes: set[int] = set()

    def size(node: yaml.Node) -> int:
        key = id(node)
        if key in sizes:
            return sizes[key]
        if key in open_nodes:
            raise yaml.composer.ComposerError(None, None, "an alias refers to a node that contains it",
                                              node.start_mark)
        open_nodes.add(key)
        total = 1
        if isinstance(node, yaml.SequenceNode):
            total += sum(size(child) for child in node.value)
        elif isinstance(node, yaml.MappingNode):
            total += sum(size(k) + size(v) for k, v in node.value)
        open_nodes.discard(key)
        if total > MAX_NODES:
            raise yaml.composer.ComposerError(
                None, None, f"its aliases expand to more than {MAX_NODES:,} nodes (an alias bomb?)", node.start_mark)
        sizes[key] = total
        return total

    size(root)


_INT, _FLOAT, _BOOL = "tag:yaml.org,2002:int", "tag:yaml.org,2002:float", "tag:yaml.org,2002:bool"
_Loader.yaml_implicit_resolvers = {
    first: [(tag, rx) for tag, rx in resolvers if tag not in (_INT, _FLOAT, _BOOL)]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()}
# Booleans as YAML 1.2 (and kubectl) read them: yes, no, on and off are strings (`name: yes` was a
# job named 'true'); a boolean option still takes them, as it takes them on the command line.
_Loader.add_implicit_resolver(_BOOL, re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"), list("tTfF"))
_Loader.add_implicit_resolver(_INT, re.compile(
    r"^(?:[-+]?0b[0-1_]+|[-+]?0[0-7_]+|[-+]?(?:0|[1-9][0-9_]*)|[-+]?0x[0-9a-fA-F_]+)$"), list("-+0123456789"))
_Loader.add_implicit_resolver(_FLOAT, re.compile(
    r"^(?:[-+]?(?:[0-9][0-9_]*)\.[0-9_]*(?:[eE][-+][0-9]+)?|\.[0-9_]+(?:[eE][-+][0-9]+)?|[-+]?\.(?:inf|Inf|INF)"
    r"|\.(?:nan|NaN|NAN))$"), list("-+0123456789."))


def load(text: str) -> Any:
    """Parse YAML the way fsdpkit reads every user file and `--set` value."""
    if len(text) > MAX_BYTES:
        raise yaml.YAMLError(f"it is {len(text) / 2**20:.1f} MiB; fsdpkit reads YAML of up to "
                             f"{MAX_BYTES // 2**20} MiB")
    return yaml.load(text, Loader=_Loader)


def load_mapping(path: str | os.PathLike[str], label: str, holds: str) -> dict[str, Any]:
    """The mapping in `path`; `label` starts each error ("config", "job spec"), `holds` says what
    the mapping should contain."""
    p = Path(path)
    if not p.is_file():
        raise NotFound(f"{label}: file not found: {p}")
    if (size := p.stat().st_size) > MAX_BYTES:  # before reading it: a huge file costs time and memory
        raise UserError(f"{label}: {p} is {size / 2**20:.1f} MiB; fsdpkit reads YAML files of up to "
                        f"{MAX_BYTES // 2**20} MiB (is it the right file?)")
    try:
        doc = load(p.read_text()) or {}
    except UnicodeDecodeError:
        raise UserError(f"{label}: {p} is not text (not UTF-8); pass the YAML file of {holds}") from None
    except OSError as e:
        raise UserError(f"{label}: cannot read {p}: {e.strerror or e}") from None
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
    return cast("str", yaml.dump(doc, Dumper=_PlainDumper, sort_keys=False))


def dump_all(docs: list[Any]) -> str:
    return cast("str", yaml.dump_all(docs, Dumper=_PlainDumper, sort_keys=False))
