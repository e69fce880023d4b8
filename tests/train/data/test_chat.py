"""Chat fine-tuning data: templates render as transformers renders them, the loss is taken on the
assistant's tokens alone (and equals transformers' on the same labels), packed conversations
never attend to each other."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from fsdpkit.errors import UserError
from fsdpkit.train.data import BatchStream, HFTokenizer, LocalFiles, get_source
from fsdpkit.train.data.chat import Conversation, conversation_of, encode_conversation
from fsdpkit.train.data.chat_template import ChatTemplate, template_of
from fsdpkit.train.data.stream import IGNORE
from fsdpkit.train.model.config import ModelConfig
from fsdpkit.train.model.transformer import Transformer

from conftest import require
from finetune_fixtures import CONVERSATIONS, LLAMA3, QWEN3, QWEN25, make_tokenizer
from our_model import load_ours


def write_chat(path, records) -> str:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


@pytest.mark.parametrize("template", [QWEN25, QWEN3, LLAMA3], ids=["qwen2.5", "qwen3", "llama3"])
def test_templates_render_as_transformers_renders_them(tmp_path, template):
    transformers = require("transformers")
    folder = make_tokenizer(tmp_path / "tok", template)
    theirs = transformers.AutoTokenizer.from_pretrained(str(folder))
    ours = HFTokenizer(str(folder))
    chat = template_of(None, ours.config, ours.directory)
    for conv in CONVERSATIONS:
        for prompt in (False, True):
            assert chat.render(conv, prompt) == theirs.apply_chat_template(conv, tokenize=False,
                                                                           add_generation_prompt=prompt)
        # Tokenising piece by piece (so no token straddles a turn) still gives transformers' ids here.
        ids, _ = encode_conversation(chat, ours.encode, Conversation(conv))
        assert ids.tolist() == list(theirs.apply_chat_template(conv, tokenize=True, return_dict=True)["input_ids"])


@pytest.mark.parametrize("template", [QWEN25, QWEN3, LLAMA3], ids=["qwen2.5", "qwen3", "llama3"])
def test_the_mask_covers_each_answer_and_its_end_of_turn_and_nothing_else(tmp_path, template):
    tok = HFTokenizer(str(make_tokenizer(tmp_path / "tok", template)))
    chat = template_of(None, tok.config, tok.directory)
    conv = CONVERSATIONS[0]
    ids, mask = encode_conversation(chat, tok.encode, Conversation(conv))
    def text(ids) -> str:
        return tok.tok.decode(ids.tolist(), skip_special_tokens=False)

    end = "<|eot_id|>" if template is LLAMA3 else "<|im_end|>\n"
    think = "<think>\n\n</think>\n\n" if template is QWEN3 else ""
    assert text(ids[mask]) == f"2 plus 3 is 5.{end}{think}8.{end}"
    assert "What is" in text(ids[~mask]) and "2 plus 3 is 5" not in text(ids[~mask])


@pytest.mark.parametrize("template", [QWEN25, LLAMA3], ids=["qwen2.5", "llama3"])
def test_the_batch_stream_puts_the_loss_on_each_answer_token_and_its_end_of_turn(tmp_path, template):
    """Through the stream the trainer reads: the targets that carry a loss are exactly the answers'
    tokens and their end-of-turn tokens, each predicted from the token before it; the prompt, the
    assistant header and the token after an answer carry none."""
    tok = HFTokenizer(str(make_tokenizer(tmp_path / "tok", template)))
    chat = template_of(None, tok.config, tok.directory)
    conv = CONVERSATIONS[0]
    n = len(encode_conversation(chat, tok.encode, Conversation(conv))[0])
    data = write_chat(tmp_path / "data" / "train" / "chat.jsonl", [{"messages": conv}] * 4)
    stream = BatchStream(LocalFiles(str(tmp_path / "data"), "train", 0, data_format="chat"), tok, 2 * n, 1,
                         shuffle_buffer=0, epochs=1, chat=chat)
    batch = next(iter(stream))
    assert data and batch.docs is not None
    targets, inputs = batch.targets[0, : n - 1], batch.inputs[0]   # the first conversation, from its start
    kept = targets != IGNORE
    end = "<|eot_id|>" if template is LLAMA3 else "<|im_end|>\n"
    assert tok.tok.decode(targets[kept].tolist(), skip_special_tokens=False) == f"2 plus 3 is 5.{end}8.{end}"
    assert torch.equal(targets[kept], inputs[1:n][kept])


def test_loss_counts_only_assistant_tokens_and_equals_transformers_on_the_same_labels(tmp_path):
    transformers = require("transformers")
    tok = HFTokenizer(str(make_tokenizer(tmp_path / "tok", QWEN25)))
    chat = template_of(None, tok.config, tok.directory)
    torch.manual_seed(0)
    hf = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(
        vocab_size=tok.vocab_size, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, tie_word_embeddings=True)).eval()
    hf.save_pretrained(tmp_path / "hf")
    ours = load_ours(tmp_path / "hf")

    def loss(conv) -> torch.Tensor:
        ids, mask = (torch.from_numpy(a) for a in encode_conversation(chat, tok.encode, Conversation(conv)))
        targets = torch.where(mask[1:], ids[1:], IGNORE)
        with torch.no_grad():
            return ours.loss(ids[None, :-1], targets[None])[0]

    # A user turn after the last answer: a loss on every token would move with it; ours must not.
    conv = [*CONVERSATIONS[0], {"role": "user", "content": "Thanks, bye."}]
    changed = [*CONVERSATIONS[0], {"role": "user", "content": "What is 9 plus 9 plus 9?"}]
    assert loss(conv).item() == loss(changed).item()
    # ... while a change to an answer does move it (the test can fail).
    assert loss(conv).item() != loss([*conv[:-2], {"role": "assistant", "content": "9."}, conv[-1]]).item()
    # The same labels given to transformers (which shifts them itself) give the same loss.
    ids, mask = encode_conversation(chat, tok.encode, Conversation(conv))
    with torch.no_grad():
        theirs = hf(input_ids=torch.from_numpy(ids)[None],
                    labels=torch.from_numpy(np.where(mask, ids, IGNORE))[None]).loss
    torch.testing.assert_close(loss(conv), theirs, rtol=0, atol=1e-5)


def test_packed_conversations_never_attend_to_each_other(tmp_path):
    tok = HFTokenizer(str(make_tokenizer(tmp_path / "tok", QWEN25)))
    chat = template_of(None, tok.config, tok.directory)
    data = write_chat(tmp_path / "data" / "train" / "chat.jsonl", [{"messages": c} for c in CONVERSATIONS * 8])
    source = LocalFiles(str(tmp_path / "data"), "train", 0, data_format="chat")
    stream = BatchStream(source, tok, 96, 2, shuffle_buffer=0, epochs=1, chat=chat)
    batch = next(iter(stream))
    assert batch.docs is not None and data
    # The targets are the tokens' successors on assistant tokens, IGNORE elsewhere.
    kept = batch.targets != IGNORE
    assert kept.any() and (~kept).any()
    assert torch.equal(batch.targets[:, :-1][kept[:, :-1]], batch.inputs[:, 1:][kept[:, :-1]])
    torch.manual_seed(0)
    model = Transformer(ModelConfig(vocab_size=tok.vocab_size, dim=64, n_layers=2, n_heads=4, n_kv_heads=2,
                                    ffn_dim=96, max_seq_len=128), rope_len=128)
    model.init_weights(seed=3)
    row, docs = batch.inputs[0], batch.docs[0]
    second = int(docs[-1])
    start = int((docs == second).nonzero()[0])
    assert start > 0  # a conversation that starts inside the block, after another one
    with torch.no_grad():
        packed = model(row[None], docs=docs[None])[0, start:]
        alone = model(row[None, start:])[0]
        leaky = model(row[None])[0, start:]
    torch.testing.assert_close(packed, alone, rtol=0, atol=1e-5)
    assert not torch.allclose(leaky, alone, atol=1e-3)  # without the mask it would see the one before


def test_chat_records_in_both_forms_and_bad_ones_counted(tmp_path):
    pair = {"prompt": "Double 4.", "completion": "8"}
    assert conversation_of(pair, "here") == Conversation(
        [{"role": "user", "content": "Double 4."}, {"role": "assistant", "content": "8"}], None, "here")
    listed = {"prompt": [{"role": "user", "content": "Hi"}], "completion": [{"role": "assistant", "content": "Yo"}]}
    assert conversation_of(listed).messages[-1] == {"role": "assistant", "content": "Yo"}
    assert conversation_of({"messages": [{"role": "user", "content": "no answer"}]}) is None
    assert conversation_of({"text": "plain"}) is None
    path = write_chat(tmp_path / "c.jsonl", [pair, {"text": "plain"}, {"messages": CONVERSATIONS[1]}])
    source = LocalFiles(path, "train", 0, data_format="chat")
    source.hold_out = False
    assert list(source.documents(0)) == [conversation_of(pair, f"{path}:1"),
                                         Conversation(CONVERSATIONS[1], None, f"{path}:3")]
    assert source.bad_records == 1
    with pytest.raises(UserError, match="the embedded corpus is plain text"):
        get_source("embedded", "train", 0, data_format="chat")
    assert ChatTemplate("{{ messages[0]['content'] }}", {}).render(CONVERSATIONS[1]) == "Say hi."
    with pytest.raises(UserError, match=r"chat_template: nope\.jinja is neither a file"):
        template_of("nope.jinja", {}, None)
