"""Chat records for supervised fine-tuning: conversations rendered with the tokenizer's own chat
template (as transformers' `apply_chat_template` renders it), tokenised, with a loss mask that is
on for the assistant's turns only.

A record is `{"messages": [{"role": ..., "content": ...}, ...]}` (the common Hugging Face format),
or a prompt/completion pair, `{"prompt": ..., "completion": ...}`, where each side is a string or
a list of messages (TRL's two forms). A pair is the conversation prompt-as-user, completion-as-
assistant.

Which characters belong to an assistant turn is found by rendering prefixes of the conversation:
the turn starts where the conversation up to it, with the generation prompt, ends, and it ends
where the conversation through it ends (its end-of-turn marker included, so the model learns to
stop). Templates that render an earlier turn differently once later turns follow (Qwen 3 drops
the empty thinking block of all but the last answer) are handled by finding the answer's text
in the whole render.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
import numpy as np
from jinja2.sandbox import ImmutableSandboxedEnvironment

from fsdpkit.errors import UserError
from fsdpkit.readers import reading

Conversation = list[dict[str, Any]]

# A minimal ChatML template: the built-in one for a tokenizer that brings none (the embedded byte
# tokenizer), and the form Qwen's templates share.
CHATML = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + "
          "'<|im_end|>' + '\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
          "{% endif %}")
BUILTIN_TEMPLATES = {"chatml": CHATML}
ROLES = ("system", "user", "assistant", "tool")


def conversation_of(record: object) -> Conversation | None:
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
    if not isinstance(messages, list) or not messages:
        return None
    for m in messages:
        if not isinstance(m, dict) or m.get("role") not in ROLES or not isinstance(m.get("content"), str):
            return None
    if not any(m["role"] == "assistant" for m in messages):
        return None
    return messages


class Generation(jinja2.ext.Extension):
    """A `{% generation %}...{% endgeneration %}` block that renders its body: transformers' marker
    for assistant text, which some templates carry (the mask here is found by rendering)."""

    tags: set[str] = {"generation"}  # noqa: RUF012  (jinja2 declares it as a plain attribute)

    def parse(self, parser: Any) -> Any:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller: Callable[[], str]) -> str:
        return caller()


@dataclass
class ChatTemplate:
    """A tokenizer's chat template, compiled as transformers compiles it: a sandboxed Jinja
    environment that trims blocks, with `raise_exception`, `strftime_now` and a `tojson` that does
    not escape HTML; rendered with the tokenizer's special tokens as variables."""

    source: str
    special_tokens: dict[str, str]
    name: str = "template"

    def __post_init__(self) -> None:
        def raise_exception(message: str) -> None:
            raise jinja2.exceptions.TemplateError(message)

        def tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
                   sort_keys: bool = False) -> str:
            return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=[Generation, jinja2.ext.loopcontrols])
        env.filters["tojson"] = tojson
        env.globals["raise_exception"] = raise_exception
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        try:
            self._template = env.from_string(self.source)
        except jinja2.TemplateError as e:
            raise UserError(f"chat_template: {self.name} is not a valid Jinja template: {e}") from None

    def render(self, messages: Conversation, add_generation_prompt: bool = False) -> str:
        try:
            return str(self._template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                             **self.special_tokens))
        except jinja2.TemplateError as e:
            raise UserError(f"chat_template: {self.name} refused a conversation: {e}") from None

    def assistant_spans(self, messages: Conversation) -> tuple[str, list[tuple[int, int]]]:
        """The whole render and the (start, end) characters of each assistant turn in it."""
        full = self.render(messages)
        spans = []
        for i, m in enumerate(messages):
            if m["role"] != "assistant":
                continue
            prompt = self.render(messages[:i], add_generation_prompt=True) if i else ""
            if not full.startswith(prompt):
                raise UserError(f"chat_template: {self.name} renders the conversation before answer {i} "
                                "differently on its own; the answer's tokens cannot be found")
            turn = self.render(messages[: i + 1])[len(prompt):]
            start = len(prompt)
            if full.startswith(turn, start):
                end = start + len(turn)
            else:   # rendered differently when followed by more turns: find the answer's own text
                found = full.find(m["content"], start)
                if found < 0:
                    raise UserError(f"chat_template: {self.name} leaves answer {i}'s text out of the render")
                end = found + len(m["content"])
                tail = turn[turn.rfind(m["content"]) + len(m["content"]):] if m["content"] in turn else ""
                if tail and full.startswith(tail, end):
                    end += len(tail)   # the end-of-turn marker
            spans.append((start, end))
        return full, spans


def encode_conversation(template: ChatTemplate, encode: Callable[[str], np.ndarray],
                        messages: Conversation) -> tuple[np.ndarray, np.ndarray]:
    """Token ids of a rendered conversation and a same-length mask, true on assistant tokens. Each
    span is tokenised on its own, so no token straddles a turn's edge."""
    text, spans = template.assistant_spans(messages)
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
    if not ids:
        return np.empty(0, dtype=np.int64), np.empty(0, dtype=bool)
    return np.concatenate(ids), np.concatenate(mask)


def _token_text(value: Any) -> str | None:
    """A special token as tokenizer_config.json writes it: a string or an AddedToken mapping."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def template_of(spec: str | None, tokenizer_config: dict[str, Any], tokenizer_dir: Path | None) -> ChatTemplate:
    """The chat template a run renders with: `spec` (a built-in name such as `chatml`, or a Jinja
    file), else the tokenizer's own (tokenizer_config.json's `chat_template`, or the
    chat_template.jinja transformers writes beside it), else ChatML for a tokenizer without one."""
    special = {k: t for k in ("bos_token", "eos_token", "unk_token", "pad_token")
               if (t := _token_text(tokenizer_config.get(k))) is not None}
    if spec in BUILTIN_TEMPLATES:
        return ChatTemplate(BUILTIN_TEMPLATES[spec], special, spec)
    if spec:
        path = Path(spec).expanduser()
        if not path.is_file():
            raise UserError(f"chat_template: {spec} is neither a file nor one of: {', '.join(BUILTIN_TEMPLATES)}")
        with reading(path, "chat_template"):
            return ChatTemplate(path.read_text(), special, str(path))
    own = tokenizer_config.get("chat_template")
    if isinstance(own, list):  # named templates: the default one
        own = next((t.get("template") for t in own if isinstance(t, dict) and t.get("name") == "default"), None)
    if isinstance(own, str):
        return ChatTemplate(own, special, "the tokenizer's chat template")
    if tokenizer_dir is not None and (tokenizer_dir / "chat_template.jinja").is_file():
        file = tokenizer_dir / "chat_template.jinja"
        with reading(file, "chat_template"):
            return ChatTemplate(file.read_text(), special, str(file))
    return ChatTemplate(CHATML, special, "chatml (the tokenizer has no chat template)")
