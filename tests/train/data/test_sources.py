"""Every source type streams offline from small local fixtures; ranks split it with no overlap, no gap."""

from __future__ import annotations

import itertools
import json

import numpy as np
import pytest

from fsdpkit.errors import UserError
from fsdpkit.train.data import (
    BatchStream,
    ByteTokenizer,
    HFTokenizer,
    HubDataset,
    LocalFiles,
    TokenShards,
    get_source,
    train_bpe,
)
from fsdpkit.train.data.prepare import prepare

from conftest import DOCS, read_metrics, require, run_cli, write_fixture

SEQ = 32
def one_pass(source, tokenizer, rank=0, world=1, batch=2):
    s = BatchStream(source, tokenizer, SEQ, batch, rank, world, seed=0, shuffle_buffer=0, epochs=1)
    return list(s.rank_blocks())


def assert_ranks_partition(source, tokenizer):
    whole = one_pass(source, tokenizer, batch=4)
    per_rank = [one_pass(source, tokenizer, r, 2, 2) for r in range(2)]
    ids = [[k for k, _ in blocks] for blocks in per_rank]
    assert not set(ids[0]) & set(ids[1])  # no overlap
    # No gap: together the ranks hold every whole global batch of the pass, with the same tokens.
    together = {k: b for blocks in per_rank for k, b in blocks}
    assert sorted(together) == [k for k, _ in whole] and together
    for k, b in whole:
        assert np.array_equal(together[k], b)
    assert len(ids[0]) == len(ids[1])  # the same number of batches on every rank
    return whole


@pytest.mark.parametrize("fmt", ["jsonl", "jsonl.gz", "jsonl.zst", "json", "parquet", "txt"])
def test_local_formats_stream_all_documents_split_across_ranks(tmp_path, fmt):
    root = write_fixture(tmp_path / fmt, fmt)
    train = LocalFiles(str(root), "train", 0)
    val = LocalFiles(str(root), "validation", 0)
    train_docs, val_docs = list(train.documents(0)), list(val.documents(0))
    # Every document is in exactly one split; the held-out split is small but not empty.
    assert sorted(train_docs + val_docs) == sorted(DOCS)
    assert 0 < len(val_docs) < 20
    tok = ByteTokenizer()
    whole = assert_ranks_partition(train, tok)
    # The packed stream is the documents' bytes with EOS after each, in the pass's order.
    stream = np.concatenate([np.append(tok.encode(d), tok.eos_id) for d in train.documents(0)])
    packed = np.concatenate([b for _, b in whole])
    assert np.array_equal(packed, stream[: len(packed)])


def test_split_folders_are_used_when_present(tmp_path):
    write_fixture(tmp_path / "ds" / "train", "jsonl")
    (tmp_path / "ds" / "validation").mkdir()
    (tmp_path / "ds" / "validation" / "v.jsonl").write_text(json.dumps({"text": "held out"}) + "\n")
    assert list(LocalFiles(str(tmp_path / "ds"), "validation", 0).documents(0)) == ["held out"]
    assert len(list(LocalFiles(str(tmp_path / "ds"), "train", 0).documents(0))) == len(DOCS)


def test_bad_records_are_counted_or_fatal(tmp_path, diagnostics):
    f = tmp_path / "bad.jsonl"
    f.write_text('{"text": "fine"}\nnot json\n{"body": "no text field"}\n{"text": "also fine"}\n')
    skip = LocalFiles(str(f), "train", 0)
    skip.hold_out = False
    assert list(skip.documents(0)) == ["fine", "also fine"]
    assert skip.bad_records == 2
    assert [line.split(";")[0] for line in diagnostics] == ["warning: dataset: skipped 1 bad record(s)",
                                                            "warning: dataset: skipped 2 bad record(s)"]
    fail = LocalFiles(str(f), "train", 0, on_bad_record="fail")
    fail.hold_out = False
    with pytest.raises(UserError, match=r"bad\.jsonl:2: not JSON"):
        list(fail.documents(0))


def test_missing_paths_and_columns_are_clear(tmp_path):
    with pytest.raises(UserError, match="not found"):
        get_source(str(tmp_path / "nope.jsonl"), "train", 0)
    root = write_fixture(tmp_path / "pq", "parquet")
    with pytest.raises(UserError, match="no column 'content'"):
        list(LocalFiles(str(root), "train", 0, text_field="content").documents(0))


def test_hub_code_path_streams_offline_from_local_data(tmp_path, monkeypatch):
    """The real `datasets.load_dataset(..., streaming=True)` path, on a local folder, offline."""
    require("datasets")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))
    root = write_fixture(tmp_path / "hubdata", "jsonl")
    source = get_source(f"hf:{root}", "train", 0)
    assert isinstance(source, HubDataset)
    assert sorted(source.documents(0)) == sorted(DOCS)
    assert_ranks_partition(source, ByteTokenizer())


def test_hub_dataset_refused_when_offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(UserError, match="HF_HUB_OFFLINE=1"):
        get_source("allenai/c4", "train", 0, config="en")


