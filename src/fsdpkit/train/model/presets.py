"""Named model configurations with the dimensions of the published models, and each one's
training recipe.

The large presets are the ones the reference FSDP example ships; `tiny` and `debug` are sized for
CPU tests and for `make run` (byte-level vocabulary of the embedded tokenizer).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from fsdpkit.errors import UserError
from fsdpkit.train.model.config import ModelConfig, RopeScaling

_LLAMA31_SCALING = RopeScaling(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0)
_LLAMA32_SCALING = RopeScaling(factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0)

def _qwen2(dim: int, layers: int, heads: int, kv: int, ffn: int, context: int, tie: bool = False,
           vocab: int = 151936) -> ModelConfig:
    return ModelConfig(vocab_size=vocab, dim=dim, n_layers=layers, n_heads=heads, n_kv_heads=kv, ffn_dim=ffn,
                       max_seq_len=context, rope_theta=1e6, norm_eps=1e-6, tie_embeddings=tie, family="qwen2",
                       qkv_bias=True)


def _qwen3(dim: int, layers: int, heads: int, kv: int, ffn: int, tie: bool = False) -> ModelConfig:
    return ModelConfig(vocab_size=151936, dim=dim, n_layers=layers, n_heads=heads, n_kv_heads=kv, ffn_dim=ffn,
                       max_seq_len=40960, rope_theta=1e6, norm_eps=1e-6, tie_embeddings=tie, family="qwen3",
                       head_dim=128, qk_norm=True)


PRESETS: dict[str, ModelConfig] = {
    # Sized for a laptop CPU: learns visibly from bytes within a couple of minutes.
    "tiny": ModelConfig(
        vocab_size=258, dim=128, n_layers=4, n_heads=4, n_kv_heads=2, ffn_dim=352, max_seq_len=256,
        rope_theta=10000.0,
    ),
    # Same shape family as the big presets (GQA, untied head), small enough for CPU benchmarks.
    "debug": ModelConfig(
        vocab_size=258, dim=256, n_layers=4, n_heads=8, n_kv_heads=4, ffn_dim=688, max_seq_len=512,
        rope_theta=10000.0,
    ),
    "llama2_7b": ModelConfig(
        vocab_size=32000, dim=4096, n_layers=32, n_heads=32, n_kv_heads=32, ffn_dim=11008,
        max_seq_len=4096, rope_theta=10000.0,
    ),
    "llama2_13b": ModelConfig(
        vocab_size=32000, dim=5120, n_layers=40, n_heads=40, n_kv_heads=40, ffn_dim=13824,
        max_seq_len=4096, rope_theta=10000.0,
    ),
    "llama2_70b": ModelConfig(
        vocab_size=32000, dim=8192, n_layers=80, n_heads=64, n_kv_heads=8, ffn_dim=28672,
        max_seq_len=4096, rope_theta=10000.0,
    ),
    "llama3_1_8b": ModelConfig(
        vocab_size=128256, dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, ffn_dim=14336,
        max_seq_len=131072, rope_theta=500000.0, rope_scaling=_LLAMA31_SCALING,
    ),
    "llama3_1_70b": ModelConfig(
        vocab_size=128256, dim=8192, n_layers=80, n_heads=64, n_kv_heads=8, ffn_dim=28672,
        max_seq_len=131072, rope_theta=500000.0, rope_scaling=_LLAMA31_SCALING,
    ),
    "llama3_2_1b": ModelConfig(
        vocab_size=128256, dim=2048, n_layers=16, n_heads=32, n_kv_heads=8, ffn_dim=8192,
        max_seq_len=131072, rope_theta=500000.0, rope_scaling=_LLAMA32_SCALING, tie_embeddings=True,
    ),
    "llama3_2_3b": ModelConfig(
        vocab_size=128256, dim=3072, n_layers=28, n_heads=24, n_kv_heads=8, ffn_dim=8192,
        max_seq_len=131072, rope_theta=500000.0, rope_scaling=_LLAMA32_SCALING, tie_embeddings=True,
    ),
    # Mathstral 7B v0.1: the Mistral 7B architecture with a 32k context and no sliding window.
    "mathstral_7b": ModelConfig(
        vocab_size=32768, dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, ffn_dim=14336,
        max_seq_len=32768, rope_theta=1000000.0, family="mistral",
    ),
    "mixtral_8x7b": ModelConfig(
        vocab_size=32000, dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, ffn_dim=14336,
        max_seq_len=32768, rope_theta=1000000.0, n_experts=8, experts_per_token=2, family="mixtral",
    ),
    # Qwen 2.5 (config.json of Qwen/Qwen2.5-{0.5B,1.5B,3B,7B}): biased q/k/v projections, RoPE base
    # 1e6, RMSNorm eps 1e-6; the small ones tie the output head to the embedding.
    "qwen2_5_0_5b": _qwen2(896, 24, 14, 2, 4864, 32768, tie=True),
    "qwen2_5_1_5b": _qwen2(1536, 28, 12, 2, 8960, 131072, tie=True),
    "qwen2_5_3b": _qwen2(2048, 36, 16, 2, 11008, 32768, tie=True),
    "qwen2_5_7b": _qwen2(3584, 28, 28, 4, 18944, 131072, vocab=152064),
    # Qwen 3 (config.json of Qwen/Qwen3-{0.6B,1.7B,4B,8B}): per-head RMSNorm on queries and keys,
    # heads 128 wide whatever the hidden size, no biases.
    "qwen3_0_6b": _qwen3(1024, 28, 16, 8, 3072, tie=True),
    "qwen3_1_7b": _qwen3(2048, 28, 16, 8, 6144, tie=True),
    "qwen3_4b": _qwen3(2560, 36, 32, 8, 9728, tie=True),
    "qwen3_8b": _qwen3(4096, 36, 32, 8, 12288),
    # Qwen3-MoE (config.json of Qwen/Qwen3-30B-A3B): Qwen 3's attention, 128 experts of width 768 in
    # every layer, 8 per token with their weights renormalised, balancing loss at 0.001.
    "qwen3_30b_a3b": replace(_qwen3(2048, 48, 32, 4, 768), n_experts=128, experts_per_token=8,
                                         router_aux_loss_coef=0.001, family="qwen3_moe"),
}

# Names the reference's job files use for the same models.
ALIASES = {"mistral_8x7b": "mixtral_8x7b", "mashtral_7b": "mathstral_7b"}


# LoRA: the QLoRA paper (Dettmers et al. 2023, appendix B): 2e-4 up to 13B parameters, 1e-4 above;
# rank 64, alpha 16, dropout 0.1 (0.05 above 13B). A recipe's lora mapping replaces these.
_LORA = {"lr": 2e-4, "lora_rank": 64, "lora_alpha": 16.0, "lora_dropout": 0.1, "warmup": 0.03}
_LORA_SRC = "QLoRA paper (Dettmers et al. 2023): its adapters' rank 64, alpha 16, lr 2e-4 (1e-4 past 30B)"
_LORA_LARGE = {**_LORA, "lr": 1e-4, "lora_dropout": 0.05}
# QLoRA (--base-dtype nf4), over LoRA's: the QLoRA paper's runs (its qlora.py, appendix B) hold the
# rate constant after warm-up, clip the gradient norm at 0.3 and decay no weights.
_QLORA = {"lr_decay_style": "constant", "grad_clip": 0.3, "weight_decay": 0.0}
_QLORA_SRC = "QLoRA paper (Dettmers et al. 2023), appendix B, and its qlora.py"
_NO_QLORA = "none: no nf4 base for experts"
# Preference tuning (--objective dpo), over either: TRL's DPOConfig defaults (TRL 1.16), what the
# teams that run DPO start from: 1e-6 (with LoRA too: DPOConfig has no other rate for adapters),
# beta 0.1, and transformers' TrainingArguments schedule under it: linear decay to 0, no warm-up.
_DPO = {"lr": 1e-6, "dpo_beta": 0.1, "lr_decay_style": "linear", "min_lr_ratio": 0.0, "warmup": 0.0}
_DPO_SRC = "TRL 1.16 DPOConfig defaults (learning_rate 1e-6, beta 0.1; linear decay, no warm-up)"


@dataclass(frozen=True)
class Recipe:
    """A preset's training recipe: trainer options (config field names) laid under every other
    setting, so a YAML file, a job spec or a flag still wins. `source` names where the numbers are
    published. A recipe's warm-up is the published run's; a shorter run takes at most a fifth of
    its steps (see fsdpkit.train.config)."""

    source: str
    options: Mapping[str, Any] = field(default_factory=dict)
    # Laid over `options` for chat fine-tuning (--data-format chat), with where they are published.
    sft: Mapping[str, Any] = field(default_factory=dict)
    sft_source: str = ""
    # Laid over both for a LoRA run: adapters train at a far higher rate than full weights.
    lora: Mapping[str, Any] = field(default_factory=lambda: dict(_LORA))
    lora_source: str = _LORA_SRC
    # Laid over LoRA's when the base is stored in NF4 (QLoRA).
    qlora: Mapping[str, Any] = field(default_factory=lambda: dict(_QLORA))
    qlora_source: str = _QLORA_SRC
    # Laid over all of them for preference tuning (DPO), LoRA's rate included.
    dpo: Mapping[str, Any] = field(default_factory=lambda: dict(_DPO))
    dpo_source: str = _DPO_SRC

    def for_run(self, chat: bool, lora: bool, dpo: bool = False, nf4: bool = False) -> dict[str, Any]:
        """The options of a run of this kind: pre-training, chat fine-tuning, LoRA over either (QLoRA
        over LoRA), and DPO over all. A layer that sets the warm-up as a fraction drops the steps of
        the layer below."""
        out = dict(self.options)
        for layer, _ in self._layers(chat, lora, dpo, nf4):
            if "warmup" in layer:
                out.pop("warmup_steps", None)
            out.update(layer)
        return out

    def source_for(self, chat: bool, lora: bool, dpo: bool = False, nf4: bool = False) -> str:
        """Where a run of this kind has its numbers from: each layer that sets some, the last first."""
        layers = [src for layer, src in self._layers(chat, lora, dpo, nf4) if layer and src]
        return ", over ".join([*reversed(layers), self.source])

    def _layers(self, chat: bool, lora: bool, dpo: bool, nf4: bool) -> list[tuple[Mapping[str, Any], str]]:
        return [(self.sft if chat else {}, self.sft_source), (self.lora if lora else {}, self.lora_source),
                (self.qlora if lora and nf4 else {}, self.qlora_source), (self.dpo if dpo else {}, self.dpo_source)]


# Llama 2 paper (Touvron et al. 2023, section 2.2): AdamW (0.9, 0.95), eps 1e-5, weight decay 0.1,
# clip 1.0, 2000 warm-up steps, cosine decay to 10% of the peak; peak 3e-4 (7B, 13B), 1.5e-4 (70B).
_LLAMA2 = {"beta1": 0.9, "beta2": 0.95, "eps": 1e-5, "weight_decay": 0.1, "grad_clip": 1.0, "warmup_steps": 2000,
           "lr_decay_style": "cosine", "min_lr_ratio": 0.1, "seq_len": 4096, "train_batch_size": 1,
           "validation_freq": 500, "tokenizer": "hf-internal-testing/llama-tokenizer"}
# Llama 3: peak lr, warm-up, eps, sequence and batch from torchtitan's Llama 3 configs
# (torchtitan/models/llama3/train_configs/llama3_{1b,3b,8b,70b}.toml); cosine decay to 1% of the
# peak as in the Llama 3 paper (Grattafiori et al. 2024, section 3.4.1); AdamW (0.9, 0.95), weight
# decay 0.1 and clip 1.0 as Llama 2. Tokenizer: Hugging Face's ungated copy of the Llama 3.1 one
# (same 128,256 tokens; documents end with <|end_of_text|>); meta-llama/* repositories are gated.
_LLAMA3 = {"beta1": 0.9, "beta2": 0.95, "eps": 1e-8, "weight_decay": 0.1, "grad_clip": 1.0, "warmup_steps": 200,
           "lr_decay_style": "cosine", "min_lr_ratio": 0.01, "lr": 3e-4, "seq_len": 8192, "train_batch_size": 1,
           "validation_freq": 500, "tokenizer": "hf-internal-testing/Llama-3.1-8B-Instruct"}
# Mistral AI publishes no training hyperparameters; these are the reference FSDP example's
# (awsome-distributed-training, 3.test_cases/pytorch/FSDP/models/{mathstral_7b,mistral_8x7b}.txt),
# with the sequence cut from its 32k to 8192 so that one p5 node holds a step.
_MISTRAL = {"lr": 1e-4, "min_lr_ratio": 0.1, "warmup": 0.0032, "lr_decay_style": "cosine", "weight_decay": 0.2,
            "beta1": 0.9, "beta2": 0.95, "grad_clip": 1.0, "seq_len": 8192, "train_batch_size": 1,
            "activation_checkpointing": "full", "validation_freq": 500}
# Chat fine-tuning. Llama 2-Chat: 2e-5, cosine, weight decay 0.1 (Llama 2 paper, section 3.1). Llama 3:
# 1e-5 (Llama 3 paper, section 4.1.3). Mistral publishes none: Hugging Face's alignment-handbook
# recipe for Zephyr 7B (recipes/zephyr-7b-beta/sft/config_full.yaml): 2e-5, cosine, 10% warm-up.
# Qwen 2.5: 7e-6 decaying to 7e-7, weight decay 0.1, clip 1.0 (Qwen2.5 technical report, section
# 4.1); Qwen 3's report gives none, so Qwen 2.5's.
_SFT_LLAMA2 = {"lr": 2e-5, "min_lr_ratio": 0.1, "lr_decay_style": "cosine", "weight_decay": 0.1, "warmup": 0.03}
_SFT_LLAMA3 = {"lr": 1e-5, "min_lr_ratio": 0.1, "lr_decay_style": "cosine", "warmup": 0.03}
_SFT_MISTRAL = {"lr": 2e-5, "min_lr_ratio": 0.0, "lr_decay_style": "cosine", "warmup": 0.1, "weight_decay": 0.0}
_SFT_QWEN = {"lr": 7e-6, "min_lr_ratio": 0.1, "lr_decay_style": "cosine", "weight_decay": 0.1, "grad_clip": 1.0}
_SFT_SRC = {"llama2": "Llama 2 paper, section 3.1", "llama3": "Llama 3 paper, section 4.1.3",
            "mistral": "alignment-handbook zephyr-7b-beta SFT recipe (Mistral AI publishes none)",
            "qwen": "Qwen2.5 technical report, section 4.1"}
# Qwen publishes no pre-training schedule: these checkpoints are for fine-tuning, so their recipe is
# the post-training one, at a length one GPU holds; tokenizers are Qwen's own (ungated).
_QWEN = {**_SFT_QWEN, "warmup": 0.03, "seq_len": 4096, "train_batch_size": 1, "validation_freq": 500,
         "beta1": 0.9, "beta2": 0.95}
_QWEN_TOKENIZER = {"qwen2": "Qwen/Qwen2.5-0.5B", "qwen3": "Qwen/Qwen3-0.6B"}  # one per family, every size
_QWEN_SRC = "Qwen2.5 technical report, section 4.1 (post-training; no pre-training schedule is published)"
_LLAMA2_SRC = "Llama 2 paper, section 2.2"
_LLAMA3_SRC = "torchtitan llama3 configs; Llama 3 paper, section 3.4.1"
_REF_SRC = "reference FSDP example's model files (Mistral AI publishes none)"

RECIPES: dict[str, Recipe] = {
    "tiny": Recipe("fsdpkit's defaults, tuned on the embedded data on a CPU", lora={}, lora_source="", qlora={},
                   qlora_source="", dpo={}, dpo_source=""),
    "debug": Recipe("fsdpkit's defaults, tuned on the embedded data on a CPU", lora={}, lora_source="", qlora={},
                    qlora_source="", dpo={}, dpo_source=""),
    "llama2_7b": Recipe(_LLAMA2_SRC, {**_LLAMA2, "lr": 3e-4}, _SFT_LLAMA2, _SFT_SRC["llama2"]),
    "llama2_13b": Recipe(_LLAMA2_SRC, {**_LLAMA2, "lr": 3e-4}, _SFT_LLAMA2, _SFT_SRC["llama2"]),
    "llama2_70b": Recipe(_LLAMA2_SRC, {**_LLAMA2, "lr": 1.5e-4, "activation_checkpointing": "full"},
                         _SFT_LLAMA2, _SFT_SRC["llama2"], _LORA_LARGE),
    # torchtitan's 8B config checkpoints activations selectively (its mode "selective"): at 8192
    # tokens a step's activations without it fill an 80 GB GPU.
    "llama3_1_8b": Recipe(_LLAMA3_SRC, {**_LLAMA3, "activation_checkpointing": "selective"}, _SFT_LLAMA3,
                          _SFT_SRC["llama3"]),
    "llama3_1_70b": Recipe(_LLAMA3_SRC, {**_LLAMA3, "lr": 1.5e-4, "activation_checkpointing": "full"},
                           _SFT_LLAMA3, _SFT_SRC["llama3"], _LORA_LARGE),
    "llama3_2_1b": Recipe(_LLAMA3_SRC, {**_LLAMA3, "seq_len": 2048, "train_batch_size": 8}, _SFT_LLAMA3,
                          _SFT_SRC["llama3"]),
    "llama3_2_3b": Recipe(_LLAMA3_SRC, _LLAMA3, _SFT_LLAMA3, _SFT_SRC["llama3"]),
    "mathstral_7b": Recipe(_REF_SRC, {**_MISTRAL, "tokenizer": "mistralai/mathstral-7B-v0.1"}, _SFT_MISTRAL,
                           _SFT_SRC["mistral"]),
    # Its experts are 3-D grouped weights, which NF4 does not hold: no QLoRA (fsdpkit.train.model.nf4).
    "mixtral_8x7b": Recipe(_REF_SRC, {**_MISTRAL, "tokenizer": "mistralai/Mixtral-8x7B-v0.1"}, _SFT_MISTRAL,
                           _SFT_SRC["mistral"], _LORA_LARGE, qlora={}, qlora_source=_NO_QLORA),
    # Qwen3-MoE's experts are 3-D grouped weights, which NF4 does not hold: no QLoRA layer.
    **{name: Recipe(_QWEN_SRC, {**_QWEN, "tokenizer": _QWEN_TOKENIZER[name[:5]]}, _SFT_QWEN, _SFT_SRC["qwen"],
                    qlora={} if PRESETS[name].is_moe else dict(_QLORA),
                    qlora_source=_NO_QLORA if PRESETS[name].is_moe else _QLORA_SRC)
       for name in PRESETS if name.startswith("qwen")},
}

# The reference example's --model_type values and the presets each may name.
_GENERATIONS = {"llama_v2": ("llama2_",), "llama_v3": ("llama3_",), "llama": ("llama2_", "llama3_"),
                "mistral": ("mathstral_",), "mixtral": ("mixtral_",)}
_SHAPE = ("dim", "n_layers", "n_heads", "ffn_dim")


def canonical(name: str) -> str:
    return ALIASES.get(name, name)


def get_preset(name: str) -> ModelConfig:
    key = canonical(name)
    if key not in PRESETS:
        raise UserError(f"preset: unknown preset {name!r}; choose one of: {', '.join(PRESETS)}")
    return PRESETS[key]


def get_recipe(name: str) -> Recipe:
    get_preset(name)  # the same error for an unknown name
    return RECIPES[canonical(name)]


def match_preset(model_type: str, shape: Mapping[str, Any]) -> str | None:
    """The preset a reference-style flag set describes: `--model_type` plus the dimensions, with no
    `--preset` (the reference example has none). Matched on hidden size, layers, heads and MLP
    size; None for a shape no preset has."""
    prefixes = _GENERATIONS.get(model_type)
    if not prefixes:
        return None
    for name, cfg in PRESETS.items():
        if name.startswith(prefixes) and all(shape.get(k) == getattr(cfg, k) for k in _SHAPE):
            return name
    return None
