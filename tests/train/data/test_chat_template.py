"""Which chat template a run renders with, the Jinja environment it renders in (transformers'), and
where each answer lies in the render: every case pinned to its exact text and characters."""

from __future__ import annotations

import datetime

import numpy as np
import pytest

from fsdpkit.errors import UserError
from fsdpkit.train.data import ByteTokenizer
from fsdpkit.train.data.chat import CHATML, ChatTemplate, conversation_of, encode_conversation, template_of

CONFIG = {"bos_token": "<s>", "eos_token": {"content": "</s>", "lstrip": False}, "unk_token": "<unk>",
          "pad_token": {"content": "<pad>"}, "sep_token": "<sep>", "cls_token": None}
# Only the four special tokens transformers passes, as text (an AddedToken mapping by its content).
SPECIAL = {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "pad_token": "<pad>"}
QA = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]


def test_a_built_in_name_gives_that_template_with_the_tokenizer_s_special_tokens():
    chat = template_of("chatml", {**CONFIG, "chat_template": "{{ 'own' }}"}, None)
    assert (chat.source, chat.special_tokens, chat.name) == (CHATML, SPECIAL, "chatml")


def test_a_file_given_wins_over_the_tokenizer_s_own_and_is_named_by_its_path(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / "t.jinja").write_text("{{ bos_token }}{{ messages[0]['content'] }}")
    chat = template_of("~/t.jinja", {**CONFIG, "chat_template": "{{ 'own' }}"}, None)
    assert chat.name == str(tmp_path / "t.jinja")
    assert chat.render(QA) == "<s>q"


def test_a_spec_that_is_neither_a_file_nor_a_built_in_is_refused_naming_the_built_ins(tmp_path):
    with pytest.raises(UserError) as e:
        template_of(str(tmp_path / "none.jinja"), {}, None)
    assert str(e.value) == f"chat_template: {tmp_path / 'none.jinja'} is neither a file nor one of: chatml"


def test_the_tokenizer_s_own_template_a_string_or_the_default_of_named_ones(tmp_path):
    (tmp_path / "chat_template.jinja").write_text("{{ 'file' }}")
    own = template_of(None, {**CONFIG, "chat_template": "{{ eos_token }}own"}, tmp_path)
    assert (own.render(QA), own.name, own.special_tokens) == ("</s>own", "the tokenizer's chat template", SPECIAL)
    named = [{"name": "tool_use", "template": "{{ 'tools' }}"}, "junk", {"name": "default", "template": "{{ 'dflt' }}"}]
    assert template_of(None, {"chat_template": named}, tmp_path).render(QA) == "dflt"


def test_without_its_own_the_template_file_beside_the_tokenizer_then_chatml(tmp_path):
    (tmp_path / "chat_template.jinja").write_text("{{ 'file' }}")
    no_default = [{"name": "tool_use", "template": "{{ 'tools' }}"}]
    for config in ({}, {"chat_template": no_default}, {"chat_template": 3}):
        chat = template_of(None, config, tmp_path)
        assert (chat.render(QA), chat.name) == ("file", str(tmp_path / "chat_template.jinja"))
    odd = {"bos_token": 1, "eos_token": {"content": 2}, "pad_token": None}
    assert template_of(None, odd, None).special_tokens == {}
    for directory in (None, tmp_path / "elsewhere"):
        chat = template_of(None, {"eos_token": "</s>"}, directory)
        assert (chat.source, chat.name, chat.special_tokens) == (
            CHATML, "chatml (the tokenizer has no chat template)", {"eos_token": "</s>"})


@pytest.mark.parametrize("given", [True, False])
def test_a_template_file_that_is_not_text_is_one_line_naming_it(tmp_path, given):
    file = tmp_path / ("t.jinja" if given else "chat_template.jinja")
    file.write_bytes(b"\xff\xfe{{ x }}")
    with pytest.raises(UserError) as e:
        template_of(str(file) if given else None, {}, tmp_path)
    assert str(e.value) == (f"chat_template: cannot read {file}: not text (not UTF-8 at byte 0); check the file, "
                            "or point at another one")
    with pytest.raises(UserError) as e:
        template_of("nope", {}, None)
    assert str(e.value) == "chat_template: nope is neither a file nor one of: chatml"


def render(source: str, messages=QA, **special) -> str:
    return ChatTemplate(source, special, "t").render(messages)


def test_block_tags_leave_no_newline_or_indent_as_transformers_compiles_them():
    source = ("{% for m in messages %}\n    {% if m['role'] == 'user' %}\nU:{{ m['content'] }}\n    {% endif %}\n"
              "{% endfor %}")
    assert render(source) == "U:q\n"


