"""Training data: sources (where documents come from), tokenizers, packing into per-rank batches."""

from fsdpkit.train.data.sources import (
    DocumentSource,
    EmbeddedCorpus,
    HubDataset,
    LocalFiles,
    TokenShards,
    get_source,
)
from fsdpkit.train.data.stream import Batch, BatchStream, Prefetcher
from fsdpkit.train.data.tokenizers import ByteTokenizer, HFTokenizer, Tokenizer, get_tokenizer, train_bpe

__all__ = [
    "Batch", "BatchStream", "ByteTokenizer", "DocumentSource", "EmbeddedCorpus", "HFTokenizer", "HubDataset",
    "LocalFiles", "Prefetcher", "TokenShards", "Tokenizer", "get_source", "get_tokenizer", "train_bpe",
]
