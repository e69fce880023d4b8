"""The data a run's split comes from, as the config names it: shared by training, validation and
the preflight check."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from fsdpkit.train.data import Tokenizer, TokenShards, get_source, get_tokenizer
from fsdpkit.train.data.chat_template import ChatTemplate, template_of
from fsdpkit.train.sections import DataConfig


@dataclass
class Pipeline:
    """A split's source, its tokenizer (None for token shards, which are tokenised already; their
    `meta` names the tokenizer instead) and, for chat data, the template conversations are
    rendered with."""

    source: Any   # a DocumentSource or TokenShards
    tokenizer: Tokenizer | None
    chat: ChatTemplate | None = None
    preference: bool = False   # preference records, packed a pair at a time (fsdpkit.train.data.preference)

    @property
    def eos_id(self) -> int:
        return int(self.source.meta["eos_id"] if self.tokenizer is None else self.tokenizer.eos_id)


def data_pipeline(d: DataConfig, seed: int, split: str, verbose: bool) -> Pipeline:
    source = get_source(d.dataset, split, seed, d.text_field, d.dataset_config_name, d.on_bad_record, verbose,
                        d.data_format)
    if isinstance(source, TokenShards):
        return Pipeline(source, None)
    tok = get_tokenizer(d.tokenizer)
    chat = template_of(d.chat_template, tok.config, tok.directory) if d.data_format != "text" else None
    return Pipeline(source, tok, chat, d.data_format == "preference")
