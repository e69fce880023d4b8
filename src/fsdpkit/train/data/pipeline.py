"""The data a run's split comes from, as the config names it: shared by training, validation and
the preflight check."""

from __future__ import annotations

from typing import Any

from fsdpkit.train.data import Tokenizer, TokenShards, get_source, get_tokenizer
from fsdpkit.train.sections import DataConfig


def data_pipeline(d: DataConfig, seed: int, split: str, verbose: bool) -> tuple[Any, Tokenizer | None]:
    """The source of a split and its tokenizer (None for token shards, which are tokenised already;
    their `meta` names the tokenizer instead, hence Any: a DocumentSource or TokenShards)."""
    source = get_source(d.dataset, split, seed, d.text_field, d.dataset_config_name, d.on_bad_record, verbose)
    return source, None if isinstance(source, TokenShards) else get_tokenizer(d.tokenizer)
