"""Which chat template a run renders with, the Jinja environment it renders in (transformers'), and
where each answer lies in the render: every case pinned to its exact text and characters."""

from __future__ import annotations

import datetime
import json
import threading
import time

import numpy as np
import pytest

from fsdpkit.errors import UserError
from fsdpkit.train.data import ByteTokenizer
from fsdpkit.train.data.chat import Conversation, conversation_of, encode_conversation
from fsdpkit.train.data.chat_template import CHATML, RENDER_GROWTH, RENDER_MIN_CHARS, ChatTemplate, template_of

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
    assert str(e.value) == ("chat_template: d.jinja renders answer 1 of a conversation differently once later turns "
                            "follow, and its text is not in the render")
    backwards = "{% for m in messages | reverse %}{{ m['content'] }}|{% endfor %}"
    with pytest.raises(UserError) as e:
        ChatTemplate(backwards, {}, "r.jinja").assistant_spans(convo)
    assert str(e.value) == ("chat_template: r.jinja renders the conversation before answer 1 of a conversation "
                            "differently on its own, so where the answer lies cannot be found by rendering; give a "
                            "template that marks answers with {% generation %} (--chat-template FILE; TRL ships one "
                            "per model as chat_templates/<model>_training.jinja)")


def test_each_piece_is_tokenised_apart_and_masked_on_the_answers_alone():
    calls = []

    def encode(text: str) -> np.ndarray:
        calls.append(text)
        return ByteTokenizer().encode(text)

    ids, mask = encode_conversation(CHAT, encode, Conversation(TURNS[1:3]))
    text = "<|im_start|>user\nq1<|im_end|>\n<|im_start|>assistant\na1<|im_end|>\n"
    assert calls == [text[:52], text[52:]]   # the prompt, then the answer; the empty tail is not encoded
    assert ids.tolist() == list(text.encode()) and ids.dtype == np.int64
    assert mask.tolist() == [False] * 52 + [True] * 13
    with pytest.raises(UserError) as e:
        encode_conversation(ChatTemplate("", {}, "empty.jinja"), encode, Conversation(QA, None, "d.jsonl:4"))
    assert str(e.value) == ("chat_template: empty.jinja leaves nothing to train on in d.jsonl:4: no character of its "
                            "answers is an assistant turn; check the template")


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
    assert conversation_of({"messages": convo}) == Conversation(convo)
    assert conversation_of({"prompt": [{"role": "system", "content": "s"}, {"role": "user", "content": "q"}],
                            "completion": "a"}).messages[-1] == {"role": "assistant", "content": "a"}


SILENT_LOOP = ("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
               "{{ messages[0].content }}")


def test_a_render_past_its_deadline_is_refused_and_the_next_render_in_that_thread_is_not():
    slow = ChatTemplate(SILENT_LOOP, {}, "slow.jinja", seconds=0.3)
    with pytest.raises(UserError) as e:
        slow.render(QA, where="d.jsonl:7")
    assert str(e.value) == ("chat_template: slow.jinja did not finish rendering d.jsonl:7 within 0.3 s: it loops "
                            "without bound; check the template")
    quick = ChatTemplate(CHATML, {}, "chatml", seconds=0.3)
    for _ in range(3):   # the watchdog fired once; renders after it run to their end
        assert quick.render(QA) == "<|im_start|>user\nq<|im_end|>\n<|im_start|>assistant\na<|im_end|>\n"
        time.sleep(0.2)


def test_a_render_in_another_thread_is_bounded_too():
    """The trainer renders in the prefetcher's thread: the deadline reaches it there."""
    slow = ChatTemplate(SILENT_LOOP, {}, "slow.jinja", seconds=0.3)
    said: list[str] = []

    def render() -> None:
        try:
            slow.render(QA)
        except UserError as e:
            said.append(str(e))

    worker = threading.Thread(target=render)
    worker.start()
    worker.join(30)
    assert said == ["chat_template: slow.jinja did not finish rendering a conversation within 0.3 s: it loops without "
                    "bound; check the template"]


