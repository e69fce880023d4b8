"""fsdpkit's own CPU attention kernel (built here at first use) computes what SDPA computes."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from fsdpkit.train import native_attention
from fsdpkit.train.attention import causal_attention, cpu_causal_tiles, expand_kv


def _reference(q, k, v, grad):
    """fp64 SDPA outputs and gradients, the yardstick for the fp32 kernel."""
    ins = [t.detach().double().requires_grad_() for t in (q, k, v)]
    ek, ev = expand_kv(ins[1], ins[2], q.shape[1])
    out = F.scaled_dot_product_attention(ins[0], ek, ev, is_causal=True)
    return [out, *torch.autograd.grad(out, ins, grad.double())]


def test_the_kernel_builds_on_this_machine():
    """CI has a compiler, so the fast path must really be taken there (a silent fallback would hide a
    broken kernel behind PyTorch's)."""
    assert native_attention.library() is not None
    assert native_attention.supports(torch.empty(1, 1, 8, 32))
    assert not native_attention.supports(torch.empty(1, 1, 8, 16))  # no kernel for head size 16


@pytest.mark.parametrize("seq,heads,kv_heads,head_dim", [
    (64, 4, 2, 32),    # one whole tile, GQA
    (100, 4, 4, 32),   # a partial tile
    (200, 2, 1, 64),   # tiles and a partial one, 2 query heads per K/V head
    (130, 2, 2, 128),  # the largest head size
    (512, 8, 4, 32),   # the debug preset's attention
])
def test_native_attention_equals_sdpa_with_gradients(seq, heads, kv_heads, head_dim):
    torch.manual_seed(0)
    # The model's layout: (B, T, H, D) projections viewed as (B, H, T, D), read without copies.
    q = torch.randn(2, seq, heads, head_dim).transpose(1, 2).requires_grad_()
    k, v = (torch.randn(2, seq, kv_heads, head_dim).transpose(1, 2).requires_grad_() for _ in range(2))
    grad = torch.randn(2, heads, seq, head_dim)
    out = causal_attention(q, k, v, "auto")
    got = [out, *torch.autograd.grad(out, (q, k, v), grad)]
    for name, ours, want in zip(("out", "dq", "dk", "dv"), got, _reference(q, k, v, grad), strict=True):
        assert ours.shape == want.shape and ours.dtype == torch.float32
        err = ((ours.double() - want).norm() / want.norm()).item()
        assert err < 2e-6, (name, err)  # fp32 rounding; the blocked SDPA path gives the same order


def test_native_attention_takes_bf16_and_returns_bf16():
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 2, 160, 32) for _ in range(3))
    out = causal_attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), "auto")
    assert out.dtype == torch.bfloat16
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert (out.float() - ref).abs().max() < 0.03  # bf16 inputs and output, fp32 inside


def test_native_attention_ops_pass_torch_library_checks():
    """The fake kernels match the real ones (shapes, strides, dtypes), so torch.compile traces them."""
    q = torch.randn(1, 70, 4, 32).transpose(1, 2)
    k, v = (torch.randn(1, 70, 2, 32).transpose(1, 2) for _ in range(2))
    for dtype in (torch.float32, torch.bfloat16):
        args = tuple(t.detach().to(dtype).requires_grad_() for t in (q, k, v))
        torch.library.opcheck(cpu_causal_tiles, args)


def test_a_built_kernel_is_reused_from_the_cache(tmp_path):
    first = native_attention.build(tmp_path)
    stamp = first.stat().st_mtime_ns
    assert native_attention.build(tmp_path) == first and first.stat().st_mtime_ns == stamp
    assert [p.name for p in tmp_path.iterdir()] == [first.name]  # no temporary build left behind


_FALLBACK = """
import torch, torch.nn.functional as F
from fsdpkit.train import native_attention
from fsdpkit.train.attention import causal_attention
assert native_attention.library() is None
q, k, v = (torch.randn(1, 2, 100, 32, requires_grad=True) for _ in range(3))
out = causal_attention(q, k, v, "auto")
ref = F.scaled_dot_product_attention(q, k, v, is_causal=True)
torch.testing.assert_close(out, ref, atol=2e-6, rtol=1e-5)
print("fallback ok")
"""


def test_without_a_working_compiler_attention_falls_back_to_pytorch(tmp_path, monkeypatch):
    env = {**os.environ, "CXX": "false", "FSDPKIT_KERNEL_CACHE": str(tmp_path)}
    r = subprocess.run([sys.executable, "-c", _FALLBACK], env=env, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert "fallback ok" in r.stdout
    assert "attention kernel is unavailable, using PyTorch's: false failed" in r.stderr
    monkeypatch.setenv("CXX", "false")
    with pytest.raises(RuntimeError, match="failed"):
        native_attention.build(tmp_path)
