"""Data preparation commands and training on prepared data, end to end through the CLI."""

from __future__ import annotations

import json

import pytest

from conftest import FAST, losses, read_metrics, run_cli, write_fixture

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("corpus")
    write_fixture(root / "jsonl", "jsonl")
    r = run_cli("tokenizer", "train", "--dataset", str(root / "jsonl"), "--vocab_size", "300",
                "--out", str(root / "tok"), "--json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["data"]["vocab_size"] <= 300
    r = run_cli("data", "prepare", "--dataset", str(root / "jsonl"), "--tokenizer", str(root / "tok"),
                "--out", str(root / "shards"), "--json")
    assert r.returncode == 0, r.stderr
    meta = json.loads(r.stdout)["data"]
    assert meta["tokens"]["train"] > 0 and meta["dtype"] == "uint16"
    return root


@pytest.mark.parametrize("dataset", ["jsonl", "shards"])
def test_two_ranks_train_on_local_data_with_a_trained_tokenizer(corpus, tmp_path, dataset):
    run_dir = tmp_path / "run"
    r = run_cli("train", *FAST, "--dataset", str(corpus / dataset), "--tokenizer", str(corpus / "tok"),
                "--vocab_size", "300", "--max_steps", "8", "--logging_freq", "2", "--train_batch_size", "4",
                "--val_batch_size", "1",
                "--nproc", "2", "--tensorboard", "0", "--log_samples", "1", "--run_dir", str(run_dir))
    assert r.returncode == 0, r.stderr[-3000:]
    got = losses(run_dir)
    assert len(got) == 4 and got[-1] < got[0]
    assert read_metrics(run_dir, "val")
    rows = [json.loads(line) for f in sorted(run_dir.glob("samples-rank*.jsonl"))
            for line in f.read_text().splitlines()]
    seen = [r["blocks"] for r in rows if r.get("kind") != "start"]  # one start row per rank marks the attempt
    flat = [k for blocks in seen for k in blocks]
    assert sorted(flat) == list(range(8 * 8))  # 8 steps x 8 samples: each once, none skipped


def test_vocab_mismatch_is_refused_before_training(corpus, tmp_path):
    r = run_cli("train", "--dataset", str(corpus / "jsonl"), "--tokenizer", str(corpus / "tok"),
                "--vocab_size", "100", "--run_dir", str(tmp_path / "run"))
    assert r.returncode == 2
    assert r.stderr.startswith("error: vocab_size:") and len(r.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "run").exists()


def test_prepare_refuses_a_non_empty_output(corpus, tmp_path):
    r = run_cli("data", "prepare", "--dataset", str(corpus / "jsonl"), "--out", str(corpus / "shards"))
    assert r.returncode == 2 and "not empty" in r.stderr
    assert json.loads((corpus / "shards" / "meta.json").read_text())["format"] == "fsdpkit-tokens-v1"


def test_bad_dataset_inputs_are_one_line(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "ok"}\n{oops\n')
    cases = [
        (["--dataset", str(tmp_path / "missing.jsonl")], "not found"),
        (["--dataset", str(bad), "--on_bad_record", "fail", "--max_steps", "1", "--seq_len", "8"], "not JSON"),
        (["--tokenizer", str(tmp_path / "no-tokenizer-here")], "tokenizer"),
    ]
    for flags, text in cases:
        r = run_cli("train", *flags, "--run_dir", str(tmp_path / "run"), "--progress", "off", "--tensorboard", "0")
        assert r.returncode == 2, (flags, r.stderr[-2000:])
        last = r.stderr.strip().splitlines()[-1]
        assert last.startswith("error: ") and text in last, (flags, r.stderr[-2000:])
        assert "Traceback" not in r.stderr
    r = run_cli("train", "--dataset", "allenai/c4", "--dataset_config_name", "en", "--run_dir",
                str(tmp_path / "run"), env={"HF_HUB_OFFLINE": "1"})
    assert r.returncode == 2 and "HF_HUB_OFFLINE=1" in r.stderr


def test_tokenizer_train_says_when_the_text_gives_fewer_tokens_than_asked(tmp_path):
    (tmp_path / "tiny").mkdir()
    (tmp_path / "tiny" / "a.jsonl").write_text('{"text": "hello world hello"}\n')
    r = run_cli("tokenizer", "train", "--dataset", str(tmp_path / "tiny"), "--vocab_size", "1000", "--out",
                str(tmp_path / "tok"), "--json")
    assert r.returncode == 0, r.stderr
    data = json.loads(r.stdout)["data"]
    assert data["requested"] == 1000 and 258 <= data["vocab_size"] < 1000
    assert data["warnings"] == [f"the text held merges for {data['vocab_size']:,} tokens, not the 1,000 asked (more "
                                f"text learns more); train with --vocab-size {data['vocab_size']}"]
    r = run_cli("tokenizer", "train", "--dataset", str(tmp_path / "tiny"), "--vocab_size", "1000", "--out",
                str(tmp_path / "tok2"))
    assert r.returncode == 0 and r.stderr.startswith("warning: the text held merges for ")


def test_shards_train_with_their_own_tokenizer_and_the_export_carries_it(corpus, tmp_path):
    """`data prepare --tokenizer DIR` -> `train --dataset SHARDS` (no --tokenizer) -> `export`: the run
    records the shards' tokenizer, and the export's tokenizer (loaded by transformers) encodes text
    as the shards were encoded. Another --tokenizer than the shards' is refused before anything runs."""
    transformers = pytest.importorskip("transformers")
    meta = json.loads((corpus / "shards" / "meta.json").read_text())
    assert meta["tokenizer"] == str((corpus / "tok").resolve())   # absolute: any working directory finds it
    ckpt = tmp_path / "ckpt"
    r = run_cli("train", *FAST, "--dataset", str(corpus / "shards"), "--vocab_size", "300", "--max_steps", "2",
                "--train_batch_size", "2", "--tensorboard", "0", "--checkpoint_dir", str(ckpt), "--run_dir",
                str(tmp_path / "run"))
    assert r.returncode == 0, r.stderr[-3000:]
    assert (tmp_path / "run" / "config.yaml").read_text().count(f"tokenizer: {meta['tokenizer']}") == 1
    out = tmp_path / "hf"
    r = run_cli("export", str(ckpt), str(out))
    assert r.returncode == 0, r.stderr
    theirs = transformers.PreTrainedTokenizerFast(tokenizer_file=str(corpus / "tok" / "tokenizer.json"))
    exported = transformers.AutoTokenizer.from_pretrained(out)
    text = "The quick brown fox trains on its own tokens."
    assert exported(text)["input_ids"] == theirs(text)["input_ids"]
    assert json.loads((out / "config.json").read_text())["eos_token_id"] == meta["eos_id"]
    r = run_cli("train", "--dataset", str(corpus / "shards"), "--tokenizer", "bytes", "--run_dir",
                str(tmp_path / "other"))
    assert (r.returncode, r.stderr) == (2, f"error: tokenizer: the token shards in {corpus / 'shards'} were made "
                                           f"with {meta['tokenizer']!r}, not 'bytes'; drop --tokenizer (training on "
                                           "shards uses theirs), or prepare the data again with this one\n")
    assert not (tmp_path / "other").exists()


def test_shards_of_a_small_corpus_without_a_held_out_split_train_without_validation(tmp_path):
    """A corpus too small for a held-out split prepares train shards alone; training on them runs,
    says there is no validation, and records none (it was refused: "has no split 'validation'")."""
    (tmp_path / "corpus").mkdir()
    (tmp_path / "corpus" / "a.jsonl").write_text("".join(
        json.dumps({"text": f"tiny document number {i} with a few words in it"}) + "\n" for i in range(3)))
    r = run_cli("data", "prepare", "--dataset", str(tmp_path / "corpus"), "--tokenizer", "bytes", "--out",
                str(tmp_path / "tok"), "--json")
    assert r.returncode == 0, r.stderr
    assert list(json.loads((tmp_path / "tok" / "meta.json").read_text())["splits"]) == ["train"]
    r = run_cli("train", "--dataset", str(tmp_path / "tok"), "--max-steps", "2", "--validation-freq", "0",
                "--seq-len", "16", "--train-batch-size", "1", "--progress", "off", "--tensorboard", "0",
                "--run-dir", str(tmp_path / "run"))
    assert r.returncode == 0, r.stderr[-2000:]
    assert ("warning: the 'validation' split holds less than one global validation batch (1 x 1 blocks of 17 "
            "tokens); no validation") in r.stdout.splitlines()   # the trainer's diagnostics go with its metrics
    assert [m["step"] for m in read_metrics(tmp_path / "run")] == [2]
    assert read_metrics(tmp_path / "run", "validation") == []
