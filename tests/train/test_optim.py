"""Optimizer parameter groups and the learning-rate schedule."""

from __future__ import annotations

import dataclasses
import itertools

import pytest
import torch

from fsdpkit.train.config import parse_args
from fsdpkit.train.model.presets import PRESETS
from fsdpkit.train.model.transformer import Transformer
from fsdpkit.train.optim import build_optimizer, clipped_step, lr_at, param_groups


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
    cfg = parse_args(["--max_steps", "100", "--lr", "1.0", "--min_lr", "0.1", *flags])
    return [lr_at(s, cfg.optim) for s in range(100)]


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
    cfg = parse_args(["--max_steps", "1000", "--warmup", "0.01"])
    assert cfg.optim.warmup_steps == 10
    assert torch.isclose(torch.tensor(lr_at(9, cfg.optim)), torch.tensor(cfg.optim.lr))


def _two_layers(init: dict | None = None) -> torch.nn.Module:
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2))
    if init:
        model.load_state_dict(init)
    return model


@pytest.mark.parametrize("fused", ["1", "0"])
def test_clipped_step_is_clip_grad_norm_then_adamw(fused):
    """Clipping inside the fused kernel (grad_scale) or by the for-each multiply takes the same steps,
    returns the same norm and leaves the same clipped gradients as clip_grad_norm_ + AdamW."""
    torch.manual_seed(0)
    init = _two_layers().state_dict()
    cfg = parse_args(["--fused_optimizer", fused, "--weight_decay", "0.1"])
    ours, ref = _two_layers(init), _two_layers(init)
    opt = build_optimizer(ours, cfg.optim)
    ref_opt = torch.optim.AdamW(param_groups(ref, 0.1), lr=cfg.optim.lr, betas=(cfg.optim.beta1, cfg.optim.beta2),
                                eps=cfg.optim.eps, foreach=False)
    max_norm = 0.5
    for step in range(4):
        x = torch.randn(4, 8) * (10 if step % 2 else 0.01)  # big steps are clipped, small ones are not
        for model in (ours, ref):
            model(x).square().sum().backward()
        ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), max_norm)
        ref_opt.step()
        norm = clipped_step(opt, max_norm)
        torch.testing.assert_close(norm, ref_norm, rtol=1e-6, atol=0)
        for a, b in zip(ours.parameters(), ref.parameters(), strict=True):
            torch.testing.assert_close(a.grad, b.grad, rtol=1e-5, atol=1e-7)
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
        for model in (ours, ref):
            model.zero_grad()
    assert ref_norm > max_norm  # the last step was a clipped one


@pytest.mark.parametrize("fused", ["1", "0"])
def test_a_step_with_nonfinite_gradients_is_skipped(fused):
    torch.manual_seed(0)
    model = _two_layers()
    opt = build_optimizer(model, parse_args(["--fused_optimizer", fused]).optim)
    model(torch.randn(4, 8)).sum().backward()
    clipped_step(opt, 1.0)  # one good step, so there are moments to keep
    model.zero_grad()
    kept = {k: v.clone() for k, v in model.state_dict().items()}
    moments = [opt.state[p]["exp_avg"].clone() for p in model.parameters()]
    model(torch.randn(4, 8)).sum().backward()
    next(model.parameters()).grad[0, 0] = float("nan")
    norm = clipped_step(opt, 1.0)
    assert torch.isnan(norm)
    for k, v in model.state_dict().items():
        torch.testing.assert_close(v, kept[k], rtol=0, atol=0)
    for p, m in zip(model.parameters(), moments, strict=True):
        torch.testing.assert_close(opt.state[p]["exp_avg"], m, rtol=0, atol=0)
    # Training goes on: the next finite step moves the weights again.
    model.zero_grad()
    model(torch.randn(4, 8)).sum().backward()
    clipped_step(opt, 1.0)
    assert any(not torch.equal(v, kept[k]) for k, v in model.state_dict().items())
