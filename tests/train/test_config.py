"""Configuration: reference flags, YAML precedence, validation, and one-line errors for bad input."""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path

import pytest
from raise_sites import raise_sites, unreached

from fsdpkit.envelope import Parser
from fsdpkit.errors import UserError
from fsdpkit.train import config
from fsdpkit.train.config import TrainOptions, parse_args, resolve

# The flags a reference job manifest passes (kubernetes/llama3_1_8b-fsdp.yaml), shrunk to run here.
REFERENCE_FLAGS = [
    "--max_context_width=128", "--num_key_value_heads=2", "--intermediate_size=96", "--hidden_width=64",
    "--num_layers=2", "--num_heads=4", "--model_type=llama_v3", "--checkpoint_freq=0",
    "--validation_freq=25", "--max_steps=7", "--train_batch_size=2", "--val_batch_size=1",
    "--sharding_strategy=full", "--offload_activations=1", "--activation_checkpointing=1", "--bf16=0",
    "--lr=0.0001", "--grad_clip=1.0", "--weight_decay=0.2", "--beta1=0.9", "--beta2=0.95", "--seed=9",
]


def test_reference_flags_map_to_fields(diagnostics):
    cfg = parse_args(REFERENCE_FLAGS)
    m = cfg.shape
    assert (m.dim, m.n_layers, m.n_heads, m.n_kv_heads, m.ffn_dim, m.family) == (64, 2, 4, 2, 96, "llama")
    assert cfg.data.seq_len == 128
    assert cfg.optim.max_steps == 7 and cfg.optim.lr == 1e-4 and cfg.seed == 9
    assert cfg.data.train_batch_size == 2 and cfg.data.val_batch_size == 1
    assert cfg.parallel.activation_checkpointing == "full"
    assert cfg.parallel.mixed_precision == "fp32"
    assert any(n.startswith("note: --offload_activations is accepted and ignored") for n in diagnostics)


def test_defaults_come_from_one_place():
    cfg = parse_args([])
    # The dataclass defaults, with the derived values written in (what config.yaml then records).
    assert cfg == resolve(TrainOptions())
    assert cfg.data.seq_len == 256 and cfg.data.val_batch_size == 16 and cfg.optim.min_lr == 3e-4
    assert cfg.preset == "tiny" and cfg.data.dataset == "embedded"


def test_yaml_then_flags(tmp_path: Path):
    y = tmp_path / "run.yaml"
    y.write_text("preset: debug\noptim:\n  max_steps: 11\n  lr: 0.01\nnum_layers: 3\n")
    cfg = parse_args(["--config", str(y), "--lr", "0.02"])
    assert cfg.preset == "debug" and cfg.optim.max_steps == 11 and cfg.optim.lr == 0.02
    assert cfg.shape.n_layers == 3


def test_yaml_unknown_key(tmp_path: Path):
    y = tmp_path / "run.yaml"
    y.write_text("optim:\n  max_stepz: 3\n")
    with pytest.raises(UserError, match="max_stepz"):
        parse_args(["--config", str(y)])


