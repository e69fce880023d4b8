"""Packing, shuffling and per-rank batches, plus a background prefetcher.

The pipeline is source -> tokenizer -> packed blocks of seq_len+1 tokens -> seeded shuffle ->
per-rank batches. Everything up to the shuffle is the same on every rank and independent of the
world size, so block k of the global stream is the same sample whether 1 or N processes train;
rank r takes the blocks of global batch slot r. Hence (a) every rank reads different samples,
(b) N ranks with batch B see exactly what 1 process with batch N*B sees, and (c) a position in
the stream is one integer (blocks consumed), which is the data state a checkpoint keeps.

Chat data packs the same way, each block carrying beside its tokens the loss mask (assistant
tokens) and the conversation each token belongs to, so a batch brings its targets (-100 where
no loss is taken) and the document ids attention is masked by.

Document sources are tokenised by every rank (cheap for the embedded corpus, and what makes the
order world-size invariant); token shards are read by random access, each rank only its blocks.

Epochs are exact: the shuffle buffer is emptied at each epoch's end, so no block of one epoch is
drawn in another (a fine-tuning set smaller than the buffer is one seeded permutation an epoch). A
chat epoch's last tokens are padded into a block of their own, and a finite chat pass's last group
of blocks is filled with empty ones (no loss), so every conversation trains once an epoch; a
chat block's document numbers carry their epoch, and each batch names the records its rows hold.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import queue
import threading
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np
import torch

from fsdpkit.errors import UserError
from fsdpkit.train.data.chat import encode_conversation
from fsdpkit.train.data.chat_template import ChatTemplate
from fsdpkit.train.data.preference import Pair, Preference, encode_pair, pack_pairs
from fsdpkit.train.data.sources import DocumentSource, TokenShards
from fsdpkit.train.data.tokenizers import Tokenizer

IGNORE = -100  # a target no loss is taken on (cross-entropy's ignore_index)
PAD_DOC = 0    # a chat block's padding: no conversation, no loss (conversations count from 1)
EPOCH_SHIFT = 32   # a chat block's document number: epoch << EPOCH_SHIFT | the conversation's number in it
_EPOCH_END = np.empty(0, dtype=np.int64)   # `blocks(epoch_ends=True)` yields it after each epoch


class Batch(NamedTuple):
    inputs: torch.Tensor  # (batch, seq_len) int64
    targets: torch.Tensor  # inputs shifted by one; IGNORE where no loss is taken
    indices: list[int]  # global block index of each row (for auditing data order)
    docs: torch.Tensor | None = None  # (batch, seq_len) document of each input token (chat data)
    # Chat data: each row's conversations as [epoch, number in the epoch's reading order, tokens of it
    # in the row], for the sample log (--log-samples)
    records: list[list[list[int]]] | None = None


def row_records(docs: np.ndarray) -> list[list[int]]:
    """A chat block's conversations (its document-number row, padding left out), see Batch.records."""
    numbers, counts = np.unique(docs[docs != PAD_DOC], return_counts=True)
    low = (1 << EPOCH_SHIFT) - 1
    return [[int(d) >> EPOCH_SHIFT, int(d) & low, int(c)] for d, c in zip(numbers, counts, strict=True)]


