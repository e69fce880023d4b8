"""Model shape, initialisation and numerical parity with Hugging Face transformers."""

from __future__ import annotations

import dataclasses
import math
import resource

import pytest
import torch

from fsdpkit.train.model.config import ModelConfig, RopeScaling, count_params
from fsdpkit.train.model.hf_config import hf_config_dict
from fsdpkit.train.model.presets import PRESETS
from fsdpkit.train.model.transformer import Transformer

from conftest import require

# Published sizes (Meta / Mistral AI / Qwen model cards), in billions.
PUBLISHED_B = {
    "llama2_7b": 6.74, "llama2_13b": 13.02, "llama2_70b": 68.98, "llama3_1_8b": 8.03,
    "llama3_1_70b": 70.55, "llama3_2_1b": 1.24, "llama3_2_3b": 3.21, "mathstral_7b": 7.25,
    "mixtral_8x7b": 46.70, "qwen2_5_0_5b": 0.494, "qwen2_5_1_5b": 1.54, "qwen2_5_3b": 3.09, "qwen2_5_7b": 7.62,
    "qwen3_0_6b": 0.596, "qwen3_1_7b": 1.72, "qwen3_4b": 4.02, "qwen3_8b": 8.19, "qwen3_30b_a3b": 30.53,
}
# Parameters a token uses, where the card gives them (mixture-of-experts models).
PUBLISHED_ACTIVE_B = {"mixtral_8x7b": 12.9, "qwen3_30b_a3b": 3.3}


def unique_numel(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())  # parameters() already skips tied duplicates


@pytest.mark.parametrize("name", sorted(PUBLISHED_B))
def test_preset_builds_on_meta_with_published_size(name):
    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    with torch.device("meta"):
        model = Transformer(PRESETS[name], rope_len=4096)
    n = unique_numel(model)
    assert n == count_params(PRESETS[name])
    assert n / 1e9 == pytest.approx(PUBLISHED_B[name], abs=0.006)
    assert all(p.is_meta for p in model.parameters())
    assert all(b.is_meta for b in model.buffers())
    # A 70B model in fp32 is 280 GB: building it must not allocate (ru_maxrss is in KiB on Linux).
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss_before < 200 * 1024


@pytest.mark.parametrize("name", sorted(PUBLISHED_ACTIVE_B))
def test_a_mixture_of_experts_preset_activates_its_published_share(name):
    assert count_params(PRESETS[name], active=True) / 1e9 == pytest.approx(PUBLISHED_ACTIVE_B[name], abs=0.06)


@pytest.mark.parametrize("name", sorted(n for n in PRESETS if n.startswith("qwen")))
def test_qwen_presets_are_transformers_models_of_the_same_parameters(name):
    """Each Qwen preset, written as the config.json an export writes, is a transformers model with
    our parameters: the same names and shapes, so weights map one to one (the VERL recipe's
    Qwen2.5-3B-Instruct is qwen2_5_3b)."""
    transformers = require("transformers")
    config = hf_config_dict(PRESETS[name])
    model_cls = getattr(transformers, config.pop("architectures")[0])
    with torch.device("meta"):
        theirs = model_cls(model_cls.config_class(**config))
        ours = Transformer(PRESETS[name], rope_len=64)
    shapes = {k: tuple(v.shape) for k, v in ours.state_dict().items()}
    assert shapes == {k: tuple(v.shape) for k, v in theirs.state_dict().items()}


def materialise(cfg: ModelConfig, seed: int = 0, rope_len: int = 64) -> Transformer:
    with torch.device("meta"):
        model = Transformer(cfg, rope_len=rope_len)
    model.to_empty(device="cpu")
    # to_empty leaves whatever the allocator returned; make that visibly wrong before init.
    with torch.no_grad():
        for t in [*model.parameters(), *model.buffers()]:
            t.fill_(float("nan"))
    model.init_weights(seed=seed)
    return model


