"""What checkpoints a directory holds, from names and metadata alone (no torch, so configuration
and `fsdpkit ckpt` read it without loading the trainer): the complete `step-N` checkpoints with
their fsdpkit.json, saves that did not finish, damaged ones set aside, the reference example's, the
newest complete one, and the one pruning rule."""

from __future__ import annotations

import json
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fsdpkit.errors import NotFound, UserError

NAME = re.compile(r"^step-(\d+)$")
# The reference FSDP example names its checkpoints `{model_type}-{step}steps`.
REFERENCE_NAME = re.compile(r"^(?P<model>[A-Za-z0-9_.]+)-(?P<step>\d+)steps$")
TMP_NAME = re.compile(r"^\.step-(\d+)\.tmp$")
# A checkpoint found damaged at resume is set aside under this name (never deleted: it may hold
# the only copy of a long run, and a person should decide).
DAMAGED_NAME = re.compile(r"^step-(\d+)\.damaged(\.\d+)?$")
META = "fsdpkit.json"


@dataclass(frozen=True)
class CheckpointInfo:
    path: Path
    step: int
    meta: dict[str, Any]
    problem: str | None = None  # why its fsdpkit.json cannot be read (a damaged checkpoint)


def read_meta(path: Path) -> tuple[dict[str, Any], str | None]:
    """A checkpoint's fsdpkit.json, or ({}, what is wrong with it): a truncated or garbled file
    makes the checkpoint damaged, never a traceback."""
    try:
        meta = json.loads((path / META).read_bytes())
    except (OSError, ValueError) as e:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        return {}, f"{META} cannot be read ({type(e).__name__})"
    if not isinstance(meta, dict):
        return {}, f"{META} holds no mapping"
    return meta, None


def _info(path: Path, step: int) -> CheckpointInfo:
    meta, problem = read_meta(path)
    return CheckpointInfo(path, step, meta, problem)


def list_checkpoints(directory: Path, damaged: bool = False) -> list[CheckpointInfo]:
    """Complete checkpoints in `directory`, oldest first; with `damaged`, also those whose
    fsdpkit.json cannot be read (their `problem` says why)."""
    out = []
    if directory.is_dir():
        for p in directory.iterdir():
            m = NAME.match(p.name)
            if m and (p / META).is_file():
                info = _info(p, int(m.group(1)))
                if damaged or info.problem is None:
                    out.append(info)
    return sorted(out, key=lambda c: c.step)


def resolve(spec: str, what: str = "resume_from_checkpoint", verb: str = "resume from") -> CheckpointInfo | None:
    """A checkpoint directory itself, or the newest complete one inside a checkpoint root (one whose
    metadata cannot be read is skipped there; resume sets it aside and says so). `what` and `verb`
    name the command in its errors (export: "export", "export")."""
    p = Path(spec)
    if not p.exists() and NAME.match(p.name):   # one checkpoint named, not a root a first run may start
        raise UserError(f"{what}: no checkpoint {p}; fsdpkit ckpt list {p.parent} shows the ones "
                        f"there, or pass the directory to {verb} its newest")
    if p.exists() and not p.is_dir():
        raise UserError(f"{what}: {p} is a file, not a checkpoint; pass a checkpoint directory "
                        "or the checkpoint root that holds them")
    if (p / META).is_file() and (m := NAME.match(p.name)):
        info = _info(p, int(m.group(1)))
        if info.problem:
            raise UserError(f"{what}: {p} is damaged and cannot be read ({info.problem}); "
                            f"pass its parent directory to {verb} the newest checkpoint that is whole")
        return info
    if p.is_dir() and (TMP_NAME.match(p.name) or NAME.match(p.name) or (p / ".metadata").is_file()):
        raise UserError(f"{what}: {p} is not a complete fsdpkit checkpoint (a save that did "
                        f"not finish?); pass its parent directory to {verb} the newest complete one")
    found = list_checkpoints(p)
    if not found and p.is_dir():
        reference = sorted(c.name for c in p.iterdir() if REFERENCE_NAME.match(c.name))
        if reference:
            raise UserError(f"{what}: {p} holds only checkpoints of the reference example "
                            f"({reference[-1]}); fsdpkit cannot resume those: use another --checkpoint-dir, "
                            "or start from exported weights with --init-from-hf")
    return found[-1] if found else None


def prunable(directory: Path, keep: int | None, older_than_days: float | None = None) -> list[CheckpointInfo]:
    """The one pruning rule (the trainer's keep_last and `fsdpkit ckpt prune`): complete
    checkpoints beyond the newest `keep` and, with `older_than_days`, older than that too. The
    newest complete checkpoint always stays, and nothing that is not a complete fsdpkit
    checkpoint is ever listed."""
    found = list_checkpoints(directory)
    kept = {c.path for c in found[-keep:]} if keep else set()
    kept |= {c.path for c in found[-1:]}
    cutoff = time.time() - older_than_days * 86400 if older_than_days is not None else None
    return [c for c in found if c.path not in kept and (cutoff is None or c.path.stat().st_mtime < cutoff)]


def _size(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def describe(path: Path) -> dict[str, Any] | None:
    """What a directory entry is as a checkpoint: fsdpkit (complete), incomplete, or reference."""
    if not path.is_dir():
        return None
    name = path.name
    if (m := NAME.match(name)) and (path / META).is_file():
        meta, problem = read_meta(path)
        if problem:
            return {"name": name, "path": str(path), "kind": "fsdpkit", "step": int(m.group(1)),
                    "complete": False, "damaged": True, "problem": problem, "bytes": _size(path)}
        return {"name": name, "path": str(path), "kind": "fsdpkit", "step": int(m.group(1)),
                "complete": True, "world_size": meta.get("world_size"), "loss": meta.get("loss"),
                "preset": meta.get("preset"), "samples": meta.get("samples"), "bytes": _size(path)}
    if (m := NAME.match(name) or TMP_NAME.match(name)):
        return {"name": name, "path": str(path), "kind": "fsdpkit", "step": int(m.group(1)),
                "complete": False, "bytes": _size(path)}
    if m := DAMAGED_NAME.match(name):
        return {"name": name, "path": str(path), "kind": "fsdpkit", "step": int(m.group(1)),
                "complete": False, "damaged": True, "bytes": _size(path)}
    if m := REFERENCE_NAME.match(name):
        return {"name": name, "path": str(path), "kind": "reference", "step": int(m.group("step")),
                "complete": (path / ".metadata").is_file(), "model_type": m.group("model"),
                "bytes": _size(path)}
    return None


def scan(directory: Path) -> list[dict[str, Any]]:
    """Every checkpoint-like entry in `directory`, by step."""
    if not directory.is_dir():
        raise NotFound(f"checkpoint directory not found: {directory}")
    found = [d for p in directory.iterdir() if (d := describe(p))]
    return sorted(found, key=lambda d: (d["step"], d["name"]))