@dataclass
class BatchStream:
    """One rank's packed batches."""

    source: DocumentSource | TokenShards
    tokenizer: Tokenizer | None
    seq_len: int
    batch_size: int
    rank: int = 0
    world_size: int = 1
    seed: int = 0
    shuffle_buffer: int = 512  # blocks; 0 keeps the stream order (validation)
    epochs: int | None = None  # None: repeat the source forever
    skip_blocks: int = 0  # global blocks already consumed (resume): the stream continues after them
    chat: ChatTemplate | None = None  # chat data: conversations rendered with this template
    preference: bool = False  # preference data: pairs packed whole into rows (see data.preference)

    def _rows(self, doc: Any, number: int) -> np.ndarray:
        """One document as the rows of a block: its tokens and EOS (text), or (chat) three rows:
        tokens, loss mask, and the document's number (its epoch's, see EPOCH_SHIFT)."""
        tokenizer = self.tokenizer
        assert tokenizer is not None
        if self.chat is None:
            return np.append(tokenizer.encode(doc).astype(np.int64), tokenizer.eos_id)
        ids, mask = encode_conversation(self.chat, tokenizer.encode, doc)
        return np.stack([ids, mask.astype(np.int64), np.full(len(ids), number, dtype=np.int64)])

    def _pair_rows(self, epoch: int) -> Iterator[np.ndarray]:
        """Preference data: each record's pair tokenised, packed whole into (3, seq_len+1) rows."""
        tokenizer = self.tokenizer
        assert tokenizer is not None and not isinstance(self.source, TokenShards)
        n = self.seq_len + 1

        def too_long(pair: Pair, row: int) -> None:
            raise UserError(f"dataset: {pair.where}: its prompt and two answers take {pair.tokens} tokens, more than "
                            f"a row of {row} (seq_len + 1); raise --seq-len, or leave such records out")

        pairs = (encode_pair(p, tokenizer.encode, self.chat, tokenizer.eos_id) for p in self.source.documents(epoch)
                 if isinstance(p, Preference))
        yield from pack_pairs(pairs, n, tokenizer.eos_id, too_long)

    def _pair_blocks(self, allow_empty: bool, epoch_ends: bool) -> Iterator[np.ndarray]:
        """`blocks` of preference data, epoch after epoch; an epoch with no pair is an error, as in `blocks`."""
        epoch = 0
        while self.epochs is None or epoch < self.epochs:
            produced = False
            for row in self._pair_rows(epoch):
                produced = True
                yield row
            if not produced:
                if allow_empty:
                    return
                split = getattr(self.source, "split", None)
                bad, same = getattr(self.source, "bad_records", 0), getattr(self.source, "same_answers", 0)
                said = f", {same} of them pairs whose chosen and rejected answers are the same" if same else ""
                raise UserError(f"dataset: {self.source.name} has no preference records"
                                + (f" in its {split!r} split" if split else "")
                                + (f" ({bad} bad records skipped{said})" if bad else ""))
            epoch += 1
            if epoch_ends:
                yield _EPOCH_END

    def _pad_block(self, tail: np.ndarray | None = None) -> np.ndarray:
        """A chat block of `tail`'s tokens (none: an empty block), padded with EOS that takes no loss."""
        assert self.tokenizer is not None
        n = self.seq_len + 1
        tail = np.empty((3, 0), dtype=np.int64) if tail is None else tail
        pad = np.array([[self.tokenizer.eos_id], [0], [PAD_DOC]], dtype=np.int64).repeat(n - tail.shape[1], axis=1)
        return np.concatenate([tail, pad], axis=1)

    def blocks(self, allow_empty: bool = False, epoch_ends: bool = False) -> Iterator[np.ndarray]:
        """The global stream of seq_len+1-token blocks of a document source, documents separated by
        EOS (chat data: (3, seq_len+1) blocks, see `_rows`, an epoch's last tokens padded into a
        block of their own; preference data: whole pairs a row, see `_pair_rows`). A pass that
        yields no block is an error naming its cause, unless `allow_empty` (counting). With
        `epoch_ends`, _EPOCH_END follows each epoch's blocks (the shuffle empties its buffer there)."""
        source = self.source
        assert not isinstance(source, TokenShards)  # token shards are read by index
        if self.preference:
            yield from self._pair_blocks(allow_empty, epoch_ends)
            return
        n = self.seq_len + 1
        epoch = 0
        while self.epochs is None or epoch < self.epochs:
            buf = np.empty((0,) if self.chat is None else (3, 0), dtype=np.int64)
            produced, documents = False, 0
            for doc in source.documents(epoch):
                documents += 1
                buf = np.concatenate([buf, self._rows(doc, epoch << EPOCH_SHIFT | documents)], axis=-1)
                full = buf.shape[-1] // n
                if full:
                    if self.chat is None:
                        yield from buf[: full * n].reshape(full, n)
                    else:
                        yield from buf[:, : full * n].reshape(3, full, n).transpose(1, 0, 2)
                    buf = buf[..., full * n :]
                    produced = True
            if self.chat is not None and buf.shape[-1]:   # the epoch's last conversations train too
                yield self._pad_block(buf)
                produced = True
            if not produced:
                if allow_empty:
                    return
                split = getattr(source, "split", None)
                bad = getattr(source, "bad_records", 0)
                if documents == 0:
                    raise UserError(f"dataset: {source.name} has no documents"
                                    + (f" in its {split!r} split" if split else "")
                                    + (f" ({bad} bad records skipped)" if bad else ""))
                raise UserError(f"dataset: {source.name} holds fewer than {n} tokens ({documents} "
                                f"document(s), {buf.shape[-1]} tokens); lower seq_len")
            epoch += 1
            if epoch_ends:
                yield _EPOCH_END

    def shuffled(self) -> Iterator[np.ndarray]:
        """The blocks in a seeded order through a buffer of `shuffle_buffer`, emptied at each
        epoch's end: an epoch's blocks are never drawn in another."""
        if self.shuffle_buffer <= 0:
            yield from self.blocks()
            return
        rng = np.random.default_rng(self.seed)
        pool: list[np.ndarray] = []
        for block in self.blocks(epoch_ends=True):
            if block is _EPOCH_END:
                rng.shuffle(pool)
                yield from pool
                pool = []
            elif len(pool) < self.shuffle_buffer:
                pool.append(block)
            else:
                i = int(rng.integers(len(pool)))
                out, pool[i] = pool[i], block
                yield out
        rng.shuffle(pool)
        yield from pool

    def _indexed(self) -> Iterator[Callable[[], np.ndarray]]:
        """Token shards: a seeded permutation of all blocks per epoch, each block read on demand."""
        source = self.source
        assert isinstance(source, TokenShards)
        n = self.seq_len + 1
        total = source.num_blocks(n)
        if total == 0:
            raise UserError(f"dataset: {source.name} holds fewer than {n} tokens; lower seq_len")
        epoch = 0
        while self.epochs is None or epoch < self.epochs:
            order = (np.random.default_rng([self.seed, epoch]).permutation(total)
                     if self.shuffle_buffer > 0 else np.arange(total))
            for i in order:
                yield functools.partial(source.block, int(i), n)
            epoch += 1

    def _global(self) -> Iterator[np.ndarray | Callable[[], np.ndarray]]:
        return self._indexed() if isinstance(self.source, TokenShards) else self.shuffled()

    def check_not_empty(self) -> None:
        """The one-line error of a source that holds no whole block, raised before any work (the
        first block is read, nothing more)."""
        next(self._indexed() if isinstance(self.source, TokenShards) else self.blocks(), None)

    def count_blocks(self) -> int:
        """Blocks in one pass over the source (the validation split's size)."""
        if isinstance(self.source, TokenShards):
            return self.source.num_blocks(self.seq_len + 1)
        return sum(1 for _ in dataclasses.replace(self, epochs=1).blocks(allow_empty=True))

    def rank_blocks(self) -> Iterator[tuple[int, np.ndarray]]:
        """This rank's (global index, block): slot `rank` of every group of world x batch blocks.

        Only whole groups are handed out, so when a finite pass ends every rank has had the same
        number of batches (an extra batch on one rank would hang the others in a collective). Text
        drops a last short group; chat fills it with empty blocks (no loss), so its last
        conversations train too.
        """
        group_size = self.world_size * self.batch_size
        mine = range(self.rank * self.batch_size, (self.rank + 1) * self.batch_size)
        group: list[Any] = []
        for k, item in enumerate(self._fill_last_group(self._global(), group_size)):
            if k < self.skip_blocks:
                continue
            group.append(item)
            if len(group) == group_size:
                base = k + 1 - group_size
                for j in mine:
                    item = group[j]
                    yield base + j, (item() if callable(item) else item)
                group = []

    def _fill_last_group(self, items: Iterator[Any], group_size: int) -> Iterator[Any]:
        """`items`, then (chat data) empty blocks up to a whole group."""
        count = 0
        for item in items:
            count += 1
            yield item
        if self.chat is not None and not self.preference and count % group_size:
            for _ in range(group_size - count % group_size):
                yield self._pad_block()

    def __iter__(self) -> Iterator[Batch]:
        rows: list[np.ndarray] = []
        indices: list[int] = []
        for k, block in self.rank_blocks():
            rows.append(block)
            indices.append(k)
            if len(rows) == self.batch_size:
                t = torch.from_numpy(np.stack(rows).astype(np.int64))
                if t.ndim == 2:
                    yield Batch(t[:, :-1].contiguous(), t[:, 1:].contiguous(), indices)
                else:   # chat, preference: the loss on answer tokens only, attention within each sequence
                    tokens, mask, docs = t[:, 0], t[:, 1].bool(), t[:, 2]
                    # A token is a target only where it continues its own sequence: the first token of
                    # the next one is not predicted from this one's last.
                    kept = mask[:, 1:] & (docs[:, 1:] == docs[:, :-1])
                    targets = torch.where(kept, tokens[:, 1:], IGNORE)
                    records = None if self.preference else [row_records(row[2]) for row in rows]
                    yield Batch(tokens[:, :-1].contiguous(), targets, indices, docs[:, :-1].contiguous(), records)
                rows, indices = [], []