def test_materialised_model_is_fully_initialised_as_configured():
    cfg = dataclasses.replace(PRESETS["debug"], n_layers=8, init_std=0.02)
    model = materialise(cfg, rope_len=128)
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        assert torch.isfinite(t).all(), f"{name} left uninitialised"
    layer = model.model.layers[3]
    assert layer.self_attn.q_proj.weight.std().item() == pytest.approx(0.02, rel=0.05)
    assert model.model.embed_tokens.weight.std().item() == pytest.approx(0.02, rel=0.05)
    residual_std = 0.02 / math.sqrt(2 * cfg.n_layers)
    assert layer.self_attn.o_proj.weight.std().item() == pytest.approx(residual_std, rel=0.05)
    assert layer.mlp.down_proj.weight.std().item() == pytest.approx(residual_std, rel=0.05)
    assert (layer.input_layernorm.weight == 1).all() and (model.model.norm.weight == 1).all()
    # Truncated at 3 std.
    assert layer.mlp.up_proj.weight.abs().max().item() <= 3 * 0.02 + 1e-6
    # RoPE tables equal a fresh computation, position 0 is the identity rotation.
    fresh = Transformer(cfg, rope_len=128)
    fresh.init_buffers()
    torch.testing.assert_close(model.rope_cos, fresh.rope_cos, rtol=0, atol=0)
    assert (model.rope_cos[0] == 1).all() and (model.rope_sin[0] == 0).all()


def test_initialisation_is_seeded_and_order_independent():
    cfg = PRESETS["tiny"]
    a, b, c = materialise(cfg, seed=7), materialise(cfg, seed=7), materialise(cfg, seed=8)
    for (name, pa), pb, pc in zip(a.named_parameters(), b.parameters(), c.parameters(), strict=True):
        assert torch.equal(pa, pb), name
        if pa.ndim == 2:
            assert not torch.equal(pa, pc), name
    # Different parameters of the same shape get different values (per-name generators).
    assert not torch.equal(a.model.layers[0].self_attn.q_proj.weight, a.model.layers[1].self_attn.q_proj.weight)


# --- parity with transformers ------------------------------------------------------------------

transformers = require("transformers")

SMALL = dict(vocab_size=96, dim=64, n_layers=2, n_heads=8, n_kv_heads=2, ffn_dim=96, max_seq_len=256)

CASES = {
    "llama3_scaled_rope_tied": ModelConfig(
        **SMALL, rope_theta=500000.0, tie_embeddings=True,
        rope_scaling=RopeScaling(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                 original_max_position_embeddings=64)),
    "llama2": ModelConfig(**{**SMALL, "n_kv_heads": 8}, rope_theta=10000.0),
    "mistral_sliding_window": ModelConfig(**SMALL, rope_theta=1e6, sliding_window=8, family="mistral"),
    "mixtral_moe": ModelConfig(**SMALL, rope_theta=1e6, n_experts=4, experts_per_token=2, family="mixtral"),
}


def hf_model(cfg: ModelConfig):
    from fsdpkit.train.model.hf_config import ARCHITECTURES, hf_config_dict

    d = hf_config_dict(cfg)
    config_cls = getattr(transformers, ARCHITECTURES[d["model_type"]].replace("ForCausalLM", "Config"))
    model_cls = getattr(transformers, ARCHITECTURES[d["model_type"]])
    config = config_cls(**{k: v for k, v in d.items() if k != "architectures"})
    config._attn_implementation = "eager"
    return model_cls(config).eval()


@pytest.mark.parametrize("case", sorted(CASES))
def test_logits_match_transformers(case):
    cfg = CASES[case]
    ours = materialise(cfg, seed=3, rope_len=48).eval()
    theirs = hf_model(cfg)
    missing, unexpected = theirs.load_state_dict(ours.state_dict(), strict=False)
    assert not unexpected and all("rotary" in k for k in missing), (missing, unexpected)
    tokens = torch.randint(0, cfg.vocab_size, (2, 48), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = theirs(tokens).logits
        got = ours(tokens)
    assert got.shape == expected.shape
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-5)


