"""SageMaker HyperPod's managed tiered checkpointing: checkpoints written to the cluster's in-memory
store (replicated across nodes by HyperPod's own service) instead of shared storage, through the
DCP storage writer and reader of `amzn-sagemaker-checkpointing`.

Writing to node memory takes seconds where FSx takes minutes, so with `checkpoint.tiered` the
periodic saves and the save on SIGTERM go to memory, and the grace a stop needs shrinks to match
(fsdpkit.plan.grace). Shared storage stays the durable tier: the last step, and every
`durable_every`, go there as before. A resume takes the newer of the two tiers' newest checkpoints.

The package is optional: without it (or without the in-memory service, outside HyperPod) the
option is said in one line and every save goes to shared storage.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
from pathlib import Path
from typing import Any

import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from fsdpkit.train.checkpoint.catalog import CheckpointInfo
from fsdpkit.train.checkpoint.one_process import one_process
from fsdpkit.train.observe.log_lines import TIERED_OFF
from fsdpkit.train.runtime.dist import Runtime, broadcast_int

log = logging.getLogger(__name__)

SCHEME = "memory:"    # the tier's checkpoints are named memory:NAMESPACE/step-NNNNNNNN
META_KEY = "fsdpkit"  # the checkpoint's fsdpkit.json, carried in the DCP state (memory has no files)


def namespace_of(checkpoint_dir: Path) -> str:
    """The in-memory store's namespace of a run: stable across its restarts and resubmissions (it
    follows the checkpoint directory), readable (the job's directory name), unique (a hash of the
    path). The store allows letters, digits, '-' and '_'."""
    resolved = str(checkpoint_dir.resolve()) if checkpoint_dir.is_absolute() else str(checkpoint_dir.absolute())
    name = checkpoint_dir.parent.name if checkpoint_dir.name == "checkpoints" else checkpoint_dir.name
    slug = re.sub(r"[^A-Za-z0-9_-]+", "-", name).strip("-")[:40] or "fsdpkit"
    return f"{slug}-{hashlib.sha1(resolved.encode()).hexdigest()[:8]}"


class MemoryTier:
    """The run's checkpoints in HyperPod's in-memory store: DCP through the package's writer and
    reader, the fsdpkit metadata inside the state."""

    def __init__(self, namespace: str, rt: Runtime, writer: Any, reader: Any, config: Any):
        self.namespace, self.rt = namespace, rt
        self.writer_of, self.reader_of, self.config = writer, reader, config
        self.failing = False

    @classmethod
    def open(cls, checkpoint_dir: Path, rt: Runtime) -> MemoryTier | None:
        """The run's tier, or None, said in one line, where the package cannot be imported (not
        installed, or installed without what it needs)."""
        try:
            # Imported with the tier: the package is optional.
            from amzn_sagemaker_checkpointing.checkpointing.filesystem.filesystem import (
                SageMakerTieredStorageReader,
                SageMakerTieredStorageWriter,
            )
            from amzn_sagemaker_checkpointing.config.sagemaker_checkpoint_config import SageMakerCheckpointConfig
        except ImportError as e:
            log.warning(f"{TIERED_OFF}amzn-sagemaker-checkpointing cannot be imported here ({e}); every "
                        f"checkpoint goes to {checkpoint_dir} (build the image with `fsdpkit image init --tiered`)")
            return None
        namespace = namespace_of(checkpoint_dir)
        # The library says every shard it writes at INFO; its warnings and errors are enough here.
        quiet = logging.getLogger("sagemaker.checkpointing.fsdpkit")
        quiet.setLevel(logging.WARNING)
        config = SageMakerCheckpointConfig(namespace=namespace, world_size=rt.world_size, logger=quiet)
        return cls(namespace, rt, SageMakerTieredStorageWriter, SageMakerTieredStorageReader, config)

    def where(self, step: int) -> str:
        """Where a checkpoint of the tier is, as the run's lines name it (a Path too)."""
        return f"{SCHEME}{self.namespace}/step-{step:08d}"

    def save(self, step: int, state: dict[str, Any], record: dict[str, Any]) -> bool:
        """Write `state` as step `step`, with `record` (its fsdpkit.json); False (said once per
        outage) where the store did not take it, so the caller writes it to shared storage instead."""
        full = {**state, META_KEY: json.dumps(record)}
        try:
            with one_process():
                dcp.save(full, storage_writer=self.writer_of(checkpoint_config=self.config, step=step))
        except (Exception, CheckpointException) as e:  # DCP's own error is a BaseException
            self._unavailable(f"saving step {step}", e)
            return False
        self.failing = False
        return True

    def newest(self) -> int | None:
        """The newest complete step in the store (rank 0's answer on every rank), or None."""
        steps: list[int] = []
        if self.rt.is_main:
            try:
                reader = self.reader_of(checkpoint_config=self.config)
                steps = reader.client.get_latest_checkpoints(limit=1)
            except Exception as e:  # no store here: resume from shared storage
                self._unavailable("listing its checkpoints", e)
        step = broadcast_int(steps[0] if steps else -1, self.rt)
        return step if step >= 0 else None

    def load(self, step: int, state: dict[str, Any]) -> CheckpointInfo | None:
        """Load step `step` into `state` (in place); its CheckpointInfo, or None where the store
        could not give it back (said; the caller falls back to shared storage)."""
        full = {**state, META_KEY: ""}
        try:
            with one_process():
                dcp.load(full, storage_reader=self.reader_of(checkpoint_config=self.config, step=step))
        except (Exception, CheckpointException) as e:
            self._unavailable(f"reading step {step}", e)
            return None
        state.update({k: v for k, v in full.items() if k != META_KEY})
        meta = json.loads(full[META_KEY])
        return CheckpointInfo(Path(self.where(step)), int(meta["step"]), meta)

    def _unavailable(self, what: str, e: BaseException) -> None:
        if not self.failing:
            detail = str(e).strip().splitlines()[0][:200] if str(e).strip() else ""
            log.warning(f"{TIERED_OFF}the in-memory store ({self.namespace}) failed {what} "
                        f"({type(e).__name__}: {detail}); using shared storage")
        self.failing = True

