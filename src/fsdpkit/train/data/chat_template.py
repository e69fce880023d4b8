"""A chat template as transformers renders it (`apply_chat_template`): a sandboxed Jinja environment
with transformers' globals and filters, the tokenizer's special tokens as variables, the record's
tools, and `{% generation %}` blocks tracked as transformers tracks them for
`return_assistant_tokens_mask`.

A template is untrusted code from a model repository or a user's file, run on every record: each
render is bounded in time (RENDER_SECONDS, enforced from a watchdog thread, since a loop that
writes nothing gives the render no point to check at) and in output (a multiple of the record's own
size), so a template that loops without end is refused in one line instead of filling memory.

Which characters are an assistant's turn (see `ChatTemplate.assistant_spans`):
- where the template marks them with `{% generation %}`: exactly the marked characters, as
  transformers' assistant mask has them;
- elsewhere, by rendering prefixes of the conversation: a turn starts where the conversation up
  to it, with the generation prompt, ends (what the model is given at inference), and it ends
  where the conversation through it ends (its end-of-turn marker included, so the model learns to
  stop). A template that renders an earlier turn differently once later turns follow (Qwen 3 drops
  the reasoning of all but the last answers) has that turn found by its answer's text in the whole
  render.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import re
import threading
import time
from collections.abc import Callable, Iterator
from contextvars import ContextVar
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment

from fsdpkit.errors import UserError
from fsdpkit.readers import reading

Messages = list[dict[str, Any]]
Spans = list[tuple[int, int]]

# A minimal ChatML template: the built-in one for a tokenizer that brings none (the embedded byte
# tokenizer), and the form Qwen's templates share.
CHATML = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + "
          "'<|im_end|>' + '\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
          "{% endif %}")
BUILTIN_TEMPLATES = {"chatml": CHATML}
# transformers' test for a template that marks its assistant text.
MARKS_GENERATION = re.compile(r"\{%-?\s*generation\s*-?%\}")
# The names a message's reasoning comes under; transformers gives templates all of the first two.
REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")

# One render's bounds: real templates render a conversation in milliseconds, and add a system
# prompt and tool schemas of a few kilobytes to what the record holds.
RENDER_SECONDS = 5.0
RENDER_GROWTH = 16
RENDER_MIN_CHARS = 1 << 20


class RenderTimeout(Exception):
    """Raised inside a render that ran past its deadline (by the watchdog, asynchronously)."""


class _Watchdog:
    """One daemon thread that raises RenderTimeout in any thread whose render is past its deadline
    (CPython's PyThreadState_SetAsyncExc: it lands at the rendering thread's next bytecode, which a
    pure-Python Jinja loop reaches at once)."""

    TICK = 0.05

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._due: dict[int, float] = {}
        self._fired: set[int] = set()
        self._thread: threading.Thread | None = None

    @contextlib.contextmanager
    def limit(self, seconds: float) -> Iterator[None]:
        me = threading.get_ident()
        with self._lock:
            self._fired.discard(me)
            self._due[me] = time.monotonic() + seconds
            if self._thread is None:
                self._thread = threading.Thread(target=self._watch, name="fsdpkit-render-watchdog", daemon=True)
                self._thread.start()
        try:
            yield
        finally:
            with self._lock:
                self._due.pop(me, None)
                if me in self._fired:   # fired as the render ended: take back what has not landed yet
                    self._fired.discard(me)
                    ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(me), None)

    def _watch(self) -> None:
        while True:
            time.sleep(self.TICK)
            now = time.monotonic()
            with self._lock:
                for thread, due in self._due.items():
                    if now > due and thread not in self._fired:
                        self._fired.add(thread)
                        ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(thread),
                                                                   ctypes.py_object(RenderTimeout))


_WATCHDOG = _Watchdog()
# The render in progress in this thread: its output so far (characters) and the generation blocks' spans.
_TRACKING: ContextVar[tuple[list[int], Spans] | None] = ContextVar("fsdpkit_generation", default=None)


class Generation(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}`: renders its body and, as transformers'
    AssistantTracker does, records where in the output the body lies."""

    tags: set[str] = {"generation"}  # noqa: RUF012  (jinja2 declares it as a plain attribute)

    def parse(self, parser: Any) -> Any:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller: Callable[[], str]) -> str:
        text = caller()
        if (tracking := _TRACKING.get()) is not None:
            written, spans = tracking
            spans.append((written[0], written[0] + len(text)))
        return text


