"""Chat records for supervised fine-tuning: conversations rendered with the model's chat template
(fsdpkit.train.data.chat_template), tokenised, with a loss mask on the assistant's turns only.

A record is `{"messages": [...], "tools": [...]}` (the Hugging Face form; `tools` optional), or a
prompt/completion pair, `{"prompt": ..., "completion": ...}`, where each side is a string or a list
of messages (TRL's two forms): the conversation prompt-as-user, completion-as-assistant. Messages
are as transformers passes them to templates: system, user, assistant and tool roles; an assistant
message may carry `tool_calls` (its content then optional) and its reasoning
(`reasoning_content`, `thinking` or `reasoning`); a tool result may name its call.

A rendered record must still say what its answers say: an answer whose text the render leaves out
(a template that ignores the messages, or reads a field they do not have), or a record with no
token to train on, is refused naming the record and the template, since training on it would
teach nothing and report a loss all the same.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from fsdpkit.errors import UserError
from fsdpkit.train.data.chat_template import REASONING_FIELDS, ChatTemplate, Messages, Spans, answer_text, tool_names

ROLES = ("system", "user", "assistant", "tool")


@dataclass(frozen=True)
class Conversation:
    """One chat record: its messages, the tools it offers, and where it was read (for errors)."""

    messages: Messages
    tools: list[dict[str, Any]] | None = None
    where: str = "a conversation"


def is_message(m: object) -> bool:
    """A message as templates take it (see the module's doc)."""
    if not isinstance(m, dict) or m.get("role") not in ROLES:
        return False
    if any(m.get(k) is not None and not isinstance(m[k], str) for k in REASONING_FIELDS):
        return False
    if m["role"] == "assistant" and m.get("tool_calls") is not None:
        calls = m["tool_calls"]
        return isinstance(calls, list) and bool(calls) and all(isinstance(c, dict) for c in calls) \
            and (m.get("content") is None or isinstance(m["content"], str))
    return isinstance(m.get("content"), str)


def is_tool_list(tools: object) -> bool:
    """A record's `tools`: none, or a list of JSON schemas (mappings)."""
    return tools is None or (isinstance(tools, list) and all(isinstance(t, dict) for t in tools))


def conversation_of(record: object, where: str = "a conversation") -> Conversation | None:
    """The conversation a record holds (messages, or a prompt/completion pair), None if neither."""
    if not isinstance(record, dict):
        return None
    if "messages" in record:
        messages = record["messages"]
    elif "prompt" in record and "completion" in record:
        prompt, completion = record["prompt"], record["completion"]
        messages = ([{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt) + \
            ([{"role": "assistant", "content": completion}] if isinstance(completion, str) else completion)
    else:
        return None
    if not isinstance(messages, list) or not messages or not all(is_message(m) for m in messages):
        return None
    if not any(m["role"] == "assistant" for m in messages):
        return None
    tools = record.get("tools")
    if not is_tool_list(tools):
        return None
    return Conversation(messages, tools or None, where)


def _check_answers(template: ChatTemplate, conv: Conversation, text: str, spans: Spans) -> None:
    """Every answer's text (or, for a tool call without text, the tool's name) inside the turns that
    carry the loss; and some turn to carry it."""
    if not any(b > a for a, b in spans):
        raise UserError(f"chat_template: {template.name} leaves nothing to train on in {conv.where}: no character "
                        "of its answers is an assistant turn; check the template")
    trained = "\x00".join(text[a:b] for a, b in spans)
    for i, m in enumerate(conv.messages):
        if m["role"] != "assistant":
            continue
        said = [answer_text(m)] if answer_text(m) else tool_names(m)
        for piece in filter(None, said):
            if piece not in trained:
                shown = piece if len(piece) <= 40 else piece[:37] + "..."
                raise UserError(f"chat_template: {template.name} leaves answer {i} of {conv.where} ({shown!r}) "
                                "out of the text it trains on; check that it renders each message's content")


def encode_conversation(template: ChatTemplate, encode: Callable[[str], np.ndarray],
                        conv: Conversation) -> tuple[np.ndarray, np.ndarray]:
    """Token ids of a rendered conversation and a same-length mask, true on assistant tokens. Each
    span is tokenised on its own, so no token straddles a turn's edge."""
    text, spans = template.assistant_spans(conv.messages, conv.tools, conv.where)
    _check_answers(template, conv, text, spans)
    ids: list[np.ndarray] = []
    mask: list[np.ndarray] = []
    at = 0
    for start, end in [*spans, (len(text), len(text))]:
        for piece, on in ((text[at:start], False), (text[start:end], True)):
            if piece:
                part = encode(piece).astype(np.int64)
                ids.append(part)
                mask.append(np.full(len(part), on))
        at = end
    return np.concatenate(ids), np.concatenate(mask)
