"""The batch stream, block by block: what each block holds, the order a seed gives, where a resumed
stream starts, the indexed path over token shards, and the prefetcher's hand-off."""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterator

import numpy as np
import pytest
import torch

from fsdpkit.errors import UserError
from fsdpkit.train.data import BatchStream, ByteTokenizer, TokenShards
from fsdpkit.train.data.chat import Conversation, encode_conversation
from fsdpkit.train.data.chat_template import CHATML, ChatTemplate
from fsdpkit.train.data.prepare import prepare
from fsdpkit.train.data.stream import IGNORE, PAD_DOC, Prefetcher

EOS = ByteTokenizer.eos_id


class Bare:
    """A source with a name and documents, and nothing else a source may have."""

    name = "bare"

    def documents(self, epoch: int) -> Iterator:
        return iter(())


class Docs:
    """A document source holding the given documents, the same in every epoch."""

    def __init__(self, docs, name: str = "docs", split: str | None = None, bad_records: int = 0):
        self.docs, self.name, self.split, self.bad_records = list(docs), name, split, bad_records

    def documents(self, epoch: int) -> Iterator:
        yield from self.docs


def text_stream(docs, seq_len: int, batch: int = 1, **kw) -> BatchStream:
    return BatchStream(Docs(docs), ByteTokenizer(), seq_len, batch, **kw)


def as_lists(blocks) -> list[list[int]]:
    return [b.tolist() for b in blocks]


def test_text_blocks_are_the_documents_bytes_with_eos_after_each_cut_into_seq_len_plus_one():
    s = text_stream(["ab", "cde", "f"], seq_len=2, epochs=1)
    # ab EOS | cde | EOS f EOS: nothing left over, nothing carried across the three documents' edges.
    blocks = list(s.blocks())
    assert as_lists(blocks) == [[97, 98, EOS], [99, 100, 101], [EOS, 102, EOS]]
    assert {b.dtype for b in blocks} == {np.dtype(np.int64)}


def test_a_partial_block_at_an_epoch_s_end_is_dropped_and_each_epoch_starts_afresh():
    s = text_stream(["abcd"], seq_len=2, epochs=2)
    # abcd EOS is five tokens: one block of three; the last two are dropped, not joined to epoch 2.
    assert as_lists(s.blocks()) == [[97, 98, 99], [97, 98, 99]]


def test_chat_blocks_carry_tokens_loss_mask_and_each_conversation_s_number():
    convo = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]
    chat = ChatTemplate(CHATML, {}, "chatml")
    text = chat.render(convo)
    n = len(text)  # byte tokens: one per character here
    s = BatchStream(Docs([Conversation(convo)] * 2), ByteTokenizer(), n - 1, 1, epochs=1, chat=chat)
    blocks = list(s.blocks())
    assert [(b.shape, b.dtype) for b in blocks] == [((3, n), np.int64), ((3, n), np.int64)]
    start = text.index("a<|im_end|>")
    answer = [0] * start + [1] * len("a<|im_end|>\n") + [0] * (n - start - len("a<|im_end|>\n"))
    assert blocks[0][0].tolist() == list(text.encode())
    assert blocks[0][1].tolist() == answer
    # Each conversation numbered from 1, in the order read: attention is masked by this row.
    assert blocks[0][2].tolist() == [1] * n and blocks[1][2].tolist() == [2] * n


def test_a_chat_batch_takes_the_loss_on_the_next_token_where_that_token_is_an_answer_s():
    convo = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]
    chat = ChatTemplate(CHATML, {}, "chatml")
    text = chat.render(convo)
    n = len(text)
    batch = next(iter(BatchStream(Docs([Conversation(convo)] * 2), ByteTokenizer(), n - 1, 2, epochs=1, chat=chat)))
    tokens = list(text.encode())
    assert batch.inputs.tolist() == [tokens[:-1]] * 2
    start = text.index("a<|im_end|>")
    expected = [IGNORE] * (n - 1)
    for i in range(start, start + len("a<|im_end|>\n")):
        expected[i - 1] = tokens[i]   # target i-1 is token i: the loss is on the answer's own tokens
    assert batch.targets.tolist() == [expected] * 2
    assert batch.docs is not None and batch.docs.tolist() == [[1] * (n - 1), [2] * (n - 1)]
    assert batch.indices == [0, 1]