# Every rule between fields (`validate`) and every refusal of the flag parser, with the one line it
# gives: the field first, then what is allowed. Each row breaks exactly one rule.
RULES = {
    "heads not dividing dim": (["--dim", "130", "--n_heads", "4"], r"^n_heads: 4 must divide dim \(130\)"),
    "kv heads not dividing heads": (["--n_heads", "4", "--n_kv_heads", "3"],
                                    r"^n_kv_heads: 3 must divide n_heads \(4\)$"),
    "odd head size": (["--dim", "132", "--n_heads", "4"], r"^dim/n_heads: head size 33 must be even"),
    "more experts per token than experts": (["--n_experts", "2", "--experts_per_token", "3"],
                                            r"^experts_per_token: 3 must be <= n_experts \(2\)$"),
    "floor above peak": (["--lr", "1e-4", "--min_lr", "2e-4"], r"^min_lr: 0.0002 must be <= lr \(0.0001\)$"),
    "warm-up beyond the run": (["--max_steps", "10", "--warmup_steps", "11"],
                               r"^warmup_steps: 11 must be <= max_steps \(10\)$"),
    "auto resume without a directory": (["--resume_from_checkpoint", "auto"],
                                        r"^resume_from_checkpoint: 'auto' needs --checkpoint-dir"),
    "float8 on the CPU": (["--float8", "1", "--device", "cpu"], r"^float8: needs an NVIDIA GPU"),
    "checkpoints without a directory": (["--checkpoint_every", "10"], r"^checkpoint_every: needs --checkpoint-dir"),
    "a time cadence without a directory": (["--checkpoint_every", "30m"], r"^checkpoint_every: needs --checkpoint-dir"),
    "a memory tier with no durable one": (["--tiered", "1"], r"^tiered: needs --checkpoint-dir, the durable tier"),
    "durable saves never": (["--durable-every", "0"], r"^durable_every: .*>= 1"),
    "unknown flag": (["--max_step", "3"], r"^unknown option '--max_step'; did you mean --max-steps\?"),
    "flag without a value": (["--lr"], r"^argument --lr: expected one argument \(see `fsdpkit train --help`\)$"),
    "unknown choice": (["--lr_decay_style", "exponential"], r"^lr_decay_style: .*cosine.*linear.*constant"),
    "not a number": (["--lr", "abc"], r"^lr: expected a number, got 'abc'"),
    "below the range": (["--max_steps", "0"], r"^max_steps: .*>= 1"),
    "above the range": (["--min_lr_ratio", "2"], r"^min_lr_ratio: .*<= 1"),
    "a bad cadence": (["--checkpoint_every", "often"], r"^checkpoint_every: expected steps \(500\) or a wall time"),
    "experts in a Qwen model": (["--family", "qwen3", "--n_experts", "4"],
                                r"^n_experts: the qwen3 family has no mixture-of-experts form; use 0, or --family "
                                r"qwen3_moe \(or mixtral\)$"),
    "a Qwen3-MoE without experts": (["--family", "qwen3_moe", "--n_experts", "0"],
                                    r"^n_experts: the qwen3_moe family is a mixture of experts; give --n-experts"),
    "LoRA from random weights": (["--lora", "1"], r"^lora: adapters fine-tune a trained model.*--init-from-hf"),
    "LoRA under float8": (["--lora", "1", "--float8", "1"], r"^lora: float8 linear layers would replace"),
    "an NF4 base without LoRA": (["--base-dtype", "nf4"], r"^base_dtype: nf4 stores the frozen base of a LoRA run "
                                                           r"\(QLoRA\); pass --lora 1, or drop --base-dtype"),
    "an NF4 base of experts": (["--lora", "1", "--base-dtype", "nf4", "--n-experts", "2"],
                               r"^base_dtype: nf4 holds dense projections; a mixture-of-experts model's experts"),
    "a base dtype torchao has no tensor for": (["--lora", "1", "--base-dtype", "int4"], r"^base_dtype: .*auto.*nf4"),
    "an unknown LoRA target": (["--lora-targets", "qkv"], r"^lora_targets: unknown LoRA target 'qkv'; allowed: all"),
    "a chat format nobody reads": (["--data-format", "sharegpt"], r"^data_format: .*text.*chat.*preference"),
    "DPO on text": (["--objective", "dpo"], r"^objective: dpo trains on preference records and they train only with "
                                            r"it: pass --objective dpo with --data-format preference$"),
    "preference records under SFT": (["--data-format", "preference"], r"^objective: dpo trains on preference"),
    "a DPO loss TRL does not name": (["--dpo-loss", "kto"], r"^dpo_loss: .*sigmoid.*ipo.*hinge"),
    "a beta of nothing": (["--dpo-beta", "0"], r"^dpo_beta: .*>= 1e-06"),
    "a token budget and a step count": (["--tokens", "1000", "--max-steps", "5"],
                                        r"^tokens: give a token budget or max_steps \(5\), not both$"),
    "an empty token budget": (["--tokens", "0"], r"^tokens: .*>= 1"),
}
# Each rule's edge, which it allows (a rule tightened by one, `>` to `>=`, fails here).
EDGES = [
    ["--lr", "1e-4", "--min_lr", "1e-4"],
    ["--max_steps", "10", "--warmup_steps", "10"],
    ["--n_experts", "2", "--experts_per_token", "2"],
    ["--n_heads", "4", "--n_kv_heads", "4"],
    ["--resume_from_checkpoint", "auto", "--checkpoint_dir", "ck"],
    ["--checkpoint_every", "10", "--checkpoint_dir", "ck"],
    ["--tiered_checkpoint", "1", "--checkpoint_dir", "ck", "--durable-every", "1"],
    ["--float8", "1", "--device", "cuda"],
    ["--family", "qwen3", "--n_experts", "0"],
    ["--dim", "130", "--n_heads", "4", "--head-dim", "32"],  # explicit heads need not divide the width
    ["--objective", "dpo", "--data-format", "preference", "--dpo-beta", "1e-6"],
    ["--base-dtype", "auto", "--n-experts", "2"],
    ["--family", "qwen3_moe", "--n_experts", "1", "--experts-per-token", "1"],
]


