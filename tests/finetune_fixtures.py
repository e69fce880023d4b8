"""Fine-tuning fixtures: chat templates as the model families write them, a small tokenizer with
their special tokens, conversations, a tiny Qwen 2.5 directory as the hub ships one, and a local
lm-evaluation-harness task; no torch (fsdpkit's model from such a directory: tests/our_model.py)."""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Tokenizer as RustTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers

# Qwen 2.5's template in short (a default system turn), a Qwen 3-like one whose last answer alone
# carries an empty thinking block, and a Llama 3-like one that reads the tokenizer's bos_token.
QWEN25 = ("{%- if messages[0]['role'] == 'system' %}{{- '<|im_start|>system\\n' + messages[0]['content'] + "
          "'<|im_end|>\\n' }}{%- else %}{{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}"
          "{%- endif %}{%- for message in messages %}{%- if message.role != 'system' or not loop.first %}"
          "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}{%- endif %}"
          "{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")
QWEN3 = ("{%- for message in messages %}{%- if message.role == 'assistant' and loop.last %}"
         "{{- '<|im_start|>assistant\\n<think>\\n\\n</think>\\n\\n' + message.content + '<|im_end|>\\n' }}"
         "{%- else %}{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}{%- endif %}"
         "{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")
LLAMA3 = ("{{ bos_token }}{% for m in messages %}{{ '<|start_header_id|>' + m['role'] + '<|end_header_id|>\\n\\n' + "
          "m['content'] | trim + '<|eot_id|>' }}{% endfor %}{% if add_generation_prompt %}"
          "{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}")
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|begin_of_text|>", "<|start_header_id|>",
           "<|end_header_id|>", "<|eot_id|>"]

CONVERSATIONS = [
    [{"role": "system", "content": "You add numbers."}, {"role": "user", "content": "What is 2 plus 3?"},
     {"role": "assistant", "content": "2 plus 3 is 5."}, {"role": "user", "content": "And 4 plus 4?"},
     {"role": "assistant", "content": "8."}],
    [{"role": "user", "content": "Say hi."}, {"role": "assistant", "content": "Hi!"}],
]


def make_tokenizer(path: Path, template: str) -> Path:
    """A small byte-level BPE with the chat markers as special tokens, saved as transformers saves one."""
    tok = RustTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    texts = [m["content"] for c in CONVERSATIONS for m in c] * 20 + ["system user assistant think"] * 20
    tok.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=400, special_tokens=SPECIAL, show_progress=False,
                                                       initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    path.mkdir(parents=True, exist_ok=True)
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({
        "eos_token": "<|im_end|>", "bos_token": "<|begin_of_text|>", "tokenizer_class": "PreTrainedTokenizerFast",
        "chat_template": template}))
    return path


def tiny_qwen(path: Path, transformers) -> Path:
    """A Qwen2.5-shaped model directory with its tokenizer and chat template (as the hub's)."""
    make_tokenizer(path, QWEN25)
    vocab = RustTokenizer.from_file(str(path / "tokenizer.json")).get_vocab_size()
    transformers.Qwen2ForCausalLM(transformers.Qwen2Config(
        vocab_size=vocab, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, tie_word_embeddings=True)).save_pretrained(path)
    return path


def chat_records(n: int = 200) -> list[dict]:
    return [{"messages": [{"role": "user", "content": f"What is {i % 20} plus {i // 20}?"},
                          {"role": "assistant", "content": f"{i % 20 + i // 20}."}]} for i in range(n)]


TASK = """task: {name}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
"""


PERPLEXITY_TASK = """task: {name}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: loglikelihood
doc_to_text: "{{{{context}}}}"
doc_to_target: " {{{{target}}}}"
metric_list:
  - metric: perplexity
    aggregation: perplexity
    higher_is_better: false
  - metric: acc
    aggregation: mean
    higher_is_better: true
"""


def perplexity_task(folder: Path, pairs: list[tuple[str, str]], name: str = "fsdpkit_tiny_ppl") -> Path:
    """A local last-word task (LAMBADA's kind): its perplexity's standard error is bootstrapped, and
    the harness prints that it does so."""
    folder.mkdir(exist_ok=True)
    data = folder / f"{name}.jsonl"
    data.write_text("".join(json.dumps({"context": c, "target": t}) + "\n" for c, t in pairs))
    (folder / f"{name}.yaml").write_text(PERPLEXITY_TASK.format(name=name, data=data))
    return folder


def local_task(folder: Path, questions: list[tuple[str, list[str], int]], name: str = "fsdpkit_tiny_mc") -> Path:
    """A multiple-choice task of lm-evaluation-harness on local data: it runs offline."""
    folder.mkdir(exist_ok=True)
    data = folder / f"{name}.jsonl"
    data.write_text("".join(json.dumps({"question": q, "choices": c, "answer": a}) + "\n" for q, c, a in questions))
    (folder / f"{name}.yaml").write_text(TASK.format(name=name, data=data))
    return folder
