"""The loss mask against transformers' own, on the chat templates models ship: multi-turn
conversations with a system prompt, tools, tool calls and their results, and reasoning.

The templates come from TRL (its chat_templates folder holds each model's template as its
tokenizer_config.json ships it, and a training variant that marks the assistant's text with
`{% generation %}`, which is what transformers' `return_assistant_tokens_mask` reads). On a marked
template the mask is transformers', token for token; on the model's own, unmarked template it
follows the documented rule (fsdpkit.train.data.chat_template): from the end of the generation
prompt to the end of the turn, pinned here for each model against the marked one."""

from __future__ import annotations

import json
import re
from importlib import resources
from pathlib import Path

import pytest
from tokenizers import Tokenizer as RustTokenizer
from tokenizers import decoders, models, pre_tokenizers

from fsdpkit.errors import UserError
from fsdpkit.train.data import HFTokenizer
from fsdpkit.train.data.chat import Conversation, encode_conversation
from fsdpkit.train.data.chat_template import template_of

from conftest import cli_here, require

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city today.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
CALL = {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}

# A system prompt, a question answered through a tool call (with reasoning before it), the tool's
# result, the answer, then a second question answered directly.
WITH_TOOLS = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": "", "reasoning_content": "I should call the tool.", "tool_calls": [CALL]},
    {"role": "tool", "content": "{\"sky\": \"clear\", \"celsius\": 21}"},
    {"role": "assistant", "content": "Clear, 21 C.", "reasoning_content": "The tool says clear."},
    {"role": "user", "content": "And tomorrow?"},
    {"role": "assistant", "content": "I can only see today.", "reasoning_content": "No forecast tool."},
]
# For templates that take neither tools nor a system turn (Gemma's) or no tools (Llama 3's, Phi's).
PLAIN = [
    {"role": "user", "content": "Name a prime."},
    {"role": "assistant", "content": "Seven."},
    {"role": "user", "content": "Another?"},
    {"role": "assistant", "content": "Eleven."},
]

# Two questions, each answer with its reasoning.
THINKING = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Name a prime."},
    {"role": "assistant", "content": "Seven.", "reasoning_content": "Small primes."},
    {"role": "user", "content": "Another?"},
    {"role": "assistant", "content": "Eleven.", "reasoning_content": "Next after seven is eleven."},
]

# TRL's name for a model's template: the conversation each renders.
MODELS = {
    "qwen2_5": WITH_TOOLS, "qwen3": WITH_TOOLS, "glm4moe": WITH_TOOLS, "gptoss": WITH_TOOLS,
    "deepseekv3": WITH_TOOLS, "llama3": PLAIN, "phi3_5": PLAIN, "gemma3": PLAIN,
}
# Each model's BOS and EOS texts (tokenizer_config.json's), which templates write as variables.
ENDS = {
    "qwen2_5": (None, "<|im_end|>"), "qwen3": (None, "<|im_end|>"), "glm4moe": (None, "<|endoftext|>"),
    "gptoss": (None, "<|return|>"), "deepseekv3": ("<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"),
    "llama3": ("<|begin_of_text|>", "<|eot_id|>"), "phi3_5": ("<s>", "<|endoftext|>"), "gemma3": ("<bos>", "<eos>"),
}
# Special-token texts as the templates write them (<|...|>, DeepSeek's <｜...｜>, Gemma's turns, GLM's).
SPECIAL = re.compile(r"<\|[^|\s]+\|>|<｜[^｜]+｜>|<(?:start|end)_of_turn>|\[gMASK\]|<sop>")


def templates(name: str) -> tuple[str, str]:
    """The model's own template and TRL's marked variant of it."""
    require("trl")
    folder = resources.files("trl") / "chat_templates"
    return (folder / f"{name}.jinja").read_text(), (folder / f"{name}_training.jinja").read_text()


def byte_tokenizer(path: Path, template: str, special: list[str], ends: tuple[str | None, str]) -> Path:
    """One token per byte, and each of the template's special tokens as one: every tokenisation of
    the text is then the same, so two masks compare token for token."""
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tok = RustTokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    bos, eos = ends
    tok.add_special_tokens(sorted({*special, eos, *([bos] if bos else [])}))
    path.mkdir(parents=True, exist_ok=True)
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": bos, "eos_token": eos, "tokenizer_class": "PreTrainedTokenizerFast", "chat_template": template}))
    return path