@pytest.fixture(scope="module")
def bpe(tmp_path_factory):
    out = tmp_path_factory.mktemp("tok") / "bpe"
    train_bpe(iter(DOCS), 400, out)
    return HFTokenizer(str(out))


def test_trained_bpe_round_trips_and_compresses(bpe):
    assert bpe.vocab_size <= 400 and bpe.eos_id is not None
    ids = bpe.encode(DOCS[5])
    assert bpe.decode(ids) == DOCS[5]
    assert len(ids) < len(DOCS[5].encode()) / 1.5  # it learned merges


def test_token_shards_random_access_split_across_ranks(tmp_path, bpe):
    root = write_fixture(tmp_path / "src", "jsonl")
    sources = {s: LocalFiles(str(root), s, 0) for s in ("train", "validation")}
    meta = prepare(sources, bpe, tmp_path / "shards", shard_tokens=500)
    assert meta["dtype"] == "uint16" and len(meta["splits"]["train"]) > 1  # several shards
    shards = get_source(str(tmp_path / "shards"), "train", 0)
    assert isinstance(shards, TokenShards) and shards.num_tokens == meta["tokens"]["train"]
    # Blocks that span shard boundaries read correctly: the concatenation is the token stream.
    expected = np.concatenate([np.append(bpe.encode(d), bpe.eos_id) for d in sources["train"].documents(0)])
    n = SEQ + 1
    got = np.concatenate([shards.block(i, n) for i in range(shards.num_blocks(n))])
    assert np.array_equal(got, expected[: len(got)])
    # Shuffled by a seeded permutation; two ranks take disjoint blocks, together all of them.
    per_rank = [BatchStream(shards, None, SEQ, 2, r, 2, seed=3, epochs=1) for r in range(2)]
    ids = [[k for k, _ in s.rank_blocks()] for s in per_rank]
    assert not set(ids[0]) & set(ids[1])
    total = shards.num_blocks(n)
    assert sorted(ids[0] + ids[1]) == list(range(total - total % 4))
    first = next(iter(per_rank[0]))
    assert first.inputs.shape == (2, SEQ) and first.inputs.max() < bpe.vocab_size


def test_prefetcher_passes_items_and_errors():
    from fsdpkit.train.data import Prefetcher

    assert list(Prefetcher(range(10), depth=2)) == list(range(10))

    def broken():
        yield 1
        raise UserError("dataset: boom")

    p = Prefetcher(broken())
    assert next(p) == 1
    with pytest.raises(UserError, match="boom"):
        next(p)
    assert list(itertools.islice(Prefetcher(itertools.count()), 3)) == [0, 1, 2]


def test_hub_tokenizer_refused_when_offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(UserError, match="HF_HUB_OFFLINE=1"):
        HFTokenizer("hf-internal-testing/llama-tokenizer")


def test_a_bad_record_is_counted_once_in_the_log_metrics_and_summary(tmp_path):
    """One broken line, read by the training split every epoch and by validation at every check:
    one bad record, in the warning, in each metrics record and in summary.json."""
    docs = [json.dumps({"text": f"document number {i} " * 8}) for i in range(300)]
    docs.insert(7, "{this line is broken")
    (tmp_path / "d.jsonl").write_text("\n".join(docs) + "\n")
    r = run_cli("train", "--dataset", str(tmp_path / "d.jsonl"), "--seq_len", "32", "--train_batch_size", "2",
                "--max_steps", "6", "--logging_freq", "2", "--validation_freq", "2", "--validation_batches", "1",
                "--val_batch_size", "1", "--epochs", "1000", "--progress", "off", "--tensorboard", "0",
                "--run_dir", str(tmp_path / "run"))
    assert r.returncode == 0, r.stderr[-2000:]
    assert "warning: dataset: skipped 1 bad record(s); latest" in r.stdout and "skipped 2" not in r.stdout
    assert [m["bad_records"] for m in read_metrics(tmp_path / "run")] == [1, 1, 1]
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["bad_records"] == 1


def test_a_dataset_too_small_to_hold_out_validation_trains_without_it(tmp_path):
    """A three-document folder has an empty held-out split: that is a warning naming validation,
    not "fewer than N tokens; lower seq_len" (which would send the user after the wrong cause)."""
    (tmp_path / "ds").mkdir()
    (tmp_path / "ds" / "a.jsonl").write_text("".join(json.dumps({"text": f"doc {i} " * 30}) + "\n" for i in range(3)))
    r = run_cli("train", "--dataset", str(tmp_path / "ds"), "--seq_len", "16", "--train_batch_size", "1",
                "--max_steps", "2", "--progress", "off", "--tensorboard", "0", "--run_dir", str(tmp_path / "run"))
    assert r.returncode == 0, r.stderr[-2000:]
    assert "'validation' split holds less than one global validation batch" in r.stdout + r.stderr
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "a.jsonl").write_text("not json\n")
    r = run_cli("train", "--dataset", str(tmp_path / "empty"), "--max_steps", "2", "--progress", "off")
    assert r.returncode == 2
    assert r.stderr.strip().splitlines()[-1] == (f"error: dataset: {tmp_path / 'empty'} has no documents in its "
                                                 "'train' split (1 bad records skipped)")