@pytest.mark.parametrize("case", sorted(RULES))
def test_each_rule_refuses_in_one_line_naming_the_field(case):
    flags, message = RULES[case]
    with pytest.raises(UserError) as e:
        parse_args(flags)
    assert re.search(message, str(e.value)) and "\n" not in str(e.value), str(e.value)


@pytest.mark.parametrize("flags", EDGES, ids=" ".join)
def test_each_rule_allows_its_edge(flags):
    parse_args(flags)


def test_every_refusal_of_the_config_has_a_row():
    """Every `raise UserError` in the validators is reached by a row of RULES (or, for the refusals
    that need a checkpoint or a world size, by the tests named here)."""
    messages = []
    for flags, _ in RULES.values():
        try:
            parse_args(flags)
        except UserError as e:
            messages.append(str(e))
    sites = raise_sites(config.validate, config._validate_shape, config.parse_args, Parser.error, config.resolve)
    assert not unreached(sites, messages)
    # _nest's refusal of an unknown key: test_yaml_unknown_key; replicas: test_precision_and_hsdp_replicas_...;
    # _resumed_data: tests/train/checkpoint/test_checkpoint.py (resume on other data).


def test_a_token_budget_is_the_steps_that_train_on_all_of_it(monkeypatch):
    """tokens / (seq_len x micro-batch x accumulation x ranks), rounded up; the ranks the job's
    resolver gives, else torchrun's WORLD_SIZE, else --nproc. Warm-up follows those steps."""
    layer = {"tokens": 100_000, "seq_len": 128, "train_batch_size": 4, "grad_accum_steps": 2, "warmup": 0.1}
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert config.build([layer]).optim.max_steps == 98            # 100,000 / 1,024 = 97.7
    assert config.build([{**layer, "nproc": 2}]).optim.max_steps == 49
    cfg = config.build([layer], ranks=3)                          # 100,000 / 3,072 = 32.6
    assert (cfg.optim.max_steps, cfg.optim.warmup_steps) == (33, 3)
    monkeypatch.setenv("WORLD_SIZE", "4")
    assert config.build([layer]).optim.max_steps == 25            # 100,000 / 4,096 = 24.4
    assert config.build([{**layer, "tokens": 4096}]).optim.max_steps == 1


BAD_INPUT = {
    "unknown preset": (["--preset", "llama9_1t"], "preset"),
    "heads not dividing hidden": (["--dim", "130", "--n_heads", "4"], "n_heads"),
    "kv heads not dividing heads": (["--n_heads", "4", "--n_kv_heads", "3"], "n_kv_heads"),
    "batch < 1": (["--train_batch_size", "0"], "train_batch_size"),
    "steps < 1": (["--max_steps", "0"], "max_steps"),
    "nproc above devices": (["--nproc", "4096"], "nproc"),
    "unknown flag": (["--not_a_flag", "1"], "not_a_flag"),
    "flag without value": (["--lr"], "--lr"),
}


@pytest.mark.parametrize("case", sorted(BAD_INPUT))
def test_bad_input_is_one_line_and_exit_2(case, cli, tmp_path):
    flags, field = BAD_INPUT[case]
    run_dir = tmp_path / "run"
    r = cli("train", *flags, "--run_dir", str(run_dir), timeout=60)
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and field in lines[0], r.stderr
    assert "Traceback" not in r.stderr
    assert not run_dir.exists()