def masks(tmp_path: Path, name: str, template: str, conv: list[dict]) -> tuple[list[int], list[bool], dict]:
    own, marked = templates(name)
    special = sorted(set(SPECIAL.findall(own + marked)))
    folder = byte_tokenizer(tmp_path / name, template, special, ENDS[name])
    tok = HFTokenizer(str(folder))
    chat = template_of(None, tok.config, tok.directory)
    tools = TOOLS if conv is WITH_TOOLS else None
    (tmp_path / name).mkdir(parents=True, exist_ok=True)
    ids, mask = encode_conversation(chat, tok.encode, Conversation(conv, tools, "test"))
    return ids.tolist(), mask.tolist(), {"tokenizer": tok, "folder": folder, "tools": tools}


@pytest.mark.parametrize("name", list(MODELS))
def test_on_a_marked_template_the_mask_is_transformers_assistant_mask(tmp_path, name):
    transformers = require("transformers")
    _, marked = templates(name)
    conv = MODELS[name]
    ids, mask, made = masks(tmp_path, name, marked, conv)
    theirs = transformers.AutoTokenizer.from_pretrained(str(made["folder"])).apply_chat_template(
        conv, tools=made["tools"], tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
    assert ids == list(theirs["input_ids"])
    assert mask == [bool(m) for m in theirs["assistant_masks"]]
    assert sum(mask) > 0 and not all(mask)


@pytest.mark.parametrize("name", ["qwen2_5", "llama3"])
def test_data_preview_marks_the_tokens_transformers_assistant_mask_marks_on_a_marked_template(tmp_path, name):
    """`fsdpkit data preview --json` of a conversation file, as a user runs it: its trained tokens
    are transformers' assistant mask, token for token, and the human view brackets exactly the
    assistant's answers."""
    transformers = require("transformers")
    own, marked = templates(name)
    conv = MODELS[name]
    folder = byte_tokenizer(tmp_path / "tok", marked, sorted(set(SPECIAL.findall(own + marked))), ENDS[name])
    tools = TOOLS if conv is WITH_TOOLS else None
    data = tmp_path / "chat.jsonl"
    data.write_text(json.dumps({"messages": conv, **({"tools": tools} if tools else {})}) + "\n")
    flags = ["data", "preview", "--dataset", str(data), "--data-format", "chat", "--tokenizer", str(folder)]
    r = cli_here(*flags, "--json")
    assert r.returncode == 0, r.stderr
    [record] = json.loads(r.stdout)["data"]["records"]
    [seq] = record["sequences"]
    theirs = transformers.AutoTokenizer.from_pretrained(str(folder)).apply_chat_template(
        conv, tools=tools, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
    assert seq["ids"] == list(theirs["input_ids"]) and record["where"] == f"{data}:1"
    assert seq["mask"] == [bool(m) for m in theirs["assistant_masks"]]
    assert seq["trained"] == sum(seq["mask"]) > 0 and not all(seq["mask"])
    human = cli_here(*flags)
    assert human.returncode == 0, human.stderr
    header, view = human.stdout.split("\n", 1)
    assert header.endswith("the tokens that train are between [[ and ]]")
    bracketed = re.findall(r"\[\[(.*?)\]\]", view, re.S)
    answers = [m["content"] for m in conv if m["role"] == "assistant" and m["content"]]
    assert len(bracketed) == len([m for m in conv if m["role"] == "assistant"])
    assert all(any(a in b for b in bracketed) for a in answers), bracketed


def text_of(tok: HFTokenizer, ids: list[int], mask: list[bool]) -> list[str]:
    """The masked stretches of a conversation, as text."""
    runs, run = [], []
    for i, on in zip(ids, mask, strict=True):
        if on:
            run.append(i)
        elif run:
            runs.append(run)
            run = []
    if run:
        runs.append(run)
    return [tok.tok.decode(r, skip_special_tokens=False) for r in runs]


NOT_BY_RENDERING = ("chat_template: the tokenizer's chat template renders the conversation before answer {i} of "
                    "test differently on its own, so where the answer lies cannot be found by rendering; give a "
                    "template that marks answers with {{% generation %}} (--chat-template FILE; TRL ships one per "
                    "model as chat_templates/<model>_training.jinja)")
# On the model's own template: the answers' text as the rule finds it, or the one-line refusal.
OWN = {
    ("qwen2_5", "tools"): ['<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
                           "<|im_end|>\n", "Clear, 21 C.<|im_end|>\n", "I can only see today.<|im_end|>\n"],
    ("llama3", "plain"): ["Seven.<|eot_id|>", "Eleven.<|eot_id|>"],
    ("phi3_5", "plain"): ["Seven.<|end|>\n", "Eleven.<|end|>\n<|endoftext|>"],
    ("gemma3", "plain"): ["Seven.<end_of_turn>\n", "Eleven.<end_of_turn>\n"],
    # The reasoning of an answer before the last question is dropped once the question follows.
    ("qwen3", "thinking"): ["Seven.<|im_end|>\n",
                            "<think>\nNext after seven is eleven.\n</think>\n\nEleven.<|im_end|>\n"],
    # GLM ends a turn with the next role's token, which the rule (the turn as it ends alone) leaves out.
    ("glm4moe", "thinking"): ["\n<think></think>\nSeven.", "\n<think>Next after seven is eleven.</think>\nEleven."],
    # gpt-oss ends the last answer with <|return|> and an earlier one with <|end|>: the rule keeps only
    # what both forms share.
    ("gptoss", "thinking"): ["<|channel|>final<|message|>Seven.",
                             "<|channel|>analysis<|message|>Next after seven is eleven.<|end|><|start|>assistant"
                             "<|channel|>final<|message|>Eleven.<|return|>"],
    ("qwen3", "tools"): NOT_BY_RENDERING.format(i=4),
    ("glm4moe", "tools"): NOT_BY_RENDERING.format(i=4),
    ("gptoss", "tools"): NOT_BY_RENDERING.format(i=4),
    ("deepseekv3", "thinking"): NOT_BY_RENDERING.format(i=2),
    # DeepSeek-V3's own template joins a tool call's arguments as a string: a dict (the documented form) fails.
    ("deepseekv3", "tools"): "chat_template: the tokenizer's chat template refused test: can only concatenate str "
                             '(not "dict") to str',
}
CONVERSATIONS = {"tools": WITH_TOOLS, "plain": PLAIN, "thinking": THINKING}


@pytest.mark.parametrize(("name", "conv"), list(OWN), ids=[f"{n}-{c}" for n, c in OWN])
def test_on_the_model_s_own_template_the_mask_follows_the_documented_rule_or_refuses_in_one_line(tmp_path, name, conv):
    own, _ = templates(name)
    expected = OWN[name, conv]
    if isinstance(expected, str):
        with pytest.raises(UserError) as e:
            masks(tmp_path, name, own, CONVERSATIONS[conv])
        assert str(e.value) == expected
        return
    ids, mask, made = masks(tmp_path, name, own, CONVERSATIONS[conv])
    assert text_of(made["tokenizer"], ids, mask) == expected


@pytest.mark.parametrize("name", ["qwen2_5", "llama3", "phi3_5", "gemma3"])
def test_where_the_own_template_renders_as_the_marked_one_the_rule_differs_only_by_the_generation_prompt(
        tmp_path, name):
    """Qwen 2.5's marked variant opens the mark before the newline that ends its generation prompt
    (`<|im_start|>assistant\\n`), so its mask holds that newline too; the others' agree exactly."""
    own, marked = templates(name)
    conv = MODELS[name]
    ids_own, mask_own, made = masks(tmp_path / "own", name, own, conv)
    ids_marked, mask_marked, _ = masks(tmp_path / "marked", name, marked, conv)
    assert ids_own == ids_marked
    lead = "\n" if name == "qwen2_5" else ""
    assert text_of(made["tokenizer"], ids_marked, mask_marked) == [
        lead + t for t in text_of(made["tokenizer"], ids_own, mask_own)]
