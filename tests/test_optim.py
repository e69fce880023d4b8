"""Optimizer parameter groups and the learning-rate schedule."""

from __future__ import annotations

import dataclasses
import itertools

import pytest
import torch

from fsdpkit.train.config import parse_args
from fsdpkit.train.model import Transformer
from fsdpkit.train.optim import lr_at, param_groups
from fsdpkit.train.presets import PRESETS


@pytest.mark.parametrize("tied", [False, True])
def test_no_weight_decay_on_norms_and_embeddings(tied):
    model = Transformer(dataclasses.replace(PRESETS["tiny"], tie_embeddings=tied), rope_len=16)
    decay, no_decay = param_groups(model, 0.1)
    names = {id(p): n for n, p in model.named_parameters()}
    decayed = {names[id(p)] for p in decay["params"]}
    plain = {names[id(p)] for p in no_decay["params"]}
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    assert "model.embed_tokens.weight" in plain and "model.norm.weight" in plain
    assert all("layernorm" not in n and "embed" not in n for n in decayed)
    assert "model.layers.0.self_attn.q_proj.weight" in decayed
    assert ("lm_head.weight" in decayed) is (not tied)
    # Every parameter is in exactly one group, once.
    assert len(decayed) + len(plain) == len(list(model.parameters()))


def schedule(*flags: str) -> list[float]:
    cfg, _ = parse_args(["--max_steps", "100", "--lr", "1.0", "--min_lr", "0.1", *flags])
    return [lr_at(s, cfg) for s in range(100)]


def test_warmup_then_cosine_to_floor():
    lrs = schedule("--warmup_steps", "10")
    assert lrs[0] == pytest.approx(0.1) and lrs[9] == pytest.approx(1.0)
    assert all(a >= b for a, b in itertools.pairwise(lrs[10:]))  # non-increasing after warm-up
    assert lrs[55] == pytest.approx(0.1 + 0.9 * 0.5, abs=1e-9)  # half-way through the decay
    assert min(lrs) >= 0.1 and lrs[-1] == pytest.approx(0.1, abs=1e-3)


def test_linear_and_constant():
    linear = schedule("--warmup_steps", "0", "--lr_decay_style", "linear")
    assert linear[50] == pytest.approx(0.1 + 0.9 * 0.5)
    assert schedule("--warmup_steps", "5", "--lr_decay_style", "constant")[5:] == [1.0] * 95


def test_warmup_fraction_is_the_reference_meaning():
    cfg, _ = parse_args(["--max_steps", "1000", "--warmup", "0.01"])
    assert cfg.warmup_steps() == 10
    assert torch.isclose(torch.tensor(lr_at(9, cfg)), torch.tensor(cfg.optim.lr))