class _Environment(ImmutableSandboxedEnvironment):
    """transformers' environment, with `*` and `**` bounded: one multiplication could otherwise
    build a string of any size in a single step the watchdog cannot interrupt."""

    intercepted_binops = frozenset({"*", "**"})

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        if operator == "*" and isinstance(right, int) and isinstance(left, (str, list, tuple)):
            left, right = right, left
        if operator == "*" and isinstance(left, int) and isinstance(right, (str, list, tuple)) \
                and left * len(right) > RENDER_MIN_CHARS:
            raise jinja2.exceptions.SecurityError(f"a repetition of {left * len(right)} items")
        if operator == "**" and isinstance(right, int) and right > 1024:
            raise jinja2.exceptions.SecurityError(f"a power of {right}")
        return super().call_binop(context, operator, left, right)


def _environment() -> _Environment:
    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
               sort_keys: bool = False) -> str:
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = _Environment(trim_blocks=True, lstrip_blocks=True, extensions=[Generation, jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env


def _with_reasoning_aliases(messages: Messages) -> Messages:
    """Each message's reasoning under both names templates read it by (transformers does the same:
    `reasoning_content` for most, `thinking` for gpt-oss's)."""
    out = []
    for m in messages:
        reasoning = next((m[k] for k in REASONING_FIELDS if m.get(k) is not None), None)
        out.append(m if reasoning is None else {"thinking": reasoning, **m, "reasoning_content": reasoning})
    return out


@dataclass
class ChatTemplate:
    """A tokenizer's chat template, compiled as transformers compiles it."""

    source: str
    special_tokens: dict[str, str]
    name: str = "template"
    seconds: float = RENDER_SECONDS
    marks_generation: bool = field(init=False)

    def __post_init__(self) -> None:
        self.marks_generation = MARKS_GENERATION.search(self.source) is not None
        try:
            self._template = _environment().from_string(self.source)
        except jinja2.TemplateError as e:
            raise UserError(f"chat_template: {self.name} is not a valid Jinja template: {e}") from None

    def _render(self, messages: Messages, tools: list[dict[str, Any]] | None, add_generation_prompt: bool,
                where: str) -> tuple[str, Spans]:
        """The text and the generation blocks' spans, within this template's bounds."""
        size = len(json.dumps([messages, tools], default=str))
        budget = RENDER_MIN_CHARS + RENDER_GROWTH * size
        written: list[int] = [0]
        spans: Spans = []
        parts: list[str] = []
        token = _TRACKING.set((written, spans))
        try:
            with _WATCHDOG.limit(self.seconds):
                for part in self._template.generate(messages=_with_reasoning_aliases(messages), tools=tools,
                                                    documents=None, add_generation_prompt=add_generation_prompt,
                                                    **self.special_tokens):
                    parts.append(part)
                    written[0] += len(part)
                    if written[0] > budget:
                        raise UserError(f"chat_template: {self.name} wrote more than {budget} characters for "
                                        f"{where}, which holds {size} characters: it loops without bound; check the "
                                        "template")
        except RenderTimeout:
            raise UserError(f"chat_template: {self.name} did not finish rendering {where} within {self.seconds:g} s: "
                            "it loops without bound; check the template") from None
        except UserError:
            raise
        except Exception as e:   # the template's own code failing on this record (a TypeError, a KeyError...)
            raise UserError(f"chat_template: {self.name} refused {where}: {e}") from None
        finally:
            _TRACKING.reset(token)
        return "".join(parts), spans

    def render(self, messages: Messages, add_generation_prompt: bool = False,
               tools: list[dict[str, Any]] | None = None, where: str = "a conversation") -> str:
        return self._render(messages, tools, add_generation_prompt, where)[0]

    def assistant_spans(self, messages: Messages, tools: list[dict[str, Any]] | None = None,
                        where: str = "a conversation") -> tuple[str, Spans]:
        """The whole render and the (start, end) characters of each assistant turn in it."""
        full, marked = self._render(messages, tools, False, where)
        if self.marks_generation:
            return full, _merged(marked)
        spans = []
        for i, m in enumerate(messages):
            if m["role"] != "assistant":
                continue
            prompt = self.render(messages[:i], True, tools, where) if i else ""
            if not full.startswith(prompt):
                raise UserError(f"chat_template: {self.name} renders the conversation before answer {i} of {where} "
                                "differently on its own, so where the answer lies cannot be found by rendering; give "
                                "a template that marks answers with {% generation %} (--chat-template FILE; TRL "
                                "ships one per model as chat_templates/<model>_training.jinja)")
            turn = self.render(messages[: i + 1], False, tools, where)[len(prompt):]
            start = len(prompt)
            if full.startswith(turn, start):
                end = start + len(turn)
            else:   # rendered otherwise when followed by more turns
                end = self._followed_end(full, start, turn, m, i, where)
            spans.append((start, end))
        return full, spans


    def _followed_end(self, full: str, start: int, turn: str, message: dict[str, Any], i: int, where: str) -> int:
        """Where answer i ends in the whole render when the template renders it otherwise once later
        turns follow: the longest end of the turn as rendered alone that the whole render holds at
        the turn's start (what is dropped is the front: Qwen 3, GLM and gpt-oss drop the reasoning
        of earlier answers), so long as it still holds what the answer says; else the answer's text
        found after its prompt, with as much of the end-of-turn marker that follows it alone as the
        whole render has there."""
        parts = [answer_text(message)] if answer_text(message) else tool_names(message)
        first = full[start:start + 1]
        for k, c in enumerate(turn):   # from the longest end down
            if c == first and full.startswith(turn[k:], start) and all(p in turn[k:] for p in parts):
                return start + len(turn) - k
        said = parts[0] if parts else ""
        found = full.find(said, start) if said else -1
        if found < 0:
            raise UserError(f"chat_template: {self.name} renders answer {i} of {where} differently once later "
                            "turns follow, and its text is not in the render")
        end = found + len(said)
        tail = turn[turn.rfind(said) + len(said):] if said in turn else ""
        # The end-of-turn marker as far as both forms share it, cut only after a marker or a line
        # (`<|end|>\n` of `<|end|>\n<|endoftext|>`), so no span edge falls inside a special token.
        for k in range(len(tail), 0, -1):
            if (k == len(tail) or tail[k - 1] in ">\n") and full.startswith(tail[:k], end):
                return end + k
        return end


def tool_names(message: dict[str, Any]) -> list[str]:
    """The function names of an answer's tool calls (OpenAI's nested form or flat)."""
    names = []
    for call in message.get("tool_calls") or []:
        function = call.get("function")
        name = (function if isinstance(function, dict) else call).get("name")
        if isinstance(name, str) and name:
            names.append(name)
    return names


def _merged(spans: Spans) -> Spans:
    """Marked spans in order, empty ones dropped, overlapping or touching ones joined."""
    out: Spans = []
    for a, b in sorted(s for s in spans if s[1] > s[0]):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(b, out[-1][1]))
        else:
            out.append((a, b))
    return out


def answer_text(message: dict[str, Any]) -> str:
    """What an assistant message says, as a template must render it somewhere: its content without
    a leading reasoning block (templates move or drop reasoning), stripped."""
    content = message.get("content") or ""
    if "</think>" in content:
        content = content.rsplit("</think>", 1)[1]
    return str(content).strip()


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
