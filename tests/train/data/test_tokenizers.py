"""A Hugging Face hub tokenizer without the hub (fsdpkit.train.data.tokenizers): one look at the
hub's host, then the hub client's own cache read at once; a name not in it is one line, exit 3."""

from __future__ import annotations

import json

from fsdpkit.train.data.tokenizers import HFTokenizer, train_bpe

from conftest import DOCS, run_cli

REVISION = "0123456789abcdef0123456789abcdef01234567"


def hub_cache(home, repo: str, tokenizer_dir) -> None:
    """`repo` in the hub client's cache layout under HF_HOME, as a download leaves it."""
    entry = home / "hub" / f"models--{repo.replace('/', '--')}"
    (entry / "refs").mkdir(parents=True)
    (entry / "refs" / "main").write_text(REVISION)
    snapshot = entry / "snapshots" / REVISION
    snapshot.mkdir(parents=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (snapshot / name).write_bytes((tokenizer_dir / name).read_bytes())


def test_a_cached_hub_tokenizer_is_read_from_the_cache_when_the_hub_is_out_of_reach(tmp_path):
    tok_dir = train_bpe(DOCS, 300, tmp_path / "tok")
    hub_cache(tmp_path / "hf-home", "acme/tok", tok_dir)
    (tmp_path / "text").mkdir()
    (tmp_path / "text" / "a.txt").write_text("\n".join(DOCS[:50]))
    env = {"HF_HOME": str(tmp_path / "hf-home"), "HF_ENDPOINT": "http://127.0.0.1:9"}   # nothing listens there
    r = run_cli("data", "prepare", "--dataset", str(tmp_path / "text"), "--tokenizer", "acme/tok", "--out",
                str(tmp_path / "tokens"), "--json", env=env)
    assert r.returncode == 0, r.stderr
    data = json.loads(r.stdout)["data"]
    local = HFTokenizer(str(tok_dir))
    # The cached tokenizer: one document of its tokens and the end-of-text token its cached
    # tokenizer_config.json names.
    assert (data["tokenizer"], data["vocab_size"], data["eos_id"]) == ("acme/tok", 300, local.eos_id)
    assert data["tokens"] == {"train": len(local.encode("\n".join(DOCS[:50]))) + 1}
    assert "could not be read" not in r.stderr
    r = run_cli("data", "prepare", "--dataset", str(tmp_path / "text"), "--tokenizer", "acme/other", "--out",
                str(tmp_path / "tokens-2"), env=env)
    assert r.returncode == 3 and r.stderr == (
        "error: tokenizer: 'acme/other' is not in the Hugging Face cache here and the hub (http://127.0.0.1:9) cannot "
        "be reached; point --tokenizer at a local directory with tokenizer.json, or run once where the hub can be "
        "reached\n")