def test_output_past_its_budget_is_refused_as_soon_as_it_is_written():
    budget = RENDER_MIN_CHARS + RENDER_GROWTH * len(json.dumps([QA, None]))
    loud = ChatTemplate("{% for i in range(1000) %}{% for j in range(1000) %}{{ '0123456789' }}{% endfor %}"
                        "{% endfor %}", {}, "loud.jinja")
    with pytest.raises(UserError) as e:
        loud.render(QA)
    assert str(e.value) == (f"chat_template: loud.jinja wrote more than {budget} characters for a conversation, "
                            f"which holds {len(json.dumps([QA, None]))} characters: it loops without bound; check "
                            "the template")
    assert budget == 1048576 + 16 * 81
    # Exactly the budget is still a render; one more character is not.
    exact = "{% for i in range(" + str(budget // 16) + ") %}{{ '0123456789abcdef' }}{% endfor %}"
    assert len(ChatTemplate(exact, {}).render(QA)) == budget
    with pytest.raises(UserError, match="wrote more than"):
        ChatTemplate(exact + "!", {}).render(QA)


@pytest.mark.parametrize(("source", "says"), [
    ("{{ 'x' * 2000000 }}", "a repetition of 2000000 items"),
    ("{{ 2000000 * 'x' }}", "a repetition of 2000000 items"),
    ("{{ [1] * 2000000 }}", "a repetition of 2000000 items"),
    ("{{ 10 ** 100000 }}", "a power of 100000"),
])
def test_one_step_that_would_build_something_huge_is_refused(source, says):
    with pytest.raises(UserError) as e:
        ChatTemplate(source, {}, "big.jinja").render(QA)
    assert str(e.value) == f"chat_template: big.jinja refused a conversation: {says}"
    assert ChatTemplate("{{ 'ab' * 3 }}{{ 3 * 'c' }}{{ 2 ** 10 }}{{ 6 * 7 }}", {}).render(QA) == "abababccc102442"
    assert ChatTemplate("{{ ('x' * 1048576) | length }}", {}).render(QA) == "1048576"   # the edge itself
    with pytest.raises(UserError, match="a repetition of 1048577 items"):
        ChatTemplate("{{ ('xy' * 524288) ~ ('x' * 1048577) }}", {}).render(QA)
    assert ChatTemplate("{{ (2 ** 1024) > 0 }}", {}).render(QA) == "True"
    with pytest.raises(UserError, match="a power of 1025"):
        ChatTemplate("{{ 2 ** 1025 }}", {}).render(QA)


def test_the_template_s_own_failure_on_a_record_is_one_line_naming_it():
    joins = ChatTemplate("{{ messages[0]['content'] + messages[0]['tool_calls'] }}", {}, "j.jinja")
    with pytest.raises(UserError) as e:
        joins.render([{"role": "user", "content": "q", "tool_calls": [{"name": "f"}]}], where="r.jsonl:2")
    assert str(e.value) == 'chat_template: j.jinja refused r.jsonl:2: can only concatenate str (not "list") to str'


def test_generation_marks_are_the_spans_in_order_joined_where_they_touch():
    source = ("{% for m in messages %}{% if m.role == 'assistant' %}<a>{% generation %}{{ m.content }}"
              "{% endgeneration %}{% generation %}|{% endgeneration %}{% generation %}{% endgeneration %}"
              "{% else %}<u>{{ m.content }}{% endif %}{% endfor %}")
    chat = ChatTemplate(source, {}, "g.jinja")
    assert chat.marks_generation and not ChatTemplate(CHATML, {}).marks_generation
    text, spans = chat.assistant_spans(TURNS[1:])
    assert text == "<u>q1<a>a1|<u>q2<a>a2|"
    assert spans == [(8, 11), (19, 22)]
    assert [text[a:b] for a, b in spans] == ["a1|", "a2|"]
    # Marks are read with the template's own whitespace control.
    assert ChatTemplate("{%- generation -%} x {%- endgeneration -%}", {}).marks_generation


def test_reasoning_reaches_the_template_under_both_names_and_tools_as_given():
    source = ("{% for m in messages %}{{ m.role }}:{{ m.reasoning_content }}/{{ m.thinking }}/{{ m.content }};"
              "{% endfor %}{{ tools | tojson }}")
    chat = ChatTemplate(source, {}, "r.jinja")
    convo = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a", "reasoning": "r1"},
             {"role": "assistant", "content": "b", "thinking": "r2"},
             {"role": "assistant", "content": "c", "reasoning_content": "r3", "thinking": "other"}]
    tools = [{"type": "function", "function": {"name": "f"}}]
    assert chat.render(convo, tools=tools) == ('user://q;assistant:r1/r1/a;assistant:r2/r2/b;assistant:r3/other/c;'
                                               '[{"type": "function", "function": {"name": "f"}}]')
    assert convo[1] == {"role": "assistant", "content": "a", "reasoning": "r1"}   # the record is left as it was


