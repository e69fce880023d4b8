"""Preference records for DPO: a prompt with a chosen and a rejected answer, tokenised as TRL's
DPOTrainer tokenises them, and packed two sequences a pair into rows of the training length.

A record is in one of TRL's forms: `prompt`, `chosen`, `rejected` as text, or as messages (the
prompt's messages, each answer's assistant message; `tools` beside them), or `chosen` and
`rejected` as whole conversations whose shared first messages are the prompt. A pair is tokenised
as TRL does: prompt and prompt+answer each tokenised whole (a conversation rendered with the chat
template, the prompt with its generation prompt), and the answer is what follows the longest
prefix both share, so the answer's tokens are those the model is trained to produce after the
prompt.

Packing: each pair's two sequences (prompt+chosen, prompt+rejected) go in the same row, whole,
followed by padding; a row holds as many whole pairs as fit. Each sequence has its own number in
the row (chosen of the row's k-th pair 2k+1, rejected 2k+2, padding 0), which is both the
attention's document id (the two answers never see each other) and what the loss sums each
sequence's log-probabilities by. A pair longer than a row is refused, naming the record: cutting
it would train on an answer that is not the one preferred.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from fsdpkit.train.data.chat import is_message, is_tool_list
from fsdpkit.train.data.chat_template import ChatTemplate, Messages

PREFERENCE_RECORD = ("no `prompt` with `chosen` and `rejected` (text, or messages), and no `chosen` and `rejected` "
                     "conversations sharing their first messages")
PAD_SEQUENCE = 0
# A pair whose answers are one answer: DPO's loss is ln 2 whatever the model, its gradient zero.
SAME_ANSWERS = "its chosen and rejected answers are the same, which DPO cannot learn from (it learns their difference)"


@dataclass(frozen=True)
class Preference:
    """One preference record as read: text or messages (a Conversation each, for the answers)."""

    prompt: str | Messages
    chosen: str | Messages
    rejected: str | Messages
    tools: list[dict[str, Any]] | None = None
    where: str = "a record"

    @property
    def conversational(self) -> bool:
        return not isinstance(self.prompt, str)


def _messages(value: object) -> Messages | None:
    """A list of messages as chat records hold them (the chat reader's own rules), None if not one."""
    return value if isinstance(value, list) and value and all(is_message(m) for m in value) else None


def teaches(p: Preference) -> bool:
    """The pair's answers differ (two empty answers are the same answer)."""
    return p.chosen != p.rejected


def preference_of(record: object, where: str = "a record") -> Preference | None:
    """The preference a record holds, None if it holds none."""
    if not isinstance(record, dict) or "chosen" not in record or "rejected" not in record:
        return None
    tools = record.get("tools")
    if not is_tool_list(tools):
        return None
    prompt, chosen, rejected = record.get("prompt"), record["chosen"], record["rejected"]
    if isinstance(chosen, str) and isinstance(rejected, str):
        return Preference(prompt, chosen, rejected, None, where) if isinstance(prompt, str) else None
    chosen_m, rejected_m = _messages(chosen), _messages(rejected)
    if chosen_m is None or rejected_m is None:
        return None
    if prompt is None:  # implicit prompt: the messages both conversations open with
        shared = 0
        while shared < min(len(chosen_m), len(rejected_m)) - 1 and chosen_m[shared] == rejected_m[shared]:
            shared += 1
        prompt_m: Messages | None = chosen_m[:shared]
        chosen_m, rejected_m = chosen_m[shared:], rejected_m[shared:]
    else:
        prompt_m = _messages(prompt)
    if not prompt_m or not all(m["role"] == "assistant" for m in chosen_m + rejected_m):
        return None
    return Preference(prompt_m, chosen_m, rejected_m, tools or None, where)


@dataclass(frozen=True)
class Pair:
    """A preference as tokens: the prompt, and each answer's tokens after it."""

    prompt: np.ndarray
    chosen: np.ndarray
    rejected: np.ndarray
    where: str

    @property
    def tokens(self) -> int:
        return 2 * len(self.prompt) + len(self.chosen) + len(self.rejected)


def _shared(a: np.ndarray, b: np.ndarray) -> int:
    n = min(len(a), len(b))
    differ = np.flatnonzero(a[:n] != b[:n])
    return int(differ[0]) if len(differ) else n


def encode_pair(p: Preference, encode: Callable[[str], np.ndarray], template: ChatTemplate | None,
                eos_id: int) -> Pair:
    """Tokens as TRL's DPOTrainer makes them: prompt and prompt+answer tokenised whole, the answer
    starting where both answers' sequences leave the prompt's tokens; a text answer ends with EOS
    (a conversation's ends with the template's end of turn)."""
    if isinstance(p.prompt, list) and isinstance(p.chosen, list) and isinstance(p.rejected, list):
        assert template is not None   # conversational records are read with a chat template
        prompt = template.render(p.prompt, True, p.tools, p.where)
        full = [template.render(p.prompt + answer, False, p.tools, p.where) for answer in (p.chosen, p.rejected)]
    else:
        prompt = str(p.prompt)
        full = [prompt + str(p.chosen), prompt + str(p.rejected)]
    ids = encode(prompt).astype(np.int64)
    end = np.array([] if p.conversational else [eos_id], dtype=np.int64)
    chosen, rejected = (np.concatenate([encode(text).astype(np.int64), end]) for text in full)
    at = min(_shared(ids, chosen), _shared(ids, rejected))
    return Pair(ids[:at], chosen[at:], rejected[at:], p.where)


def pack_pairs(pairs: Iterable[Pair], row: int, pad_id: int, too_long: Callable[[Pair, int], None]) \
        -> Iterator[np.ndarray]:
    """(3, row) blocks of whole pairs in order: tokens, the answer mask, and each token's sequence
    number (see the module's doc). `too_long` is told of a pair that no row can hold."""
    tokens: list[np.ndarray] = []
    answer: list[np.ndarray] = []
    seqs: list[np.ndarray] = []
    used = 0

    def flush() -> np.ndarray:
        pad = row - used
        return np.stack([np.concatenate([*tokens, np.full(pad, pad_id, dtype=np.int64)]),
                         np.concatenate([*answer, np.zeros(pad, dtype=np.int64)]),
                         np.concatenate([*seqs, np.full(pad, PAD_SEQUENCE, dtype=np.int64)])])

    for pair in pairs:
        if pair.tokens > row:
            too_long(pair, row)
            continue
        if used + pair.tokens > row:
            yield flush()
            tokens, answer, seqs, used = [], [], [], 0
        k = len(seqs) // 2
        for side, ids in ((1, pair.chosen), (2, pair.rejected)):
            tokens.append(np.concatenate([pair.prompt, ids]))
            answer.append(np.repeat(np.array([0, 1], dtype=np.int64), [len(pair.prompt), len(ids)]))
            seqs.append(np.full(len(pair.prompt) + len(ids), 2 * k + side, dtype=np.int64))
        used += pair.tokens
    if used:
        yield flush()

