"""`fsdpkit data prepare`: tokenise a dataset once into memory-mappable token shards.

Output: DIR/meta.json and DIR/{split}-NNNNN.bin (uint16 when the vocabulary fits, else uint32),
documents separated by the tokenizer's EOS. Written under DIR.tmp and renamed when complete.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from fsdpkit.errors import UserError
from fsdpkit.train.data.chat import Conversation
from fsdpkit.train.data.preference import Preference
from fsdpkit.train.data.sources import DocumentSource
from fsdpkit.train.data.tokenizers import Tokenizer
from fsdpkit.train.token_meta import TOKENS_FORMAT

SHARD_TOKENS = 100_000_000  # 200 MB of uint16 per shard


def prepare(sources: dict[str, DocumentSource], tokenizer: Tokenizer, out: Path,
            shard_tokens: int = SHARD_TOKENS, progress: Callable[[int], None] | None = None) -> dict[str, Any]:
    if out.exists() and any(out.iterdir()):
        raise UserError(f"data prepare: {out} exists and is not empty; choose a new directory")
    dtype = np.uint16 if tokenizer.vocab_size <= 2**16 else np.uint32
    tmp = out.with_name(f".{out.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        return _write(tokenizer, sources, out, tmp, dtype, shard_tokens, progress)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)  # a failed or interrupted prepare leaves nothing behind
        raise


def _write(tokenizer: Tokenizer, sources: dict[str, DocumentSource], out: Path, tmp: Path, dtype: type,
           shard_tokens: int, progress: Callable[[int], None] | None) -> dict[str, Any]:
    splits: dict[str, list[str]] = {}
    counts: dict[str, int] = {}
    for split, source in sources.items():
        files: list[str] = []
        buf: list[np.ndarray] = []
        total = 0
        pending = 0

        def flush(split: str = split, files: list[str] = files) -> None:
            nonlocal buf, pending
            if not buf:
                return
            name = f"{split}-{len(files):05d}.bin"
            np.concatenate(buf).astype(dtype).tofile(tmp / name)
            files.append(name)
            buf, pending = [], 0

        for doc in source.documents(0):
            assert not isinstance(doc, (Conversation, Preference))  # a text source (prepare reads no records)
            ids = np.append(tokenizer.encode(doc).astype(np.int64), tokenizer.eos_id)
            buf.append(ids)
            pending += len(ids)
            total += len(ids)
            if progress:
                progress(len(ids))
            if pending >= shard_tokens:
                flush()
        flush()
        if files:
            splits[split], counts[split] = files, total
    if "train" not in splits:
        raise UserError("data prepare: the dataset produced no training tokens")
    # A tokenizer directory by its absolute path: training reads the shards' tokenizer from here,
    # whatever directory it runs in.
    name = str(Path(tokenizer.name).resolve()) if Path(tokenizer.name).is_dir() else tokenizer.name
    meta = {"format": TOKENS_FORMAT, "dtype": np.dtype(dtype).name, "tokenizer": name,
            "vocab_size": tokenizer.vocab_size, "eos_id": tokenizer.eos_id, "splits": splits, "tokens": counts}
    (tmp / "meta.json").write_text(json.dumps(meta, indent=2) + "\n")
    if out.exists():
        out.rmdir()
    tmp.rename(out)
    return meta