def test_an_answer_rendered_without_its_reasoning_once_followed_keeps_its_tool_call_and_end_marker():
    """Qwen 3's way: reasoning shown on the last answers only; an earlier tool call keeps its turn."""
    source = ("{% for m in messages %}<|{{ m.role }}|>"
              "{% if m.role == 'assistant' and loop.last and m.reasoning_content %}<think>{{ m.reasoning_content }}"
              "</think>{% endif %}{{ m.content }}{% for c in m.tool_calls or [] %}<call>{{ c.function.name }}</call>"
              "{% endfor %}<|end|>{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}")
    call = {"type": "function", "function": {"name": "lookup", "arguments": {}}}
    convo = [{"role": "user", "content": "q"},
             {"role": "assistant", "content": "", "reasoning_content": "think", "tool_calls": [call]},
             {"role": "tool", "content": "42"}, {"role": "assistant", "content": "It is 42."}]
    text, spans = ChatTemplate(source, {}, "q3.jinja").assistant_spans(convo)
    assert text == ("<|user|>q<|end|><|assistant|><call>lookup</call><|end|><|tool|>42<|end|><|assistant|>"
                    "It is 42.<|end|>")
    assert [text[a:b] for a, b in spans] == ["<call>lookup</call><|end|>", "It is 42.<|end|>"]


def test_an_end_marker_that_changes_once_followed_is_kept_only_up_to_a_whole_marker():
    source = ("{% for m in messages %}{{ m.role }}:{{ m.content }}<|end|>\n"
              "{% if loop.last and m.role == 'assistant' %}<|eos|>{% endif %}"
              "{% endfor %}{% if add_generation_prompt %}assistant:{% endif %}")
    convo = [*QA, {"role": "user", "content": "q2"}, {"role": "assistant", "content": "a2"}]
    text, spans = ChatTemplate(source, {}, "e.jinja").assistant_spans(convo)
    assert [text[a:b] for a, b in spans] == ["a<|end|>\n", "a2<|end|>\n<|eos|>"]
    cut = source.replace("<|end|>\n", "<|end|>").replace("<|eos|>", "<|eos")
    text, spans = ChatTemplate(cut, {}, "c.jinja").assistant_spans(convo)
    assert [text[a:b] for a, b in spans] == ["a<|end|>", "a2<|end|><|eos"]


@pytest.mark.parametrize("record", [
    {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "tool_calls": "f"}]},
    {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "tool_calls": []}]},
    {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "tool_calls": ["f"]}]},
    {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": 3, "tool_calls": [{}]}]},
    {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a", "reasoning_content": 1}]},
    {"messages": [{"role": "user", "content": "q"}, {"role": "user", "tool_calls": [{}]}]},
    {"messages": QA, "tools": {"name": "f"}},
    {"messages": QA, "tools": ["f"]},
])
def test_records_with_malformed_tool_calls_reasoning_or_tools_are_none(record):
    assert conversation_of(record) is None


def test_a_record_with_tool_calls_results_reasoning_and_tools_is_a_conversation():
    call = {"type": "function", "function": {"name": "f", "arguments": {"x": 1}}}
    messages = [{"role": "user", "content": "q"},
                {"role": "assistant", "tool_calls": [call], "reasoning_content": "why"},
                {"role": "tool", "content": "1", "tool_call_id": "0"},
                {"role": "assistant", "content": None, "tool_calls": [{"name": "g", "arguments": "{}"}]},
                {"role": "assistant", "content": "done", "thinking": "t"}]
    tools = [{"type": "function", "function": {"name": "f"}}]
    assert conversation_of({"messages": messages, "tools": tools}, "here") == Conversation(messages, tools, "here")
    assert conversation_of({"messages": messages, "tools": []}).tools is None


