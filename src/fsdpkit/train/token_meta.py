"""What a token directory (`fsdpkit data prepare`'s output) says of itself in its meta.json, read
without the data pipeline (which needs torch): the config reads the tokenizer it was made with."""

from __future__ import annotations

import json
from pathlib import Path

TOKENS_FORMAT = "fsdpkit-tokens-v1"


def shards_tokenizer(dataset: str) -> str | None:
    """The tokenizer a local token directory was made with (its meta.json), or None where the dataset
    is no token directory on this machine."""
    meta_path = Path(dataset).expanduser() / "meta.json"
    if dataset in ("embedded", "") or dataset.startswith("hf:") or not meta_path.is_file():
        return None
    try:
        meta = json.loads(meta_path.read_text())
    except (OSError, ValueError):
        return None   # TokenShards says what is wrong with it when the run reads it
    name = meta.get("tokenizer") if isinstance(meta, dict) and meta.get("format") == TOKENS_FORMAT else None
    return str(name) if name else None
