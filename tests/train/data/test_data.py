"""Data pipeline: per-rank disjointness, world-size invariance, packing, held-out split."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from fsdpkit.train.data import BatchStream, ByteTokenizer, EmbeddedCorpus

SEQ = 64


def stream(rank: int, world: int, batch: int, split: str = "train", seed: int = 5) -> BatchStream:
    return BatchStream(EmbeddedCorpus(split, seed), ByteTokenizer(), SEQ, batch, rank, world, seed,
                       shuffle_buffer=64)


def take(s: BatchStream, n: int) -> list:
    return [b.inputs for b in itertools.islice(iter(s), n)]


def rows(batches) -> list[bytes]:
    return [row.numpy().tobytes() for b in batches for row in b]


@pytest.mark.parametrize("world", [2, 3])
def test_every_rank_sees_different_samples_and_together_the_single_process_batch(world):
    steps, per_rank = 6, 4
    single = take(stream(0, 1, per_rank * world), steps)
    per_rank_batches = [take(stream(r, world, per_rank), steps) for r in range(world)]
    rank_rows = [rows(b) for b in per_rank_batches]
    # No sample is read by two ranks.
    for a, b in itertools.combinations(range(world), 2):
        assert not set(rank_rows[a]) & set(rank_rows[b]), f"ranks {a} and {b} share samples"
    # Step by step, the ranks' batches stacked are exactly the single process's global batch.
    for step in range(steps):
        stacked = np.concatenate([per_rank_batches[r][step].numpy() for r in range(world)])
        assert np.array_equal(stacked, single[step].numpy())


def test_targets_are_inputs_shifted_and_documents_end_with_eos():
    batch = next(iter(stream(0, 1, 8)))
    x, y = batch.inputs, batch.targets
    assert x.shape == y.shape == (8, SEQ)
    assert np.array_equal(x[:, 1:].numpy(), y[:, :-1].numpy())
    all_tokens = np.concatenate([x.numpy().ravel() for x in take(stream(0, 1, 8), 40)])
    assert (all_tokens == ByteTokenizer.eos_id).any()
    assert all_tokens.max() < ByteTokenizer.vocab_size


def test_order_depends_on_seed_but_not_on_run():
    a, b = take(stream(0, 1, 4, seed=1), 3), take(stream(0, 1, 4, seed=1), 3)
    c = take(stream(0, 1, 4, seed=2), 3)
    assert rows(a) == rows(b)
    assert rows(a) != rows(c)


def test_validation_files_are_held_out():
    train, val = EmbeddedCorpus("train", 0), EmbeddedCorpus("validation", 0)
    assert val.files and not set(train.files) & set(val.files)
    assert len(val.files) < 0.05 * len(train.files)


def test_finite_epochs_stop():
    s = BatchStream(EmbeddedCorpus("validation", 0), ByteTokenizer(), SEQ, 8, epochs=1, shuffle_buffer=0)
    assert 0 < sum(1 for _ in s) < 10_000


def test_byte_tokenizer_round_trip():
    tok = ByteTokenizer()
    text = "def f(x):\n    return 'héllo'  # ünïcode"
    assert tok.decode(tok.encode(text)) == text
