"""`fsdpkit data preview` (fsdpkit.train.data.preview): a record as training encodes it, each token
marked trained or not. Chat templates against transformers' assistant mask: test_chat_masks.py."""

from __future__ import annotations

import json

from conftest import cli_here


def test_a_preference_pair_trains_on_each_answer_and_its_eos_and_a_text_document_on_every_token(tmp_path):
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text(json.dumps({"prompt": "2+2=", "chosen": "4", "rejected": "five"}) + "\n")
    r = cli_here("data", "preview", "--dataset", str(pairs), "--data-format", "preference", "--json")
    assert r.returncode == 0, r.stderr
    [record] = json.loads(r.stdout)["data"]["records"]
    prompt = [50, 43, 50, 61]   # the byte tokenizer's "2+2="; its EOS is 257
    assert [(s["name"], s["ids"], s["mask"]) for s in record["sequences"]] == [
        ("chosen", [*prompt, 52, 257], [False] * 4 + [True] * 2),
        ("rejected", [*prompt, *b"five", 257], [False] * 4 + [True] * 5)]
    assert record["sequences"][1]["texts"][-2:] == ["e", "<eos>"] and record["where"] == f"{pairs}:1"
    human = cli_here("data", "preview", "--dataset", str(pairs), "--data-format", "preference")
    assert human.stdout.splitlines()[1:] == ["", f"{pairs}:1: chosen, 6 tokens, 2 trained", "  2+2=[[4<eos>]]", "",
                                             f"{pairs}:1: rejected, 9 tokens, 5 trained", "  2+2=[[five<eos>]]"]

    docs = tmp_path / "docs.jsonl"
    docs.write_text("".join(json.dumps({"text": t}) + "\n" for t in ("ab", "c", "never shown")))
    r = cli_here("data", "preview", "--dataset", str(docs), "--records", "2", "--json")
    assert [s["ids"] for rec in json.loads(r.stdout)["data"]["records"] for s in rec["sequences"]] == [
        [97, 98, 257], [99, 257]]
    assert all(all(s["mask"]) for rec in json.loads(r.stdout)["data"]["records"] for s in rec["sequences"])
