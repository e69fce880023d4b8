"""Sharded checkpoints with torch.distributed.checkpoint (DCP): save, verify, resume (which
checkpoints a directory holds is fsdpkit.train.checkpoint.catalog).

A checkpoint is written under a hidden temporary name and renamed to `step-NNNNNNNN` by rank 0
only after every rank has finished writing, so a directory with that name is always complete: a
crash mid-save leaves only a `.tmp` directory that resume ignores. DCP stores each rank's shards
and reshards on load, so a run can resume with a different number of processes.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import json
import logging
import os
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as tdist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.filesystem import FileSystemReader
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.tensor import DTensor

from fsdpkit.errors import UserError
from fsdpkit.train.checkpoint.catalog import (
    META,
    NAME,
    TMP_NAME,
    CheckpointInfo,
    list_checkpoints,
    prunable,
    read_meta,
    resolve,
)
from fsdpkit.train.checkpoint.one_process import one_process
from fsdpkit.train.checkpoint.tiered import MemoryTier
from fsdpkit.train.model.config import LoraShape, ModelConfig
from fsdpkit.train.runtime.dist import Runtime
from fsdpkit.train.runtime.faults import maybe_fail

log = logging.getLogger(__name__)

# A checkpoint holds what trains: the whole model, or with LoRA only the adapters (the frozen base
# comes from --init-from-hf again on resume, and an export reads it from there).
TRAINED = StateDictOptions(ignore_frozen_params=True)
TRAINED_LOAD = StateDictOptions(ignore_frozen_params=True, strict=False)


def trained_state(model: torch.nn.Module) -> dict[str, Any]:
    """The model's state dict without frozen parameters, a tied head's second name included (which
    ignore_frozen_params keeps: it only knows each parameter's first name)."""
    frozen = {n for n, p in model.named_parameters(remove_duplicate=False) if not p.requires_grad}
    return {k: v for k, v in get_model_state_dict(model, options=TRAINED).items() if k not in frozen}


def training_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """What a checkpoint holds, as DCP saves and loads it in place: the trained parameters and
    their optimizer state."""
    return {"model": trained_state(model), "optim": get_optimizer_state_dict(model, optimizer, options=TRAINED)}


def restore(model: torch.nn.Module, optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> None:
    """Put a loaded `training_state` back into the model and optimizer."""
    set_model_state_dict(model, state["model"], options=TRAINED_LOAD)
    set_optimizer_state_dict(model, optimizer, state["optim"], options=TRAINED_LOAD)


def describe_error(e: BaseException) -> str:
    """The first line of the underlying error of a DCP failure (which wraps one per rank)."""
    failures = getattr(e, "failures", None)
    if failures:
        e = next(iter(failures.values()))
        e = getattr(e, "exc", e)
        if isinstance(e, tuple):  # (exception, traceback frames)
            e = e[0]
    text = str(e).strip()
    return f"{type(e).__name__}: {text.splitlines()[0]}" if text else type(e).__name__


class SaveFailed(UserError):
    """A checkpoint could not be written: the disk, a quota or a permission, named with the path."""

    code = "failed"
    exit_code = 1


_OS_CAUSES = {errno.ENOSPC: "no space left on device", errno.EDQUOT: "disk quota exceeded",
              errno.EACCES: "permission denied", errno.EPERM: "permission denied",
              errno.EROFS: "read-only file system"}


def _errors(e: BaseException) -> list[BaseException]:
    """The error and what it wraps: DCP's per-rank failures, causes and contexts."""
    out: list[BaseException] = []
    todo: list[BaseException | None] = [e]
    while todo and len(out) < 50:
        err = todo.pop()
        if err is None or any(err is x for x in out):
            continue
        out.append(err)
        for failure in (getattr(err, "failures", None) or {}).values():
            failure = getattr(failure, "exc", failure)
            todo.append(failure[0] if isinstance(failure, tuple) else failure)
        todo += [err.__cause__, err.__context__]
    return [x for x in out if isinstance(x, BaseException)]


def _tensor_bytes(state: Any) -> int:
    """Bytes of the tensors this rank writes (a DTensor's local shard)."""
    if isinstance(state, dict):
        return sum(_tensor_bytes(v) for v in state.values())
    if isinstance(state, (list, tuple)):
        return sum(_tensor_bytes(v) for v in state)
    if isinstance(state, DTensor):
        state = state.to_local()
    return state.numel() * state.element_size() if isinstance(state, torch.Tensor) else 0


def save_failure(e: BaseException, directory: Path, needed: int) -> str:
    """Why a save failed, in words: an OS error's cause, or a disk with less room than this rank's
    share of the checkpoint (torch.save reports a full disk as a zip-writer error), else the error."""
    for err in _errors(e):
        if isinstance(err, OSError) and err.errno in _OS_CAUSES:
            return f"{_OS_CAUSES[err.errno]} ({err.filename or directory})"
    try:
        st = os.statvfs(directory)
    except OSError:
        return describe_error(e)
    free, total = st.f_bavail * st.f_frsize, st.f_blocks * st.f_frsize
    if free < needed:
        return (f"no space left on device ({directory}: {free / 2**20:,.1f} MiB free of {total / 2**20:,.1f} MiB; "
                f"this rank's share of the checkpoint is {needed / 2**20:,.1f} MiB)")
    return describe_error(e)


def _barrier(rt: Runtime) -> None:
    if rt.distributed:
        tdist.barrier()


class Checkpointer:
    """Writes checkpoints of one run, synchronously or in the background (`async_mode`).

    Async: `dcp.async_save` copies the state to CPU memory and returns; the write happens in a
    thread while training goes on. The checkpoint is completed (renamed) when the next save starts,
    at the end of training, or on SIGTERM, so the completion rule is the same in both modes. The
    background write coordinates over its own gloo group so it never interleaves with training
    collectives.
    """

    def __init__(self, directory: Path, rt: Runtime, keep_last: int = 0, async_mode: bool = False,
                 tier: MemoryTier | None = None):
        self.directory, self.rt, self.keep_last, self.async_mode = directory, rt, keep_last, async_mode
        self.tier = tier  # checkpoint.tiered: HyperPod's in-memory store before `directory`
        if rt.is_main and directory.is_dir():
            # Saves a killed attempt left half-written: nothing can complete them any more.
            for stale in directory.iterdir():
                if TMP_NAME.match(stale.name):
                    shutil.rmtree(stale, ignore_errors=True)
        _barrier(rt)
        self.group = tdist.new_group(backend="gloo") if async_mode and rt.distributed else None
        self._pending: tuple[Any, ...] | None = None
        self.blocked_s = 0.0  # time training waited on checkpointing (what async shortens)

    def save(self, step: int, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
             meta: dict[str, Any], durable: bool = True) -> Path:
        """Write step `step`; where it went. Not `durable`, with a memory tier: to the in-memory
        store, or to `directory` where the store does not take it."""
        start = time.perf_counter()
        tier = None if durable else self.tier
        if tier is not None and tier.save(step, training_state(model, optimizer), self._record(step, meta)):
            self.blocked_s += time.perf_counter() - start
            return Path(tier.where(step))
        self.wait()
        final = self.directory / f"step-{step:08d}"
        tmp = self.directory / f".step-{step:08d}.tmp"
        if self.rt.is_main:
            self.directory.mkdir(parents=True, exist_ok=True)
            shutil.rmtree(tmp, ignore_errors=True)  # left by a crash during an earlier save
        _barrier(self.rt)
        state = training_state(model, optimizer)
        needed = _tensor_bytes(state)
        with self._failing_as(step, needed), one_process():
            if self.async_mode:
                future = dcp.async_save(state, checkpoint_id=str(tmp), process_group=self.group)
                self._pending = (future, step, tmp, final, meta, needed)
            else:
                dcp.save(state, checkpoint_id=str(tmp))
                self._complete(step, tmp, final, meta)
        self.blocked_s += time.perf_counter() - start
        return final

    @contextlib.contextmanager
    def _failing_as(self, step: int, needed: int) -> Iterator[None]:
        """A save that fails says why in one line, with the path. Its hidden .tmp directory stays
        (resume never reads it; the next run's first save clears it)."""
        try:
            yield
        except UserError:
            raise
        except (Exception, CheckpointException) as e:  # DCP's own error is a BaseException
            raise SaveFailed(f"checkpoint: saving step {step} to {self.directory} failed: "
                             f"{save_failure(e, self.directory, needed)}; free space there or point "
                             "--checkpoint-dir at a larger file system, then resume with --resume-from-checkpoint "
                             "auto") from None

    def wait(self) -> None:
        """Finish a background save, if one is running, and make it visible."""
        if self._pending is None:
            return
        future, step, tmp, final, meta, needed = self._pending
        self._pending = None
        with self._failing_as(step, needed):
            future.result()
            self._complete(step, tmp, final, meta)

    def _record(self, step: int, meta: dict[str, Any]) -> dict[str, Any]:
        """A checkpoint's fsdpkit.json, in either tier."""
        return {"step": step, "world_size": self.rt.world_size, "data_ranks": self.rt.data_ranks, **meta}

    def _complete(self, step: int, tmp: Path, final: Path, meta: dict[str, Any]) -> None:
        maybe_fail("save", step, self.rt.rank)
        _barrier(self.rt)
        if self.rt.is_main:
            (tmp / META).write_text(json.dumps(self._record(step, meta), indent=2))
            if final.exists():
                shutil.rmtree(final)
            tmp.rename(final)  # the completion marker: atomic on one file system
            prune(self.directory, self.keep_last, self.rt)
        _barrier(self.rt)


def verify(path: Path) -> str | None:
    """What is wrong with a checkpoint that carries the complete name, or None. Reads only
    metadata and file sizes: DCP's index must load, every file it indexes (one or more per rank)
    must be there and long enough for every entry, and fsdpkit.json must name the same step."""
    step = int(m.group(1)) if (m := NAME.match(path.name)) else None
    meta, problem = read_meta(path)
    if problem:
        return problem
    if meta.get("step") != step:
        return f"{META} names step {meta.get('step')}, the directory step {step}"
    try:
        index = FileSystemReader(str(path)).read_metadata()
    except Exception as e:  # a missing or truncated pickle: any of several errors
        return f"its index (.metadata) cannot be read ({type(e).__name__})"
    needed: dict[str, int] = {}
    for item in (index.storage_data or {}).values():
        needed[item.relative_path] = max(needed.get(item.relative_path, 0), item.offset + item.length)
    for name, size in sorted(needed.items()):
        f = path / name
        if not f.is_file():
            return f"{name} is missing"
        if (have := f.stat().st_size) < size:
            return f"{name} is truncated ({have} of {size} bytes)"
    return None


def set_aside(path: Path, rt: Runtime) -> Path:
    """Rename a damaged checkpoint out of resume's way (rank 0; every rank gets the new name)."""
    n, target = 0, path.with_name(f"{path.name}.damaged")
    while target.exists():
        n += 1
        target = path.with_name(f"{path.name}.damaged.{n}")
    _barrier(rt)  # every rank has finished looking at it
    if rt.is_main:
        path.rename(target)
    _barrier(rt)
    return target


class DamagedCheckpoint(UserError):
    def __init__(self, path: Path, reason: str):
        super().__init__(f"resume_from_checkpoint: {path} is damaged and cannot be read ({reason})")
        self.reason = reason


def check_resumable(spec: str, model_shape: dict[str, Any]) -> CheckpointInfo | None:
    """What resuming from `spec` starts with, checked from metadata alone: None (nothing to resume),
    or the newest checkpoint, of this model's shape. A checkpoint named directly must also be whole;
    in a checkpoint root a damaged one is set aside at load instead (`resume`)."""
    newest = resolve(spec)  # a one-line error for an incomplete or foreign checkpoint named directly
    if newest is None:
        return None
    check_shape(newest, model_shape)
    if newest.path == Path(spec) and (problem := verify(newest.path)):
        raise DamagedCheckpoint(newest.path, problem)
    return newest


def resume(spec: str, model: torch.nn.Module, optimizer: torch.optim.Optimizer, model_shape: dict[str, Any],
           rt: Runtime, tier: MemoryTier | None = None) -> CheckpointInfo | None:
    """Load the newest checkpoint that is whole: from the memory tier where its newest is newer
    than shared storage's, else from `spec`. Given a checkpoint root, a damaged newest one is
    reported, set aside and the next older one tried; a checkpoint named directly must load."""
    newest = check_resumable(spec, model_shape)
    if tier is not None and (found := _resume_from_memory(tier, newest, model, optimizer, model_shape)):
        return found
    if newest is None:
        return None
    if newest.path == Path(spec):
        load(newest, model, optimizer, model_shape)
        return newest
    for info in reversed(list_checkpoints(Path(spec), damaged=True)):
        problem = verify(info.path)
        if problem is None:
            try:
                load(info, model, optimizer, model_shape)
                return info
            except DamagedCheckpoint as e:
                problem = e.reason
        moved = set_aside(info.path, rt)
        log.warning(f"checkpoint {info.path} is damaged ({problem}); set aside as {moved.name}, "
                    "trying the next older one")
    return None


def _resume_from_memory(tier: MemoryTier, durable: CheckpointInfo | None, model: torch.nn.Module,
                        optimizer: torch.optim.Optimizer, model_shape: dict[str, Any]) -> CheckpointInfo | None:
    """The memory tier's newest checkpoint, loaded, where it is newer than shared storage's."""
    step = tier.newest()
    if step is None or (durable is not None and durable.step >= step):
        return None
    state = training_state(model, optimizer)
    info = tier.load(step, state)
    if info is None:
        return None
    check_shape(info, model_shape)
    restore(model, optimizer, state)
    return info


# Fields a checkpoint written before they existed does not record: it has their defaults.
_SHAPE_DEFAULTS = {f.name: f.default for f in dataclasses.fields(ModelConfig) if f.default is not dataclasses.MISSING}
_LORA_DEFAULTS = {f.name: f.default for f in dataclasses.fields(LoraShape) if f.default is not dataclasses.MISSING}


def check_shape(info: CheckpointInfo, model_shape: dict[str, Any]) -> None:
    """The checkpoint holds a model of this shape (read from its fsdpkit.json alone)."""
    theirs = {**_SHAPE_DEFAULTS, **(info.meta.get("model") or {})}
    if theirs.get("lora"):
        theirs["lora"] = {**_LORA_DEFAULTS, **theirs["lora"]}
    # Which embedding row is frozen does not change what the tensors are: a checkpoint of before it
    # was recorded resumes, its padding row frozen from then on.
    theirs["pad_token_id"] = model_shape.get("pad_token_id")
    if theirs == model_shape:
        return
    where = f"resume_from_checkpoint: {info.path}"
    lora, ours = theirs.get("lora"), model_shape.get("lora")
    if lora and not ours:
        raise UserError(f"{where} holds LoRA adapters (rank {lora.get('rank')}), and this run trains the whole model; "
                        "resume it with --lora 1 and the same adapter settings, or export it (adapters merged) and "
                        "start from that with --init-from-hf and another --checkpoint-dir")
    if ours and not lora:
        raise UserError(f"{where} holds a whole model, and this run trains LoRA adapters; export it and start from "
                        "that with --init-from-hf and another --checkpoint-dir, or resume it without --lora")
    flat = [(f"lora_{k}", (lora or {}).get(k), v) for k, v in (ours or {}).items()]
    flat += [(k, theirs.get(k), v) for k, v in model_shape.items() if k != "lora"]
    diff = ", ".join(f"{k} {_shown(a)} (this run: {_shown(b)})" for k, a, b in flat if a != b)
    raise UserError(f"{where} holds a model of another shape: {diff}; resume with the same model settings, or point "
                    "--checkpoint-dir elsewhere")


def _shown(value: Any) -> str:
    """A shape value as a flag takes it: a list comma-separated."""
    return ",".join(map(str, value)) if isinstance(value, list) else str(value)


def load(info: CheckpointInfo, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
         model_shape: dict[str, Any]) -> None:
    check_shape(info, model_shape)
    state = training_state(model, optimizer)
    try:
        with one_process():
            dcp.load(state, checkpoint_id=str(info.path))
    except (Exception, CheckpointException) as e:  # DCP's own error is a BaseException
        raise DamagedCheckpoint(info.path, describe_error(e)) from None
    restore(model, optimizer, state)


def prune(directory: Path, keep: int, rt: Runtime) -> None:
    """keep_last: 0 keeps every checkpoint."""
    if keep <= 0 or not rt.is_main:
        return
    for old in prunable(directory, keep):
        shutil.rmtree(old.path, ignore_errors=True)