def test_unwritable_run_dir_is_one_line_and_exit_2(cli, tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    r = cli("train", "--run_dir", str(blocker / "run"), timeout=60)
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "run_dir" in lines[0] and "not writable" in lines[0], r.stderr
    assert blocker.read_text() == "not a directory"


# Every model file of the reference example's models/ folder (awsome-distributed-training,
# 3.test_cases/pytorch/FSDP/models/*.txt), its model and optimizer flags written out. The reference
# has no presets: `--model_type` plus the dimensions name the published model, whose vocabulary,
# RoPE base and expert count the files leave to it.
_COMMON = ["--checkpoint_freq=50", "--checkpoint_dir=./checkpoints", "--dataset=allenai/c4",
           "--dataset_config_name=en", "--resume_from_checkpoint=./checkpoints", "--train_batch_size=1",
           "--val_batch_size=1", "--sharding_strategy=full", "--offload_activations=1"]
_LLAMA_TOK = "--tokenizer=hf-internal-testing/llama-tokenizer"
_MISTRAL_OPT = ["--seed=42", "--grad_clip=1.0", "--weight_decay=0.2", "--beta1=0.9", "--beta2=0.95",
                "--activation_checkpointing=1", "--intermediate_size=14336", "--num_key_value_heads=8",
                "--logging_freq=1", "--max_context_width=32768", "--hidden_width=4096", "--num_layers=32",
                "--num_heads=32", "--resid_pdrop=0.1", "--embd_pdrop=0.1", "--attn_pdrop=0.1",
                "--summary_first_pdrop=0.1", "--initializer_range=0.02", "--rotary_pct=0.25",
                "--rotary_emb_base=10000", "--lr=0.0001", "--lr_decay_style=cosine", "--min_lr=1e-5",
                "--warmup=0.0032", "--plateau=0.0", "--dataset=allenai/c4", "--epochs=3",
                "--dataset_config_name=en", "--limit_all_gathers=1", "--sharding_strategy=full",
                "--offload_activations=1"]
REFERENCE_MODEL_FILES = {
    "llama2_7b.txt": [*_COMMON, "--max_context_width=4096", "--num_key_value_heads=32", "--intermediate_size=11008",
                      "--hidden_width=4096", "--num_layers=32", "--num_heads=32", "--model_type=llama_v2",
                      _LLAMA_TOK, "--validation_freq=100", "--max_steps=100"],
    "llama2_13b.txt": [*_COMMON, "--max_context_width=4096", "--num_key_value_heads=40", "--intermediate_size=13824",
                       "--hidden_width=5120", "--num_layers=40", "--num_heads=40", "--model_type=llama_v2",
                       _LLAMA_TOK, "--validation_freq=25", "--max_steps=50"],
    "llama2_70b.txt": [*_COMMON, "--max_context_width=4096", "--num_key_value_heads=8", "--intermediate_size=28672",
                       "--hidden_width=8192", "--num_layers=80", "--num_heads=64", "--model_type=llama_v2",
                       _LLAMA_TOK, "--validation_freq=10", "--max_steps=30"],
    "llama3_1_8b.txt": [*_COMMON, "--max_context_width=8192", "--num_key_value_heads=8", "--intermediate_size=14336",
                        "--hidden_width=4096", "--num_layers=32", "--num_heads=32", "--model_type=llama_v3",
                        _LLAMA_TOK, "--validation_freq=25", "--max_steps=50"],
    "llama3_1_70b.txt": [*_COMMON, "--max_context_width=8192", "--num_key_value_heads=8",
                         "--intermediate_size=28672", "--hidden_width=8192", "--num_layers=80", "--num_heads=64",
                         "--model_type=llama_v3", _LLAMA_TOK, "--validation_freq=10", "--max_steps=30"],
    "llama3_2_1b.txt": [*_COMMON, "--max_context_width=8192", "--num_key_value_heads=2", "--intermediate_size=8192",
                        "--hidden_width=2048", "--num_layers=16", "--num_heads=32", "--model_type=llama_v3",
                        _LLAMA_TOK, "--validation_freq=100", "--max_steps=100"],
    "llama3_2_3b.txt": [*_COMMON, "--max_context_width=8192", "--num_key_value_heads=2", "--intermediate_size=8192",
                        "--hidden_width=3072", "--num_layers=28", "--num_heads=24", "--model_type=llama_v3",
                        _LLAMA_TOK, "--validation_freq=100", "--max_steps=100"],
    "mathstral_7b.txt": ["--train_batch_size=1", "--val_batch_size=1", *_MISTRAL_OPT, "--vocab_size=32768",
                         "--model_type=mistral", "--tokenizer=mistralai/mathstral-7B-v0.1",
                         "--checkpoint_dir=./checkpoints/mathstral-7B",
                         "--resume_from_checkpoint=./checkpoints/mathstral-7B", "--max_steps=200",
                         "--checkpoint_freq=50", "--validation_freq=100"],
    "mistral_8x7b.txt": ["--train_batch_size=4", "--val_batch_size=4", "--max_steps=200", "--bf16=1", *_MISTRAL_OPT,
                         "--vocab_size=32000", "--model_type=mixtral", "--tokenizer=mistralai/Mixtral-8x7B-v0.1"],
}
# (preset, vocab, dim, layers, heads, kv heads, ffn, family, experts, top-k, RoPE base, seq_len)
EXPECTED_ARCHITECTURE = {
    "llama2_7b.txt": ("llama2_7b", 32000, 4096, 32, 32, 32, 11008, "llama", 0, 1e4, 4096),
    "llama2_13b.txt": ("llama2_13b", 32000, 5120, 40, 40, 40, 13824, "llama", 0, 1e4, 4096),
    "llama2_70b.txt": ("llama2_70b", 32000, 8192, 80, 64, 8, 28672, "llama", 0, 1e4, 4096),
    "llama3_1_8b.txt": ("llama3_1_8b", 128256, 4096, 32, 32, 8, 14336, "llama", 0, 5e5, 8192),
    "llama3_1_70b.txt": ("llama3_1_70b", 128256, 8192, 80, 64, 8, 28672, "llama", 0, 5e5, 8192),
    # The reference's 1B and 3B files give 2 key/value heads (the published models have 8): flags win.
    "llama3_2_1b.txt": ("llama3_2_1b", 128256, 2048, 16, 32, 2, 8192, "llama", 0, 5e5, 8192),
    "llama3_2_3b.txt": ("llama3_2_3b", 128256, 3072, 28, 24, 2, 8192, "llama", 0, 5e5, 8192),
    "mathstral_7b.txt": ("mathstral_7b", 32768, 4096, 32, 32, 8, 14336, "mistral", 0, 1e6, 32768),
    "mistral_8x7b.txt": ("mixtral_8x7b", 32000, 4096, 32, 32, 8, 14336, "mixtral", 8, 1e6, 32768),
}


@pytest.mark.parametrize("name", sorted(REFERENCE_MODEL_FILES))
def test_each_reference_model_file_parses_to_its_published_architecture(name, diagnostics):
    cfg = parse_args(REFERENCE_MODEL_FILES[name])
    m = cfg.shape
    preset, vocab, dim, layers, heads, kv, ffn, family, experts, theta, seq = EXPECTED_ARCHITECTURE[name]
    assert cfg.preset == preset
    assert (m.vocab_size, m.dim, m.n_layers, m.n_heads, m.n_kv_heads, m.ffn_dim, m.family, m.n_experts,
            m.rope_theta, cfg.data.seq_len) == (vocab, dim, layers, heads, kv, ffn, family, experts, theta, seq)
    if experts:
        assert m.experts_per_token == 2
    if preset.startswith("llama3"):
        assert m.rope_scaling is not None   # Llama 3.1/3.2 frequency scaling, from the preset
    # The flags the file gives win over the preset's recipe.
    flags = dict(f.removeprefix("--").split("=", 1) for f in REFERENCE_MODEL_FILES[name])
    if "lr" in flags:
        assert cfg.optim.lr == float(flags["lr"]) and cfg.optim.min_lr == float(flags["min_lr"])
    assert cfg.data.tokenizer == flags["tokenizer"]
    assert cfg.optim.max_steps == int(flags.get("max_steps", 300))
    assert any(n.startswith("note: --offload_activations is accepted and ignored") for n in diagnostics)


def test_mixtral_model_type_alone_means_eight_experts_top_two():
    cfg = parse_args(["--model_type=mixtral", "--hidden_width=64", "--num_layers=2", "--num_heads=4",
                         "--intermediate_size=96", "--num_key_value_heads=2"])
    m = cfg.shape
    assert (m.family, m.n_experts, m.experts_per_token) == ("mixtral", 8, 2)
    cfg = parse_args(["--model_type=mixtral", "--num_local_experts=4", "--num_experts_per_tok=1"])
    assert (cfg.shape.n_experts, cfg.shape.experts_per_token) == (4, 1)


def test_qwen3_moe_model_type_alone_means_its_published_experts_and_q_k_norms():
    m = parse_args(["--model_type=qwen3_moe", "--num_layers=2"]).shape
    assert (m.family, m.n_experts, m.experts_per_token, m.qk_norm) == ("qwen3_moe", 128, 8, True)
    m = parse_args(["--model_type=qwen3_moe", "--num_experts_per_tok=2", "--qk-norm", "0"]).shape
    assert (m.n_experts, m.experts_per_token, m.qk_norm) == (128, 2, False)


# A family given with other shape options: Qwen3-MoE's q/k norms with its experts given (they were
# applied only where the expert count was not), Qwen 3's on a Llama preset, Qwen 2's biases, and none
# on a Qwen 3 preset turned Llama.
FAMILY_CASES = {
    "qwen3_moe with experts": (["--model_type=qwen3_moe", "--n-experts", "4", "--num_experts_per_tok", "2"],
                               (False, True, 4)),
    "qwen3 on llama": (["--preset", "tiny", "--family", "qwen3"], (False, True, 0)),
    "qwen2 on llama": (["--preset", "tiny", "--family", "qwen2"], (True, False, 0)),
    "llama on qwen3": (["--preset", "qwen3_0_6b", "--family", "llama"], (False, False, 0)),
    "mixtral with experts": (["--family", "mixtral", "--n-experts", "4"], (False, False, 4)),
}


@pytest.mark.parametrize("case", sorted(FAMILY_CASES))
def test_a_family_s_attention_holds_whatever_else_is_given_and_its_export_config_reads_back_as_the_shape(case):
    from fsdpkit.train.model.hf_config import hf_config_dict, shape_of_config

    flags, (qkv_bias, qk_norm, experts) = FAMILY_CASES[case]
    m = parse_args(flags).shape
    assert (m.qkv_bias, m.qk_norm, m.n_experts) == (qkv_bias, qk_norm, experts)
    assert shape_of_config(hf_config_dict(m)) == m


def test_an_export_whose_class_cannot_hold_the_trained_attention_is_refused_in_one_line():
    from fsdpkit.train.model.hf_config import hf_config_dict

    m = parse_args(["--model_type=qwen3_moe", "--n-experts", "4", "--qk-norm", "0"]).shape
    with pytest.raises(UserError) as e:
        hf_config_dict(m)
    assert str(e.value) == ("export: the model was trained with qkv_bias 0, qk_norm 0, which a Qwen3MoeForCausalLM "
                            "cannot hold (its class has qkv_bias 0, qk_norm 1); train it with the family's own "
                            "attention (leave --qkv-bias and --qk-norm unset)")


def test_export_refuses_a_mixtral_family_model_without_experts():
    from fsdpkit.train.model.config import ModelConfig
    from fsdpkit.train.model.hf_config import hf_config_dict

    dense = ModelConfig(vocab_size=258, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=96, max_seq_len=64,
                        family="mixtral")
    with pytest.raises(UserError, match="no experts"):
        hf_config_dict(dense)


def test_a_presets_recipe_lies_under_yaml_and_flags(tmp_path):
    cfg = parse_args(["--preset", "llama2_7b", "--max_steps", "20000"])
    o = cfg.optim
    # Llama 2 paper: peak 3e-4, 2000 warm-up steps, cosine to 10%, eps 1e-5, sequence 4096.
    assert (o.lr, o.min_lr, o.warmup_steps, o.eps, cfg.data.seq_len) == (3e-4, 3e-5, 2000, 1e-5, 4096)
    y = tmp_path / "run.yaml"
    y.write_text("preset: llama2_7b\noptim:\n  lr: 1.0e-4\n")
    cfg = parse_args(["--config", str(y), "--min_lr_ratio", "0.5"])
    assert (cfg.optim.lr, cfg.optim.min_lr) == (1e-4, 5e-5)   # the floor follows the lr it is given
    cfg = parse_args(["--config", str(y), "--min_lr", "1e-6", "--warmup_steps", "7", "--tokenizer", "bytes"])
    assert (cfg.optim.min_lr, cfg.optim.warmup_steps, cfg.data.tokenizer) == (1e-6, 7, "bytes")


def test_a_chat_run_takes_the_presets_sft_recipe_and_lora_its_own_over_it(tmp_path):
    sft = parse_args(["--preset", "llama2_7b", "--data-format", "chat", "--max_steps", "1000"])
    assert (sft.optim.lr, sft.optim.weight_decay, sft.optim.warmup_steps) == (2e-5, 0.1, 30)  # 3%, not 2000 steps
    base = tmp_path / "hf"
    base.mkdir()
    (base / "config.json").write_text('{"model_type": "llama", "vocab_size": 300, "hidden_size": 64, '
                                      '"intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4}')
    lora = parse_args(["--preset", "llama2_7b", "--data-format", "chat", "--lora", "1", "--init-from-hf", str(base)])
    assert (lora.optim.lr, lora.adapters.lora_rank, lora.adapters.lora_alpha) == (2e-4, 64, 16.0)
    assert parse_args(["--preset", "llama2_7b", "--data-format", "chat", "--lr", "1e-5"]).optim.min_lr == 1e-6


def test_a_dpo_run_takes_trl_s_defaults_over_the_preset_s_recipe_and_lora_s(tmp_path):
    dpo = ["--objective", "dpo", "--data-format", "preference", "--max_steps", "1000"]
    full = parse_args(["--preset", "llama3_1_8b", *dpo])
    assert (full.optim.lr, full.optim.lr_decay_style, full.optim.min_lr, full.optim.warmup_steps,
            full.loss.dpo_beta) == (1e-6, "linear", 0.0, 0, 0.1)
    base = tmp_path / "hf"
    base.mkdir()
    (base / "config.json").write_text('{"model_type": "llama", "vocab_size": 300, "hidden_size": 64, '
                                      '"intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4}')
    lora = parse_args(["--preset", "llama3_1_8b", *dpo, "--lora", "1", "--init-from-hf", str(base)])
    assert (lora.optim.lr, lora.adapters.lora_rank, lora.adapters.lora_alpha) == (1e-6, 64, 16.0)
    given = parse_args(["--preset", "llama3_1_8b", *dpo, "--lr", "5e-7", "--dpo-beta", "0.01"])
    assert (given.optim.lr, given.loss.dpo_beta) == (5e-7, 0.01)
    assert parse_args(["--preset", "tiny", *dpo]).optim.lr == 3e-3   # the CPU presets keep fsdpkit's own


def test_a_recipes_warmup_is_capped_for_a_short_run_but_a_given_one_is_not():
    assert parse_args(["--preset", "llama2_7b", "--max_steps", "100"]).optim.warmup_steps == 20
    assert parse_args(["--preset", "llama2_7b", "--max_steps", "1000", "--warmup", "0.1"]).optim.warmup_steps == 100
    with pytest.raises(UserError, match="warmup_steps"):
        parse_args(["--preset", "llama2_7b", "--max_steps", "100", "--warmup_steps", "2000"])


def test_presets_list_their_recipes(cli):
    import json

    r = cli("presets", "--json")
    data = {row["name"]: row["recipe"] for row in json.loads(r.stdout)["data"]}
    assert data["llama3_1_8b"]["lr"] == 3e-4 and data["llama3_1_70b"]["lr"] == 1.5e-4
    assert data["llama2_70b"]["lr"] == 1.5e-4 and data["mixtral_8x7b"]["weight_decay"] == 0.2
    assert data["tiny"]["lr"] == 3e-3 and all(r["validation_share"] <= 0.02 for r in data.values())
    assert not data["llama3_2_1b"]["tokenizer"].startswith("meta-llama/")
    # Chat fine-tuning's published rates, with their sources, and LoRA's over them.
    assert data["llama2_7b"]["sft"] == {"lr": 2e-5, "min_lr_ratio": 0.1, "lr_decay_style": "cosine",
                                        "weight_decay": 0.1, "warmup": 0.03, "source": "Llama 2 paper, section 3.1"}
    assert data["qwen2_5_3b"]["sft"]["lr"] == 7e-6 and data["llama3_1_8b"]["sft"]["lr"] == 1e-5
    assert data["qwen3_8b"]["lora"]["lr"] == 2e-4 and data["llama3_1_70b"]["lora"]["lr"] == 1e-4
    assert data["qwen3_8b"]["lora"]["source"].startswith("QLoRA paper") and data["tiny"]["lora"] == {"source": None}
    assert data["qwen3_8b"]["dpo"] == {"lr": 1e-6, "dpo_beta": 0.1, "lr_decay_style": "linear", "min_lr_ratio": 0.0,
                                       "warmup": 0.0, "source": "TRL 1.16 DPOConfig defaults (learning_rate 1e-6, "
                                       "beta 0.1; linear decay, no warm-up)"}
    assert data["tiny"]["dpo"] == {"source": None}
    human = cli("presets")
    assert "torchtitan llama3 configs" in human.stdout and "Llama 2 paper" in human.stdout
    assert "Qwen2.5 technical report, section 4.1" in human.stdout


def test_a_run_records_what_was_given_apart_from_what_was_derived(tmp_path, cli):
    """config.yaml holds what ran: the options given at the top, what was worked out from them under
    `derived:` (sequence, warm-up, floor, validation size, compile, the model's shape). Reused with a
    new --lr, as the README shows, the floor follows the new peak; a floor that was given stays."""
    import yaml

    a, b = tmp_path / "a", tmp_path / "b"
    r = cli("train", "--max_steps", "2", "--progress", "off", "--tensorboard", "0", "--run_dir", str(a))
    assert r.returncode == 0, r.stderr
    saved = yaml.safe_load((a / "config.yaml").read_text())
    assert saved["optim"] == {"max_steps": 2} and saved["run_dir"] == str(a) and saved["preset"] == "tiny"
    derived = saved["derived"]
    assert derived["data"]["seq_len"] == 256 and derived["optim"]["warmup_steps"] == 0
    assert derived["optim"]["min_lr"] == 3e-4 and derived["log"]["validation_batches"] >= 1
    assert derived["parallel"]["compile"] is False and derived["model"]["dim"] == 128
    r = cli("train", "--config", str(a / "config.yaml"), "--lr", "1e-3", "--progress", "off", "--run_dir", str(b))
    assert r.returncode == 0, r.stderr
    again = yaml.safe_load((b / "config.yaml").read_text())
    assert again["optim"] == {"max_steps": 2, "lr": 1e-3} and again["derived"]["optim"]["min_lr"] == 1e-4
    assert again["log"] == {"tensorboard": False, "progress": "off"}

    given_floor = tmp_path / "floor.yaml"
    given_floor.write_text((a / "config.yaml").read_text().replace("max_steps: 2", "max_steps: 2\n  min_lr: 1.0e-05"))
    cfg = parse_args(["--config", str(given_floor), "--lr", "1e-3"])
    assert (cfg.optim.lr, cfg.optim.min_lr, cfg.optim.max_steps) == (1e-3, 1e-5, 2)
    # What a resolved value was when the file was written does not leak back in as given.
    edited = tmp_path / "edited.yaml"
    edited.write_text((a / "config.yaml").read_text().replace("seq_len: 256", "seq_len: 64"))
    assert parse_args(["--config", str(edited)]).data.seq_len == 256


def test_precision_and_hsdp_replicas_are_resolved_in_one_place():
    """The trainer and the planner both ask ParallelConfig: auto precision is bf16 on CUDA only, and
    HSDP's replica groups default to one per node and must divide the world."""
    auto = parse_args(["--sharding_strategy", "hybrid"]).parallel
    assert (auto.precision("cuda"), auto.precision("cpu")) == ("bf16", "fp32")
    assert parse_args(["--mixed_precision", "fp32"]).parallel.precision("cuda") == "fp32"
    assert auto.replicas(16, 2) == 2
    three = parse_args(["--sharding_strategy", "hybrid", "--dp_replicate", "3"]).parallel
    with pytest.raises(UserError, match=r"^dp_replicate: 3 must divide the world size \(16\)$"):
        three.replicas(16, 2)


def test_a_preset_beside_hf_weights_brings_its_recipe_and_must_be_of_their_family(tmp_path, caplog):
    """The weights' config.json gives the shape; the preset, its recipe. Another size of the same
    family is said; another family is refused (a Qwen run on Llama weights would be labelled and
    scheduled as Qwen)."""
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text(json.dumps({
        "model_type": "llama", "vocab_size": 300, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
        "num_attention_heads": 4}))
    with caplog.at_level(logging.INFO, logger="fsdpkit"):
        cfg = parse_args(["--preset", "llama3_1_8b", "--init-from-hf", str(hf)])
    assert (cfg.shape.dim, cfg.shape.n_layers, cfg.optim.lr) == (64, 2, 3e-4)   # Llama 3.1's peak lr
    assert [r.getMessage() for r in caplog.records if "note: preset" in r.getMessage()] == [
        f"note: preset llama3_1_8b is 32 layers of 4096; {hf} holds 2 of 64: the weights' shape with the preset's "
        "recipe"]
    with pytest.raises(UserError, match=rf"^preset: qwen2_5_0_5b is a qwen2 model and {hf} holds a llama one"):
        parse_args(["--preset", "qwen2_5_0_5b", "--init-from-hf", str(hf)])
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="fsdpkit"):
        parse_args(["--init-from-hf", str(hf)])   # no preset named: the weights alone, nothing said
    assert not [r for r in caplog.records if "preset" in r.getMessage()]