_DONE = object()


class Prefetcher:
    """Runs an iterator in a background thread, `depth` items ahead, so the step never waits on data.

    Tokenizers (Rust) and numpy release the GIL for most of their work. An exception in the
    producer is raised in the consumer, at the item where it happened.
    """

    def __init__(self, items: Iterable[Any], depth: int = 4, pin_memory: bool = False):
        # Pinned (page-locked) batches let the copy to the GPU run asynchronously (non_blocking);
        # pinning here keeps its cost off the training thread.
        self._pin = pin_memory
        self._queue: queue.Queue[Any] = queue.Queue(maxsize=max(1, depth))
        self._stop = threading.Event()
        self._done = False   # the producer's end was handed over: every later next() stops too
        self._thread = threading.Thread(target=self._run, args=(iter(items),), daemon=True, name="fsdpkit-data")
        self._thread.start()

    def _run(self, it: Iterator[Any]) -> None:
        try:
            for item in it:
                if self._pin:
                    item = item._replace(**{f: t.pin_memory() for f in ("inputs", "targets", "docs")
                                            if (t := getattr(item, f)) is not None})
                while not self._stop.is_set():
                    try:
                        self._queue.put(item, timeout=0.1)
                        break
                    except queue.Full:
                        continue
                if self._stop.is_set():
                    return
            self._queue.put(_DONE)
        except BaseException as e:  # handed to the consumer, which raises it
            self._queue.put(e)

    def __iter__(self) -> Prefetcher:
        return self

    def __next__(self) -> Any:
        if self._done:
            raise StopIteration
        item = self._queue.get()
        if item is _DONE:
            self._done = True
            raise StopIteration
        if isinstance(item, BaseException):
            self._done = True   # the producer stopped there
            raise item
        return item

    def close(self) -> None:
        """Stop the producer and wait for it, so no thread is inside torch or numpy at exit."""
        self._stop.set()
        while self._thread.is_alive():
            with contextlib.suppress(queue.Empty):
                self._queue.get(timeout=0.05)  # unblock a producer waiting to put
            self._thread.join(timeout=0.05)