def test_tojson_keeps_non_ascii_and_html_and_takes_json_s_arguments():
    value = {"b": "é<&>", "a": [1, 2]}
    special = {"x": value}
    assert ChatTemplate("{{ x | tojson }}", special).render(QA) == '{"b": "é<&>", "a": [1, 2]}'
    assert ChatTemplate("{{ x | tojson(indent=1) }}", special).render(QA) == \
        '{\n "b": "é<&>",\n "a": [\n  1,\n  2\n ]\n}'
    assert ChatTemplate("{{ x | tojson(sort_keys=true, separators=(',', ':')) }}", special).render(QA) == \
        '{"a":[1,2],"b":"é<&>"}'
    assert ChatTemplate("{{ x | tojson(ensure_ascii=true) }}", special).render(QA) == \
        '{"b": "\\u00e9<&>", "a": [1, 2]}'


def test_raise_exception_refuses_the_conversation_with_the_template_s_words():
    chat = ChatTemplate("{% if messages[0]['role'] != 'system' %}{{ raise_exception('needs a system turn') }}"
                        "{% endif %}", {}, "my.jinja")
    with pytest.raises(UserError) as e:
        chat.render(QA)
    assert str(e.value) == "chat_template: my.jinja refused a conversation: needs a system turn"


def test_strftime_now_is_today_and_loop_controls_work():
    assert render("{{ strftime_now('%Y-%m-%d') }}") == datetime.datetime.now().strftime("%Y-%m-%d")
    assert render("{% for m in messages %}{% if loop.index > 1 %}{% break %}{% endif %}{{ m['role'] }}"
                  "{% endfor %}") == "user"
    assert render("{% for m in messages %}{% if m['role'] == 'user' %}{% continue %}{% endif %}{{ m['role'] }}"
                  "{% endfor %}") == "assistant"


def test_a_generation_block_renders_its_body():
    source = ("{% for m in messages %}{% if m['role'] == 'assistant' %}{% generation %}[{{ m['content'] }}]"
              "{% endgeneration %}{% else %}{{ m['content'] }}{% endif %}{% endfor %}")
    chat = ChatTemplate(source, {}, "t")
    assert chat.render(QA) == "q[a]"
    assert chat.assistant_spans(QA) == ("q[a]", [(1, 4)])


def test_the_sandbox_refuses_a_template_that_changes_the_conversation():
    with pytest.raises(UserError, match=r"^chat_template: t refused a conversation: .*append"):
        render("{{ messages.append(1) }}")


def test_a_template_that_does_not_parse_is_refused_by_name():
    with pytest.raises(UserError) as e:
        ChatTemplate("{% for m in messages %}", {}, "bad.jinja")
    assert str(e.value).startswith("chat_template: bad.jinja is not a valid Jinja template: Unexpected end of template")


CHAT = ChatTemplate(CHATML, {}, "chatml")
TURNS = [{"role": "system", "content": "s"}, {"role": "user", "content": "q1"}, {"role": "assistant", "content": "a1"},
         {"role": "user", "content": "q2"}, {"role": "assistant", "content": "a2"}]


def test_each_answer_spans_its_text_and_end_of_turn_from_after_its_header():
    text, spans = CHAT.assistant_spans(TURNS)
    assert text == ("<|im_start|>system\ns<|im_end|>\n<|im_start|>user\nq1<|im_end|>\n<|im_start|>assistant\n"
                    "a1<|im_end|>\n<|im_start|>user\nq2<|im_end|>\n<|im_start|>assistant\na2<|im_end|>\n")
    assert [text[a:b] for a, b in spans] == ["a1<|im_end|>\n", "a2<|im_end|>\n"]
    assert spans == [(83, 96), (148, 161)]


def test_a_conversation_that_opens_with_an_answer_spans_from_the_first_character():
    opens = [{"role": "assistant", "content": "hi"}, {"role": "user", "content": "yo"}]
    text, spans = ChatTemplate("{% for m in messages %}{{ m['content'] }};{% endfor %}", {}).assistant_spans(opens)
    assert (text, spans) == ("hi;yo;", [(0, 3)])
    # No prompt before it, not even the generation prompt: its header is the answer's.
    text, spans = CHAT.assistant_spans(opens)
    assert spans == [(0, 35)] and text[:35] == "<|im_start|>assistant\nhi<|im_end|>\n"
    # Rendered otherwise when followed (its marker), and found at the very start.
    marks = ("{% for m in messages %}{% if m['role'] == 'assistant' %}{{ m['content'] }}{% if loop.last %}!{% endif %};"
             "{% else %}U{{ m['content'] }};{% endif %}{% endfor %}")
    assert ChatTemplate(marks, {}).assistant_spans(opens) == ("hi;Uyo;", [(0, 2)])


# Qwen 3's way: an earlier answer loses its reasoning block once later turns follow.
DROPS = ("{% for m in messages %}{% if m['role'] == 'assistant' %}A:{% if loop.last %}<think></think>{% endif %}"
         "{{ m['content'] }}<end>{% else %}U:{{ m['content'] }}<end>{% endif %}{% endfor %}"
         "{% if add_generation_prompt %}A:{% endif %}")