@pytest.mark.parametrize("case", sorted(CASES))
def test_every_family_trains_unsharded_under_bf16_autocast(case):
    """The path `fsdpkit train --device cuda` takes with one process: fp32 weights, bf16 autocast,
    packed documents masked. Every family runs forward and backward in it, keeps fp32 weights and
    gradients, and agrees with its fp32 loss (Mixtral's grouped experts used to get fp32 weights
    and bf16 tokens here, which no GPU kernel takes)."""
    cfg = CASES[case]
    model = materialise(cfg, seed=3, rope_len=48)
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, cfg.vocab_size, (2, 48), generator=gen)
    x, y, eos = tokens[:, :-1], tokens[:, 1:], int(tokens[0, 20])  # a token that splits documents
    with torch.no_grad():
        fp32_ce, _ = model.loss(x, y, eos)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    seen = []
    for _ in range(4):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            ce, total = model.loss(x, y, eos)
        assert ce.dtype == torch.float32
        total.backward()
        for name, p in model.named_parameters():
            assert p.dtype == torch.float32 and p.grad is not None and p.grad.dtype == torch.float32, name
            assert torch.isfinite(p.grad).all(), name
        optimizer.step()
        optimizer.zero_grad()
        seen.append(ce.item())
    assert seen[0] == pytest.approx(fp32_ce.item(), rel=0.02)
    assert seen[-1] < seen[0] - 0.05