MIXTRAL = ["--family", "mixtral", "--n-experts", "4"]
# Context and expert parallel layouts a model cannot take (fsdpkit.train.model.context,
# fsdpkit.train.model.expert_parallel), refused before anything starts.
LAYOUTS = {
    "cp-seq-len": (["--seq-len", "100", "--context-parallel", "8"],
                   "context_parallel: 8 must divide seq_len (100): each rank holds an equal slice of every sequence"),
    "cp-heads": (["--n-heads", "4", "--dim", "128", "--context-parallel", "8"],
                 "context_parallel: 8 must divide the model's 4 attention heads: each rank attends with 1/8 of them"),
    "cp-experts": ([*MIXTRAL, "--context-parallel", "2"],
                   "context_parallel: a mixture-of-experts model's balancing loss counts its experts' load over whole "
                   "sequences; train it without --context-parallel"),
    "ep-dense": (["--expert-parallel", "2"],
                 "expert_parallel: llama is a dense model; it has no experts to split (a mixture-of-experts model "
                 "does: --family mixtral or qwen3_moe)"),
    "ep-experts": ([*MIXTRAL, "--expert-parallel", "3"],
                   "expert_parallel: 3 must divide the model's 4 experts: each rank of a group holds 1/3 of them"),
    "ep-offload": ([*MIXTRAL, "--expert-parallel", "2", "--cpu-offload", "1"],
                   "expert_parallel: not with --lora, --cpu-offload or --objective dpo (expert weights split by "
                   "expert are trained whole, kept on the GPU, and not yet run under DPO's reference); drop one of "
                   "them"),
}


@pytest.mark.parametrize("case", sorted(LAYOUTS))
def test_a_parallel_layout_the_model_cannot_take_is_refused_naming_why(case):
    flags, message = LAYOUTS[case]
    with pytest.raises(UserError) as e:
        config.parse_args(["--preset", "debug", "--seq-len", "256", *flags])
    assert str(e.value) == message