def test_an_answer_rendered_otherwise_when_followed_is_found_by_its_text_with_its_end_marker():
    convo = [{"role": "user", "content": "q1"}, {"role": "assistant", "content": "a1"},
             {"role": "user", "content": "q2"}, {"role": "assistant", "content": "a2"}]
    text, spans = ChatTemplate(DROPS, {}).assistant_spans(convo)
    assert text == "U:q1<end>A:a1<end>U:q2<end>A:<think></think>a2<end>"
    assert [text[a:b] for a, b in spans] == ["a1<end>", "<think></think>a2<end>"]
    assert spans == [(11, 18), (29, 51)]


def test_an_answer_s_text_is_found_after_its_prompt_and_its_marker_after_its_last_occurrence():
    # The answer's text also in the prompt before it and in the question after it; and an answer
    # that is the header's own letter.
    convo = [{"role": "user", "content": "a1"}, {"role": "assistant", "content": "a1"},
             {"role": "user", "content": "a1"}, {"role": "assistant", "content": "A"}, {"role": "user", "content": "q"},
             {"role": "assistant", "content": "A"}]
    text, spans = ChatTemplate(DROPS, {}).assistant_spans(convo)
    assert text == "U:a1<end>A:a1<end>U:a1<end>A:A<end>U:q<end>A:<think></think>A<end>"
    assert spans == [(11, 18), (29, 35), (45, 66)]
    assert [text[a:b] for a, b in spans] == ["a1<end>", "A<end>", "<think></think>A<end>"]


def test_an_answer_whose_marker_changes_too_spans_its_text_alone():
    source = DROPS.replace("<end>{% else %}", "{% if loop.last %}<end>{% else %}<next>{% endif %}{% else %}")
    convo = [{"role": "user", "content": "q1"}, {"role": "assistant", "content": "a1"},
             {"role": "user", "content": "q2"}, {"role": "assistant", "content": "a2"}]
    text, spans = ChatTemplate(source, {}).assistant_spans(convo)
    assert text == "U:q1<end>A:a1<next>U:q2<end>A:<think></think>a2<end>"
    assert [text[a:b] for a, b in spans] == ["a1", "<think></think>a2<end>"]


def test_a_template_that_drops_an_earlier_answer_or_reorders_the_prompt_is_refused():
    convo = [{"role": "user", "content": "q1"}, {"role": "assistant", "content": "a1"},
             {"role": "user", "content": "q2"}, {"role": "assistant", "content": "a2"}]
    drops = "{% for m in messages %}{% if loop.last or m['role'] == 'user' %}{{ m['content'] }}|{% endif %}{% endfor %}"
    with pytest.raises(UserError) as e:
        ChatTemplate(drops, {}, "d.jinja").assistant_spans(convo)
    assert str(e.value) == "chat_template: d.jinja leaves answer 1's text out of the render"
    backwards = "{% for m in messages | reverse %}{{ m['content'] }}|{% endfor %}"
    with pytest.raises(UserError) as e:
        ChatTemplate(backwards, {}, "r.jinja").assistant_spans(convo)
    assert str(e.value) == ("chat_template: r.jinja renders the conversation before answer 1 differently on its own; "
                            "the answer's tokens cannot be found")


def test_each_piece_is_tokenised_apart_and_masked_on_the_answers_alone():
    calls = []

    def encode(text: str) -> np.ndarray:
        calls.append(text)
        return ByteTokenizer().encode(text)

    ids, mask = encode_conversation(CHAT, encode, TURNS[1:3])
    text = "<|im_start|>user\nq1<|im_end|>\n<|im_start|>assistant\na1<|im_end|>\n"
    assert calls == [text[:52], text[52:]]   # the prompt, then the answer; the empty tail is not encoded
    assert ids.tolist() == list(text.encode()) and ids.dtype == np.int64
    assert mask.tolist() == [False] * 52 + [True] * 13
    empty_ids, empty_mask = encode_conversation(ChatTemplate("", {}), encode, QA)
    assert (empty_ids.dtype, empty_ids.shape, empty_mask.dtype, empty_mask.shape) == (np.int64, (0,), bool, (0,))


@pytest.mark.parametrize("record", [
    "text", {"messages": []}, {"messages": "hi"}, {"prompt": "p"},
    {"messages": [{"role": "user", "content": "q"}, {"role": "bot", "content": "a"}]},
    {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": ["a"]}]},
    {"messages": [["user", "q"], {"role": "assistant", "content": "a"}]},
])
def test_records_that_hold_no_conversation_are_none(record):
    assert conversation_of(record) is None


def test_every_role_transformers_knows_is_accepted():
    convo = [{"role": r, "content": r} for r in ("system", "user", "assistant", "tool")]
    assert conversation_of({"messages": convo}) == convo
    assert conversation_of({"prompt": [{"role": "system", "content": "s"}, {"role": "user", "content": "q"}],
                            "completion": "a"})[-1] == {"role": "assistant", "content": "a"}
