"""What a record trains on, token by token (`fsdpkit data preview`): the first records of a split
encoded as the trainer encodes them (its source, tokenizer, chat template and loss mask), each
token marked trained or not."""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any

from fsdpkit.errors import UserError
from fsdpkit.train.data.chat import Conversation, encode_conversation
from fsdpkit.train.data.pipeline import Pipeline
from fsdpkit.train.data.preference import Preference, encode_pair
from fsdpkit.train.data.tokenizers import Tokenizer

# Where trained tokens start and end in the human view.
OPEN, CLOSE = "[[", "]]"


@dataclass(frozen=True)
class Sequence:
    """One token sequence the model reads: a document, a conversation, or a preference pair's
    prompt with one of its answers."""

    name: str
    ids: list[int]
    trained: list[bool]   # the token is a target of the loss


@dataclass(frozen=True)
class Previewed:
    where: str
    sequences: list[Sequence]


def preview(pipe: Pipeline, count: int) -> list[Previewed]:
    """The split's first `count` records (bad ones skipped, as training skips them)."""
    tok = pipe.tokenizer
    if tok is None:
        raise UserError(f"data preview: {pipe.source.name} holds token shards, tokenised without a loss mask; preview "
                        "the records they were prepared from")
    out: list[Previewed] = []
    for n, doc in enumerate(itertools.islice(_records(pipe), count), start=1):
        if isinstance(doc, Preference):
            pair = encode_pair(doc, tok.encode, pipe.chat, tok.eos_id)
            prompt = pair.prompt.tolist()
            sequences = [Sequence(name, prompt + answer.tolist(), [False] * len(prompt) + [True] * len(answer))
                         for name, answer in (("chosen", pair.chosen), ("rejected", pair.rejected))]
            out.append(Previewed(doc.where, sequences))
        elif isinstance(doc, Conversation):
            assert pipe.chat is not None   # chat data is read with a template
            tokens, mask = encode_conversation(pipe.chat, tok.encode, doc)
            out.append(Previewed(doc.where, [Sequence("conversation", tokens.tolist(), mask.tolist())]))
        else:   # text: every token trains, the document's EOS too
            ids = [*tok.encode(doc).tolist(), int(tok.eos_id)]
            out.append(Previewed(f"document {n}", [Sequence("text", ids, [True] * len(ids))]))
    if not out:
        raise UserError(f"data preview: {pipe.source.name} gave no usable record; check --dataset, --data-format and "
                        "--text-field")
    return out


def _records(pipe: Pipeline) -> Any:
    wanted = Preference if pipe.preference else Conversation if pipe.chat is not None else (str, bytes)
    return (doc for doc in pipe.source.documents(0) if isinstance(doc, wanted))


def as_json(records: list[Previewed], tok: Tokenizer) -> list[dict[str, Any]]:
    """Each token's id, its text alone (special tokens written out) and whether it trains."""
    return [{"where": r.where, "sequences": [
        {"name": s.name, "tokens": len(s.ids), "trained": sum(s.trained), "ids": s.ids,
         "texts": [tok.decode([i], special=True) for i in s.ids], "mask": s.trained} for s in r.sequences]}
            for r in records]


def marked(s: Sequence, tok: Tokenizer) -> str:
    """The sequence's text with each stretch of trained tokens between OPEN and CLOSE (each stretch
    decoded whole, so a character split over tokens reads as itself)."""
    parts = []
    for on, run in itertools.groupby(zip(s.ids, s.trained, strict=True), key=lambda t: t[1]):
        text = tok.decode([i for i, _ in run], special=True)
        parts.append(f"{OPEN}{text}{CLOSE}" if on else text)
    return "".join(parts)
