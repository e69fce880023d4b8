"""Training data: document sources, tokenizers, packing and per-rank batches.

The pipeline is source -> tokenizer -> packed blocks of seq_len+1 tokens -> seeded shuffle ->
per-rank batches. Everything up to the shuffle is the same on every rank and independent of the
world size, so block k of the global stream is the same sample whether 1 or N processes train;
rank r takes the blocks of global batch slot r. Hence (a) every rank reads different samples,
(b) N ranks with batch B see exactly what 1 process with batch N*B sees, and (c) a position in
the stream is one integer, which is what resumable data state needs.

Sources implement `DocumentSource`; the embedded one is the Python standard library's own source
files, present wherever Python is, so the default run needs no network.
"""

from __future__ import annotations

import sysconfig
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import numpy as np
import torch

from fsdpkit.errors import UserError


class Tokenizer(Protocol):
    name: str
    vocab_size: int
    eos_id: int

    def encode(self, text: str | bytes) -> np.ndarray: ...

    def decode(self, ids: list[int] | np.ndarray) -> str: ...


class ByteTokenizer:
    """UTF-8 bytes as tokens 0..255, plus BOS (256) and EOS (257): needs no vocabulary file."""

    name = "bytes"
    vocab_size = 258
    bos_id = 256
    eos_id = 257

    def encode(self, text: str | bytes) -> np.ndarray:
        raw = text.encode("utf-8") if isinstance(text, str) else text
        return np.frombuffer(raw, dtype=np.uint8).astype(np.uint16)

    def decode(self, ids: list[int] | np.ndarray) -> str:
        return bytes(int(i) for i in ids if int(i) < 256).decode("utf-8", errors="replace")


class DocumentSource(Protocol):
    """A split of a dataset as a sequence of documents, in a seeded order per epoch."""

    name: str

    def documents(self, epoch: int) -> Iterator[str | bytes]: ...


class EmbeddedCorpus:
    """The Python standard library's `.py` files; one in 50 (by path hash) is held out for validation."""

    name = "embedded"

    def __init__(self, split: str, seed: int, root: Path | None = None):
        self.root = Path(root or sysconfig.get_paths()["stdlib"])
        self.split, self.seed = split, seed
        files = sorted(
            p.relative_to(self.root).as_posix()
            for p in self.root.rglob("*.py")
            if "site-packages" not in p.parts and "dist-packages" not in p.parts
        )
        held_out = [f for f in files if zlib.crc32(f.encode()) % 50 == 0]
        self.files = held_out if split != "train" else sorted(set(files) - set(held_out))
        if not self.files:
            raise UserError(f"dataset: the embedded corpus found no Python source files under {self.root}")

    def documents(self, epoch: int) -> Iterator[bytes]:
        order = list(self.files)
        if self.split == "train":
            np.random.default_rng([self.seed, epoch]).shuffle(order)
        for rel in order:
            try:
                yield (self.root / rel).read_bytes()
            except OSError:
                continue  # a file removed or unreadable since listing: skip, never stop training


def get_tokenizer(name: str) -> Tokenizer:
    if name == "bytes":
        return ByteTokenizer()
    raise UserError(f"tokenizer: {name!r} is not available; this version ships the embedded 'bytes' tokenizer")


def get_source(dataset: str, split: str, seed: int) -> DocumentSource:
    if dataset == "embedded":
        return EmbeddedCorpus("train" if split == "train" else "validation", seed)
    raise UserError(f"dataset: {dataset!r} is not available; this version ships the 'embedded' dataset")


@dataclass
class BatchStream:
    """Packed (inputs, targets) batches of one rank, each (batch_size, seq_len) int64."""

    source: DocumentSource
    tokenizer: Tokenizer
    seq_len: int
    batch_size: int
    rank: int = 0
    world_size: int = 1
    seed: int = 0
    shuffle_buffer: int = 512  # blocks; 0 keeps the stream order (validation)
    epochs: int | None = None  # None: repeat the source forever
    skip_blocks: int = 0  # global blocks already consumed (resume): the stream continues after them

    def __post_init__(self) -> None:
        self.last_indices: list[int] = []  # global block indices of the last batch yielded

    def blocks(self) -> Iterator[np.ndarray]:
        """The global stream of seq_len+1-token blocks, documents separated by EOS."""
        n = self.seq_len + 1
        epoch = 0
        while self.epochs is None or epoch < self.epochs:
            buf = np.empty(0, dtype=np.int64)
            produced = 0
            for doc in self.source.documents(epoch):
                ids = self.tokenizer.encode(doc)
                buf = np.concatenate([buf, ids.astype(np.int64), [self.tokenizer.eos_id]])
                full = len(buf) // n
                if full:
                    yield from buf[: full * n].reshape(full, n)
                    buf = buf[full * n :]
                    produced += full
            if produced == 0:
                raise UserError(f"dataset: {self.source.name} holds fewer than {n} tokens; lower seq_len")
            epoch += 1

    def shuffled(self) -> Iterator[np.ndarray]:
        if self.shuffle_buffer <= 0:
            yield from self.blocks()
            return
        rng = np.random.default_rng(self.seed)
        pool: list[np.ndarray] = []
        for block in self.blocks():
            if len(pool) < self.shuffle_buffer:
                pool.append(block)
                continue
            i = int(rng.integers(len(pool)))
            out, pool[i] = pool[i], block
            yield out
        rng.shuffle(pool)
        yield from pool

    def rank_blocks(self) -> Iterator[tuple[int, np.ndarray]]:
        """This rank's (global index, block): slot `rank` of every group of world x batch blocks."""
        for k, block in enumerate(self.shuffled()):
            if k < self.skip_blocks:
                continue
            if ((k - self.skip_blocks) // self.batch_size) % self.world_size == self.rank:
                yield k, block

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        batch: list[np.ndarray] = []
        indices: list[int] = []
        for k, block in self.rank_blocks():
            batch.append(block)
            indices.append(k)
            if len(batch) == self.batch_size:
                t = torch.from_numpy(np.stack(batch))
                self.last_indices = indices
                yield t[:, :-1].contiguous(), t[:, 1:].contiguous()
                batch, indices = [], []