@pytest.mark.parametrize(("recipe", "head"), [("tensorwise", False), ("rowwise", False), ("tensorwise", True)])
def test_float8_training_runs_on_the_cpu_and_tracks_bf16(recipe, head):
    """The float8 conversion `--float8` applies on a GPU (torchao's float8 GEMM runs on the CPU too):
    every decoder projection becomes a float8 linear, the head only when asked, and a short run
    under bf16 autocast learns as the bf16 one does."""
    from torchao.float8.float8_linear import Float8Linear

    from fsdpkit.train.parallel.shard import convert_float8

    cfg = CASES["llama2"]
    runs = {}
    for name in ("bf16", "float8"):
        model = materialise(cfg, seed=3, rope_len=48)
        if name == "float8":
            convert_float8(model, recipe, head)
            linears = {n: type(m) for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
            assert all(t is Float8Linear for n, t in linears.items() if n != "lm_head"), linears
            assert (linears["lm_head"] is Float8Linear) == head
        optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
        tokens = torch.randint(0, cfg.vocab_size, (4, 33), generator=torch.Generator().manual_seed(0))
        seen = []
        for _ in range(12):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                ce, total = model.loss(tokens[:, :-1], tokens[:, 1:])
            total.backward()
            optimizer.step()
            optimizer.zero_grad()
            seen.append(ce.item())
        runs[name] = seen
    assert runs["float8"][-1] < runs["float8"][0] - 0.5
    assert runs["float8"][-1] == pytest.approx(runs["bf16"][-1], rel=0.05)


def test_sliding_window_changes_attention():
    """The Mistral parity case can only pass for the right reason if the window matters."""
    cfg = CASES["mistral_sliding_window"]
    windowed = materialise(cfg, seed=3, rope_len=48).eval()
    full = materialise(dataclasses.replace(cfg, sliding_window=None), seed=3, rope_len=48).eval()
    tokens = torch.randint(0, cfg.vocab_size, (1, 48), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        a, b = windowed(tokens), full(tokens)
    torch.testing.assert_close(a[:, :8], b[:, :8])  # inside the window: identical
    assert (a[:, 16:] - b[:, 16:]).abs().max() > 1e-3


def test_moe_balancing_loss_is_added():
    cfg = CASES["mixtral_moe"]
    model = materialise(cfg, seed=1, rope_len=48)
    tokens = torch.randint(0, cfg.vocab_size, (2, 48), generator=torch.Generator().manual_seed(0))
    ce, total = model.loss(tokens[:, :-1], tokens[:, 1:])
    aux = model.balancing_loss(tokens[:, :-1].numel())
    # transformers' definition: top-k (here 2) when perfectly balanced, more when not.
    assert aux.item() >= 0.99 * cfg.experts_per_token
    torch.testing.assert_close(total, ce + cfg.router_aux_loss_coef * aux)
    total.backward()
    assert model.model.layers[0].mlp.gate.weight.grad.abs().sum() > 0


def test_moe_training_matches_transformers_mixtral_step_by_step_and_stays_balanced():
    """Both models from the same weights, the same batches and AdamW: the total loss (cross-entropy
    plus balancing at Mixtral's coefficient) and every layer's expert load agree at every step, and
    no expert takes more than 1.6x its share."""
    cfg = CASES["mixtral_moe"]
    ours = materialise(cfg, seed=1, rope_len=64)
    theirs = hf_model(cfg).train()
    missing, unexpected = theirs.load_state_dict(ours.state_dict(), strict=False)
    assert not unexpected and all("rotary" in k for k in missing), (missing, unexpected)
    optimizers = [torch.optim.AdamW(m.parameters(), lr=3e-3) for m in (ours, theirs)]
    gen = torch.Generator().manual_seed(0)
    text = torch.randint(0, cfg.vocab_size, (64,), generator=gen)  # a text to learn, read at random offsets
    for step in range(30):
        tokens = torch.stack([torch.roll(text, -int(s))[:33] for s in torch.randint(0, 31, (8,), generator=gen)])
        x, y = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
        _, total = ours.loss(x, y)
        out = theirs(input_ids=x, labels=y, shift_labels=y, output_router_logits=True)
        total.backward()
        out.loss.backward()
        for o in optimizers:
            o.step()
            o.zero_grad()
        assert total.item() == pytest.approx(out.loss.item(), abs=2e-4), step
        for layer, logits in zip(ours.model.layers, out.router_logits, strict=True):
            load = torch.nn.functional.one_hot(torch.topk(logits, cfg.experts_per_token).indices.reshape(-1),
                                               cfg.n_experts).sum(0)
            assert (layer.mlp.load - load).abs().sum() <= 2, step  # a near tie may fall the other way
            assert layer.mlp.load.max() / layer.mlp.load.float().mean() < 1.6, step
    assert total.item() < 1.0  # it learnt the text


def test_document_masking_isolates_packed_documents():
    """With masking, a document packed after another gets the logits it would get alone."""
    cfg = dataclasses.replace(PRESETS["tiny"], n_layers=2)
    model = materialise(cfg, seed=2, rope_len=64).eval()
    eos = 257
    gen = torch.Generator().manual_seed(0)
    first, second = torch.randint(0, 256, (1, 20), generator=gen), torch.randint(0, 256, (1, 30), generator=gen)
    packed = torch.cat([first, torch.tensor([[eos]]), second], dim=1)
    with torch.no_grad():
        masked = model(packed, eos_id=eos)
        alone = model(second)
        plain = model(packed)
    torch.testing.assert_close(masked[:, 21:], alone, rtol=0, atol=1e-5)
    torch.testing.assert_close(masked[:, :21], plain[:, :21], rtol=0, atol=1e-5)  # the first is unaffected
    assert (plain[:, 21:] - alone).abs().max() > 1e-3  # without masking the second sees the first


DEVICES = ["cpu", *(["cuda"] if torch.cuda.is_available() else [])]


def _qkv(device, T, dtype, grad):
    gen = torch.Generator().manual_seed(T)
    q, k, v = (torch.randn(2, h, T, 16, generator=gen).to(device, dtype).requires_grad_(grad) for h in (4, 2, 2))
    return q, k, v


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("T", [256, 200])  # two full 128-blocks; a partial last block
@pytest.mark.parametrize("kind", ["documents", "window", "both"])
def test_fused_masked_attention_matches_the_dense_reference(device, T, kind):
    """FlexAttention with the block mask against SDPA with the dense (B, 1, T, T) mask, grouped K/V
    heads included: forward on the CPU (FlexAttention has no CPU backward), forward and backward
    on a GPU."""
    from fsdpkit.train.model.attention import AttentionMask, document_ids, masked_attention

    gen = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, 50, (2, T), generator=gen)
    tokens[0, [30, 31, 140]] = 99  # documents end at 30, 31 (one token long) and 140; row 1 has none
    mask = AttentionMask(T, document_ids(tokens.to(device), 99) if kind != "window" else None,
                         48 if kind != "documents" else None)
    gpu = device == "cuda"
    dtype = torch.bfloat16 if gpu else torch.float32
    q, k, v = _qkv(device, T, dtype, grad=gpu)
    fused = masked_attention(q, k, v, mask, fused=True)
    dense = masked_attention(q, k, v, mask, fused=False)
    tol = 2e-2 if gpu else 1e-5
    torch.testing.assert_close(fused, dense, rtol=0, atol=tol)
    if gpu:
        g = torch.randn_like(fused)
        grads = [torch.autograd.grad(out, (q, k, v), g) for out in (fused, dense)]
        for a, b in zip(*grads, strict=True):
            torch.testing.assert_close(a, b, rtol=0, atol=5 * tol)


@pytest.mark.parametrize("device", DEVICES)
def test_grouped_experts_match_the_loop(device):
    """Tokens sorted by expert once and two grouped products against one expert at a time:
    outputs and every gradient, with an expert that gets no token."""
    from fsdpkit.train.model.transformer import Experts, grouped_mm_supported

    cfg = CASES["mixtral_moe"]
    gen = torch.Generator().manual_seed(5)
    experts = Experts(cfg).to(device)
    with torch.no_grad():
        for p_ in experts.parameters():
            p_.copy_(torch.randn(p_.shape, generator=gen) * 0.05)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    experts = experts.to(dtype)
    x = torch.randn(40, cfg.dim, generator=gen).to(device, dtype).requires_grad_()
    top_idx = torch.randint(0, cfg.n_experts - 1, (40, 2), generator=gen).to(device)  # expert 3: no token
    top_w = torch.softmax(torch.randn(40, 2, generator=gen), -1).to(device, dtype)
    assert grouped_mm_supported(x)
    g = torch.randn(40, cfg.dim, generator=gen).to(device, dtype)
    results = []
    for run in (experts.forward, experts.forward_loop):
        out = run(x, top_idx, top_w)
        results.append((out, *torch.autograd.grad(out, (x, *experts.parameters()), g)))
    tol = 3e-2 if dtype == torch.bfloat16 else 1e-5
    for a, b in zip(*results, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=tol)
    assert results[0][2][3].abs().max() == 0  # the unused expert's gate/up gradient


@pytest.mark.parametrize("tied", [False, True])
def test_flops_per_token_counts_every_matmul_the_model_does(tied):
    """The MFU numerator is the matmul work one training token costs: torch's FLOP counter over a
    real forward and backward agrees with the formula, a tied output head included (it multiplies
    as an untied one does). Attention scores are the formula's separate term (newer torch counts
    the CPU flash-attention ops too, older does not: only matrix products are compared); RMSNorm
    weights are counted as parameters though they do no matmul."""
    from torch.utils.flop_counter import FlopCounterMode

    from fsdpkit.train.model.flops import flops_per_token

    cfg = dataclasses.replace(PRESETS["tiny"], tie_embeddings=tied)
    model = Transformer(cfg, rope_len=64)
    model.init_weights()
    for layer in model.model.layers:
        layer.self_attn.kernel = "sdpa"  # the counter does not see inside the CPU attention kernel
    tokens = torch.randint(0, cfg.vocab_size, (2, 64))
    counter = FlopCounterMode(display=False)
    with counter:
        model.loss(tokens, tokens)[1].backward()
    attention = 12 * cfg.n_layers * cfg.n_heads * cfg.head_size * 64
    norms = 6 * cfg.dim * (2 * cfg.n_layers + 1)
    matmuls = sum(v for op, v in counter.get_flop_counts()["Global"].items()
                  if str(op).split(".")[-1] in ("mm", "addmm", "bmm", "matmul", "linear"))
    assert flops_per_token(cfg, 64) - attention - norms == matmuls / tokens.numel()