def test_an_answer_the_render_leaves_out_of_its_turns_is_refused_naming_the_record():
    calls = "{% for m in messages %}{{ m.role }}:{{ m.content }}|{% endfor %}"
    convo = Conversation([{"role": "user", "content": "q"},
                          {"role": "assistant", "content": None, "tool_calls": [{"function": {"name": "lookup"}}]}],
                         None, "t.jsonl:3")
    with pytest.raises(UserError) as e:
        encode_conversation(ChatTemplate(calls, {}, "c.jinja"), ByteTokenizer().encode, convo)
    assert str(e.value) == ("chat_template: c.jinja leaves answer 1 of t.jsonl:3 ('lookup') out of the text it trains "
                            "on; check that it renders each message's content")
    long = Conversation([{"role": "user", "content": "q"}, {"role": "assistant", "content": "x" * 50}], None, "l")
    with pytest.raises(UserError) as e:
        encode_conversation(ChatTemplate("{% for m in messages %}{{ m.role }}|{% endfor %}", {}, "y.jinja"),
                            ByteTokenizer().encode, long)
    assert str(e.value) == (f"chat_template: y.jinja leaves answer 1 of l ('{'x' * 37}...') out of the text it trains "
                            "on; check that it renders each message's content")
    # Its text in the turns, after reasoning the template moved: accepted.
    moved = Conversation([{"role": "user", "content": "q"},
                          {"role": "assistant", "content": "<think>r</think>\n answer "}])
    ids, mask = encode_conversation(ChatTemplate(CHATML, {}), ByteTokenizer().encode, moved)
    assert ByteTokenizer().decode(ids[mask]) == "<think>r</think>\n answer <|im_end|>\n"


# An earlier answer's reasoning ("[...]") dropped once a later turn follows, as Qwen 3's template drops it.
DROPS_REASONING = ("{% for m in messages %}{% if m.role == 'assistant' %}<a>"
                   "{% if loop.last and m.reasoning_content %}[{{ m.reasoning_content }}]{% endif %}"
                   "{{ m.content }}{% for c in m.tool_calls or [] %}<c>{{ c.function.name }}</c>{% endfor %}<e>"
                   "{% else %}<u>{{ m.content }}<e>{% endif %}{% endfor %}{% if add_generation_prompt %}<a>{% endif %}")


@pytest.mark.parametrize(("answer", "trained"), [
    ({"content": "Yes.", "reasoning_content": "r"}, "Yes.<e>"),                      # shorter than any probe
    ({"content": "A much longer answer than sixteen.", "reasoning_content": "r"},
     "A much longer answer than sixteen.<e>"),
    ({"content": "", "reasoning_content": "r",
      "tool_calls": [{"function": {"name": "f"}}, {"function": {"name": "g"}}]}, "<c>f</c><c>g</c><e>"),
])
def test_an_answer_whose_front_is_dropped_once_followed_keeps_the_rest_of_its_turn(answer, trained):
    convo = [{"role": "user", "content": "q"}, {"role": "assistant", **answer}, {"role": "user", "content": "q2"},
             {"role": "assistant", "content": "last"}]
    text, spans = ChatTemplate(DROPS_REASONING, {}, "d.jinja").assistant_spans(convo)
    assert [text[a:b] for a, b in spans] == [trained, "last<e>"]


def test_an_end_that_holds_none_of_the_answer_is_not_taken_for_it():
    """Alone the answer renders `A<e>`; followed, the template writes `B<e>` in its place: the turns
    share only `<e>`, which holds nothing the answer says, so the answer is not found."""
    source = ("{% for m in messages %}{% if m.role == 'assistant' %}<a>{% if loop.last %}{{ m.content }}{% else %}B"
              "{% endif %}<e>{% else %}<u>{{ m.content }}<e>{% endif %}{% endfor %}"
              "{% if add_generation_prompt %}<a>{% endif %}")
    convo = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "A"},
             {"role": "user", "content": "q2"}, {"role": "assistant", "content": "C"}]
    with pytest.raises(UserError) as e:
        ChatTemplate(source, {}, "w.jinja").assistant_spans(convo, where="x:1")
    assert str(e.value) == ("chat_template: w.jinja renders answer 1 of x:1 differently once later turns follow, and "
                            "its text is not in the render")