def test_a_source_with_no_documents_names_its_split_and_the_bad_records_skipped():
    s = BatchStream(Docs([], name="data/x.jsonl", split="validation", bad_records=3), ByteTokenizer(), 4, 1)
    with pytest.raises(UserError) as e:
        next(s.blocks())
    assert str(e.value) == "dataset: data/x.jsonl has no documents in its 'validation' split (3 bad records skipped)"
    with pytest.raises(UserError) as e:
        s.check_not_empty()
    assert str(e.value) == "dataset: data/x.jsonl has no documents in its 'validation' split (3 bad records skipped)"
    with pytest.raises(UserError, match=r"^dataset: docs has no documents$"):
        next(text_stream([], 4).blocks())
    with pytest.raises(UserError, match=r"^dataset: bare has no documents$"):
        next(BatchStream(Bare(), ByteTokenizer(), 4, 1).blocks())


def test_a_source_shorter_than_a_block_says_how_short_and_what_to_lower():
    s = text_stream(["ab", "c"], seq_len=5)
    with pytest.raises(UserError) as e:
        next(s.blocks())
    assert str(e.value) == "dataset: docs holds fewer than 6 tokens (2 document(s), 5 tokens); lower seq_len"
    assert list(s.blocks(allow_empty=True)) == []
    assert s.count_blocks() == 0


def test_count_blocks_is_one_pass_whatever_the_stream_s_batch_epochs_and_shuffle():
    s = text_stream(["ab", "cde", "f"], seq_len=2, batch=8, shuffle_buffer=4, epochs=None)
    assert s.count_blocks() == 3
    assert text_stream(["abcdefg"], seq_len=1).count_blocks() == 4   # 8 tokens: four blocks of two
    # Chat data counts its rendered conversations' tokens (three of 63 characters: 18 blocks of ten),
    # and the last 9 tokens' block of their own.
    convo = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]
    chat = BatchStream(Docs([Conversation(convo)] * 3), ByteTokenizer(), 9, 4, chat=ChatTemplate(CHATML, {}, "chatml"))
    assert 3 * len(chat.chat.render(convo)) == 18 * 10 + 9 and chat.count_blocks() == 19


def test_no_shuffle_keeps_the_order_and_a_shuffle_loses_and_repeats_nothing():
    docs = [bytes([65 + i]) * 3 for i in range(10)]   # ten documents of one block each (3 bytes + EOS)
    ordered = as_lists(text_stream(docs, 3, epochs=1, shuffle_buffer=0).shuffled())
    assert ordered == [[65 + i] * 3 + [EOS] for i in range(10)]
    for buffer in (1, 3, 10, 50):
        mixed = as_lists(text_stream(docs, 3, epochs=1, shuffle_buffer=buffer, seed=7).shuffled())
        assert sorted(mixed) == ordered, buffer


def test_the_shuffled_order_of_a_seed_and_buffer_is_fixed():
    docs = [bytes([65 + i]) * 3 for i in range(10)]
    first = [int(b[0]) - 65 for b in text_stream(docs, 3, epochs=1, shuffle_buffer=3, seed=7).shuffled()]
    # Recorded: a checkpoint's data position means these blocks in this order; a change to the
    # shuffle changes what a resumed run reads.
    assert first == [2, 1, 3, 5, 4, 6, 8, 0, 9, 7]
    # The buffer bounds how far ahead a block can come out: block k enters once k blocks are read,
    # and the first comes out when the buffer of three is full.
    for pos, k in enumerate(first):
        assert pos >= k - 3
    other = [int(b[0]) - 65 for b in text_stream(docs, 3, epochs=1, shuffle_buffer=3, seed=8).shuffled()]
    assert other != first and sorted(other) == list(range(10))


def world_blocks(s: BatchStream) -> list[tuple[int, list[int]]]:
    return [(k, b.tolist()) for k, b in s.rank_blocks()]


def test_ranks_take_their_slot_of_each_whole_group_and_a_short_last_group_goes_to_nobody():
    docs = [bytes([65 + i]) for i in range(11)]   # eleven blocks of two tokens (a letter and EOS)
    per_rank = [world_blocks(text_stream(docs, 1, batch=2, rank=r, world_size=2, epochs=1, shuffle_buffer=0))
                for r in range(2)]
    # Groups of four (two ranks x two rows): blocks 0-3 and 4-7; 8-10 make no whole group.
    assert per_rank[0] == [(0, [65, EOS]), (1, [66, EOS]), (4, [69, EOS]), (5, [70, EOS])]
    assert per_rank[1] == [(2, [67, EOS]), (3, [68, EOS]), (6, [71, EOS]), (7, [72, EOS])]


@pytest.mark.parametrize("skip", [0, 1, 4, 5, 8])
def test_a_resumed_stream_continues_at_the_global_block_after_those_consumed(skip):
    docs = [bytes([65 + i]) for i in range(13)]
    order = as_lists(text_stream(docs, 1, epochs=1, shuffle_buffer=4, seed=3).shuffled())
    resumed = world_blocks(text_stream(docs, 1, batch=2, epochs=1, shuffle_buffer=4, seed=3, skip_blocks=skip))
    # Groups are counted from the resume point: global blocks skip, skip+1, ... as far as whole
    # groups of the rest reach, each with its global index.
    assert resumed == [(k, order[k]) for k in range(skip, skip + (13 - skip) // 2 * 2)]


def test_an_epoch_smaller_than_the_buffer_is_one_permutation_of_its_blocks():
    """200 blocks under a 512-block buffer: each epoch draws each of its blocks once, in an order of
    its own (a buffer spanning epochs drew as if with replacement: 171 of 200 in a first epoch)."""
    docs = [bytes([65 + i % 26, 97 + i // 26]) for i in range(200)]   # two bytes and EOS: a block each
    s = text_stream(docs, 2, epochs=3, seed=5)
    assert s.shuffle_buffer == 512
    epochs = [as_lists(itertools.islice(b, 200)) for b in itertools.repeat(s.shuffled(), 3)]
    whole = sorted(as_lists(text_stream(docs, 2, epochs=1, shuffle_buffer=0).blocks()))
    assert len(whole) == 200 and all(sorted(e) == whole for e in epochs)
    assert len({tuple(map(tuple, e)) for e in epochs}) == 3   # each epoch its own order


def conversations(n: int) -> list[Conversation]:
    """Conversations of different lengths: packed, some straddle two blocks."""
    return [Conversation([{"role": "user", "content": f"q{i}" + "x" * (i % 7)},
                          {"role": "assistant", "content": f"a{i}" + "y" * (i % 5)}], where=f"chat.jsonl:{i + 1}")
            for i in range(n)]


def trained_records(streams) -> dict[tuple[int, int], int]:
    """The tokens of each (epoch, conversation) the batches of `streams` hold, from Batch.records."""
    seen: dict[tuple[int, int], int] = {}
    for s in streams:
        for batch in s:
            for row in batch.records:
                for epoch, number, tokens in row:
                    seen[epoch, number] = seen.get((epoch, number), 0) + tokens
    return seen


@pytest.mark.parametrize("skip", [0, 12], ids=["whole", "resumed-mid-epoch"])
def test_every_conversation_trains_once_an_epoch_on_two_ranks_and_after_a_resume(skip):
    """23 conversations, 2 epochs, 2 ranks of 2 rows: every token of every conversation is in exactly
    one row of one rank's batches each epoch, the epoch's last tokens and the last short group
    included (padded, no loss). Resumed after 3 steps (12 blocks, as a checkpoint counts them), the
    ranks' rows are the rest of those."""
    chat = ChatTemplate(CHATML, {}, "chatml")
    convs = conversations(23)
    lengths = {i + 1: len(encode_conversation(chat, ByteTokenizer().encode, c)[0]) for i, c in enumerate(convs)}

    def ranks(skip_blocks: int) -> list[BatchStream]:
        return [BatchStream(Docs(convs), ByteTokenizer(), 31, 2, rank=r, world_size=2, epochs=2, chat=chat, seed=3,
                            skip_blocks=skip_blocks) for r in range(2)]

    blocks_per_epoch = -(-sum(lengths.values()) // 32)
    assert sum(lengths.values()) % 32 and (2 * blocks_per_epoch) % 4   # a padded tail and a short last group
    assert trained_records(ranks(0)) == {(e, n): t for e in (0, 1) for n, t in lengths.items()}
    if skip:
        rows = {k: b.tolist() for r in ranks(0) for k, b in r.rank_blocks()}
        resumed = {k: b.tolist() for r in ranks(skip) for k, b in r.rank_blocks()}
        assert resumed == {k: b for k, b in rows.items() if k >= skip} and len(rows) == 4 * -(-len(rows) // 4)
    # Padding takes no loss, and each epoch's tail and the filled group have some.
    batches = [b for s in ranks(0) for b in s]
    assert not any(((b.targets != IGNORE) & (b.docs == PAD_DOC)).any() for b in batches)
    assert sum(int((b.docs == PAD_DOC).sum()) for b in batches) > 31


def test_batches_stack_a_rank_s_rows_and_shift_targets_by_one():
    docs = [bytes([65 + i]) * 2 for i in range(8)]   # eight blocks of three: two letters and EOS
    batches = list(text_stream(docs, 2, batch=2, rank=1, world_size=2, epochs=1, shuffle_buffer=0))
    assert [b.indices for b in batches] == [[2, 3], [6, 7]]
    assert batches[0].inputs.tolist() == [[67, 67], [68, 68]]
    assert batches[0].targets.tolist() == [[67, EOS], [68, EOS]]
    assert batches[0].inputs.dtype == batches[0].targets.dtype == torch.int64
    assert batches[0].docs is None


@pytest.fixture
def shards(tmp_path) -> TokenShards:
    # 5 documents of 4 letters + EOS: 25 tokens in shards of 10, 10 and 5, so blocks span shard edges.
    docs = [bytes([65 + i]) * 4 for i in range(5)]
    prepare({"train": Docs(docs)}, ByteTokenizer(), tmp_path / "tok", shard_tokens=7)
    return TokenShards(tmp_path / "tok", "train")


def test_token_shards_stream_every_block_once_per_epoch_and_a_seed_fixes_each_epoch_s_order(shards):
    n = 4   # seq_len 3: six blocks of four in 25 tokens
    tokens = np.concatenate([np.append(np.full(4, 65 + i), EOS) for i in range(5)])
    blocks = [tokens[i * n:(i + 1) * n].tolist() for i in range(6)]
    plain = BatchStream(shards, None, 3, 1, epochs=2, shuffle_buffer=0)
    assert [b.tolist() for _, b in plain.rank_blocks()] == blocks * 2
    seeded = BatchStream(shards, None, 3, 1, epochs=2, seed=11)
    got = [b.tolist() for _, b in seeded.rank_blocks()]
    first, second = [blocks.index(b) for b in got[:6]], [blocks.index(b) for b in got[6:]]
    assert sorted(first) == sorted(second) == list(range(6))
    assert first != second   # a new order each epoch
    # Recorded, as the shuffle of a document source is: the blocks a resumed run reads.
    assert (first, second) == ([3, 1, 4, 5, 2, 0], [4, 0, 5, 3, 1, 2])
    # Any shuffle buffer shuffles token shards (the permutation needs no buffer).
    small = BatchStream(shards, None, 3, 1, epochs=1, seed=11, shuffle_buffer=1)
    assert [b.tolist() for _, b in small.rank_blocks()] == got[:6]
    again = BatchStream(shards, None, 3, 1, epochs=2, seed=11, skip_blocks=7)
    assert [(k, b.tolist()) for k, b in again.rank_blocks()] == [(k, got[k]) for k in range(7, 12)]


def test_token_shards_read_only_the_blocks_of_this_rank(shards, monkeypatch):
    read = []
    block = shards.block
    monkeypatch.setattr(shards, "block", lambda i, n: read.append(i) or block(i, n))
    s = BatchStream(shards, None, 3, 1, rank=1, world_size=2, epochs=1, shuffle_buffer=0)
    assert [k for k, _ in s.rank_blocks()] == [1, 3, 5]
    assert read == [1, 3, 5]


def test_token_shards_count_and_check(shards):
    assert BatchStream(shards, None, 3, 1).count_blocks() == 6
    assert BatchStream(shards, None, 4, 1).count_blocks() == 5
    BatchStream(shards, None, 24, 1).check_not_empty()   # one block of 25: fine
    with pytest.raises(UserError) as e:
        BatchStream(shards, None, 25, 1).check_not_empty()
    assert str(e.value) == f"dataset: {shards.name} holds fewer than 26 tokens; lower seq_len"


def test_the_prefetcher_hands_over_every_item_in_order_and_then_stops():
    p = Prefetcher(range(10), depth=3)
    assert list(p) == list(range(10))
    with pytest.raises(StopIteration):
        next(p)
    p.close()


def wait_for(predicate, seconds: float = 5.0) -> None:
    deadline = time.monotonic() + seconds
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


@pytest.mark.parametrize(("depth", "ahead"), [(2, 3), (0, 2), (1, 2)])
def test_the_prefetcher_reads_depth_items_ahead_and_no_more(depth, ahead):
    pulled = []

    def items():
        for i in itertools.count():
            pulled.append(i)
            yield i

    p = Prefetcher(items(), depth=depth)
    # `depth` items wait in the queue (at least one), and one more in the producer's hand.
    wait_for(lambda: len(pulled) == ahead)
    time.sleep(0.3)
    assert len(pulled) == ahead
    assert next(p) == 0
    wait_for(lambda: len(pulled) == ahead + 1)
    p.close()
    assert not p._thread.is_alive()


def test_an_error_in_the_producer_is_raised_by_the_consumer_at_the_item_where_it_happened():
    def items():
        yield 1
        yield 2
        raise UserError("dataset: broken record")

    p = Prefetcher(items(), depth=4)
    assert next(p) == 1 and next(p) == 2
    with pytest.raises(UserError, match="broken record"):
        next(p)
    with pytest.raises(StopIteration):   # the producer is gone: nothing more, and no wait for it
        next(p)
    p.close()


def test_close_stops_a_producer_blocked_on_a_full_queue():
    p = Prefetcher(itertools.count(), depth=1)
    wait_for(lambda: p._queue.full())
    started = time.monotonic()
    p.close()
    assert not p._thread.is_alive()
    assert time.monotonic() - started < 2
    # A daemon, named in a thread dump; a producer stuck in a read never holds the process open.
    assert (p._thread.name, p._thread.daemon) == ("fsdpkit-data", True)


def test_close_waits_for_a_producer_busy_with_an_item_with_nothing_queued():
    def slow():
        yield 0
        time.sleep(0.5)
        yield 1

    p = Prefetcher(slow(), depth=4)
    assert next(p) == 0
    p.close()   # the queue is empty while the producer works: close keeps waiting, then it stops
    assert not p._thread.is_alive()


def test_pinning_applies_to_every_tensor_of_a_batch_and_leaves_none_as_none(monkeypatch):
    pinned = []

    def pin(self):
        pinned.append(self.shape)
        return self.clone()

    monkeypatch.setattr(torch.Tensor, "pin_memory", pin)
    s = text_stream([bytes([65 + i]) for i in range(4)], 1, batch=2, epochs=1, shuffle_buffer=0)
    p = Prefetcher(iter(s), depth=2, pin_memory=True)
    batches = list(p)
    p.close()
    assert len(batches) == 2 and batches[0].docs is None
    assert pinned == [torch.Size([2, 1])] * 4   # inputs and targets of each batch; no docs to pin
