"""Causal attention: PyTorch's SDPA, and on the CPU kernels that skip the masked half.

On the CPU the default is fsdpkit's own fp32 kernel (fsdpkit.train.native_attention, 64-token
tiles on and below the diagonal, head sizes 32/64/128), built at first use: at the debug preset's
shape it runs forward+backward in about half the time of the SDPA blocks below. Where it cannot be
built (no compiler) or has no kernel for the head size, the SDPA blocks are used.

The blocks: PyTorch's CPU flash-attention kernel splits keys into blocks of 512, so below 1024 tokens it
computes the whole T x T score matrix and masks half of it away: a causal call costs the same as
a non-causal one (measured: 0.190 s vs 0.191 s fwd+bwd at 16 x 8 heads x 512 tokens). Splitting
the queries into 256-token blocks, each attending causally to its own block and fully to the
blocks before it, skips a quarter of that work at 512 tokens and more at longer sequences. The
partial results are merged with their log-sum-exps, and backward runs the same kernel's backward
on each piece against the merged output, which is exact (as ring attention does across GPUs).

In bf16 runs the blocks are computed in fp32: the CPU kernel is faster in fp32 than in bf16 at
these sizes (and it is more precise). GPUs keep SDPA, whose flash kernels skip masked blocks.
Both kernels are registered as custom ops, so torch.compile traces around them without a break.
Their fake (meta) kernels must give the real outputs' strides: inductor asserts them. Inductor's
on-disk cache does not key on a fake kernel's code, so after changing one, clear the cache
(/tmp/torchinductor_$USER, or --compile_cache_dir) or a stale graph fails the stride assertion.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import Tensor

from fsdpkit.train import native_attention

BLOCK = 256
_fwd = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
_bwd = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward


def causal_attention(q: Tensor, k: Tensor, v: Tensor, kernel: str = "auto") -> Tensor:
    """softmax(q k^T / sqrt(d), causal) v for q (B, H, T, d) and k, v (B, H_kv, T, d), H_kv dividing H."""
    if kernel in ("auto", "blocks") and q.device.type == "cpu":
        if q.dtype == torch.bfloat16 and torch.compiler.is_compiling():
            return CompiledCausalBlocks.apply(q, k, v)
        # Both CPU kernels share each K/V head among its query heads themselves (no expanded copies).
        if kernel == "auto" and native_attention.supports(q):
            return cpu_causal_tiles(q, k, v)[0]
        out, _ = cpu_causal_blocks(q, k, v, BLOCK)
        return out
    k, v = expand_kv(k, v, q.shape[1])
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def expand_kv(k: Tensor, v: Tensor, n_heads: int) -> tuple[Tensor, Tensor]:
    """Repeat grouped K/V heads to one per query head. Expanding (rather than SDPA's enable_gqa)
    keeps every SDPA backend, flash included, usable on every device."""
    rep = n_heads // k.shape[1]
    if rep == 1:
        return k, v
    return k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)


def _blocks(t: int, block: int) -> list[tuple[int, int]]:
    return [(s, min(s + block, t)) for s in range(0, t, block)]


@torch.library.custom_op("fsdpkit::cpu_causal_blocks", mutates_args=())
def cpu_causal_blocks(q: Tensor, k: Tensor, v: Tensor, block: int) -> tuple[Tensor, Tensor]:
    """Output in the inputs' dtype and the fp32 log-sum-exp per query. Computed in fp32; autograd
    saves the inputs and output in their own dtype (half the bytes of fp32 copies in bf16 runs)."""
    dtype, scale = q.dtype, q.shape[-1] ** -0.5
    q, k, v = q.float(), k.float(), v.float()
    outs, lses = [], []
    for s, e in _blocks(q.shape[2], block):
        qi = q[:, :, s:e]
        o_own, l_own = _fwd(qi, k[:, :, s:e], v[:, :, s:e], 0.0, True, scale=scale)[:2]
        if s == 0:
            outs.append(o_own)
            lses.append(l_own)
            continue
        o_past, l_past = _fwd(qi, k[:, :, :s], v[:, :, :s], 0.0, False, scale=scale)[:2]
        lse = torch.logaddexp(l_own, l_past)
        outs.append(o_own * torch.exp(l_own - lse).unsqueeze(-1) + o_past * torch.exp(l_past - lse).unsqueeze(-1))
        lses.append(lse)
    return torch.cat(outs, 2).to(dtype), torch.cat(lses, -1)


@cpu_causal_blocks.register_fake
def _(q: Tensor, k: Tensor, v: Tensor, block: int) -> tuple[Tensor, Tensor]:
    return q.new_empty(q.shape), q.new_empty(q.shape[:3], dtype=torch.float32)


@torch.library.custom_op("fsdpkit::cpu_causal_blocks_backward", mutates_args=())
def cpu_causal_blocks_backward(grad: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                               block: int) -> tuple[Tensor, Tensor, Tensor]:
    dtype, scale = q.dtype, q.shape[-1] ** -0.5
    grad, q, k, v, out = (t.float().contiguous() for t in (grad, q, k, v, out))
    blocks = _blocks(q.shape[2], block)
    # Each block's gradient is the sum of its pieces, joined once at the end: no zero-filled
    # buffers to accumulate into (they cost a fill and an add per piece on the CPU).
    dq, dk, dv = [], [[] for _ in blocks], [[] for _ in blocks]
    for i, (s, e) in enumerate(blocks):
        g, qi, oi, li = grad[:, :, s:e], q[:, :, s:e], out[:, :, s:e], lse[:, :, s:e]
        a, b, c = _bwd(g, qi, k[:, :, s:e], v[:, :, s:e], oi, li, 0.0, True, scale=scale)
        dk[i].append(b)
        dv[i].append(c)
        if s:
            a_past, b_past, c_past = _bwd(g, qi, k[:, :, :s], v[:, :, :s], oi, li, 0.0, False, scale=scale)
            a = a + a_past
            for j, (s2, e2) in enumerate(blocks[:i]):
                dk[j].append(b_past[:, :, s2:e2])
                dv[j].append(c_past[:, :, s2:e2])
        dq.append(a)

    def join(parts: list[Tensor]) -> Tensor:
        return torch.cat(parts, 2).to(dtype)

    def summed(per_block: list[list[Tensor]]) -> list[Tensor]:
        return [functools.reduce(torch.add, pieces) for pieces in per_block]

    return join(dq), join(summed(dk)), join(summed(dv))


@cpu_causal_blocks_backward.register_fake
def _(grad: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
      block: int) -> tuple[Tensor, Tensor, Tensor]:
    # The real kernel returns contiguous tensors, whatever the strides of its inputs.
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _setup(ctx, inputs, output) -> None:
    q, k, v, block = inputs
    out, lse = output
    ctx.mark_non_differentiable(lse)  # a by-product for the backward; nothing may train through it
    ctx.save_for_backward(q, k, v, out, lse)
    ctx.block = block


def _backward(ctx, grad_out: Tensor, grad_lse: Tensor):
    q, k, v, out, lse = ctx.saved_tensors
    dq, dk, dv = cpu_causal_blocks_backward(grad_out, q, k, v, out, lse, ctx.block)
    return dq, dk, dv, None


cpu_causal_blocks.register_autograd(_backward, setup_context=_setup)


@torch.library.custom_op("fsdpkit::cpu_causal_tiles", mutates_args=())
def cpu_causal_tiles(q: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
    """fsdpkit's own kernel (fsdpkit.train.native_attention): output in the inputs' dtype and the
    fp32 log-sum-exp per query, computed in fp32 over 64-token tiles on and below the diagonal."""
    out, lse = native_attention.forward(q, k, v)
    return out.to(q.dtype), lse


@cpu_causal_tiles.register_fake
def _(q: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
    return q.new_empty(q.shape), q.new_empty(q.shape[:3], dtype=torch.float32)


@torch.library.custom_op("fsdpkit::cpu_causal_tiles_backward", mutates_args=())
def cpu_causal_tiles_backward(grad: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor,
                              lse: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    grads = native_attention.backward(grad, q, k, v, out, lse)
    return tuple(g.to(q.dtype) for g in grads)


@cpu_causal_tiles_backward.register_fake
def _(grad: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _setup_tiles(ctx, inputs, output) -> None:
    out, lse = output
    ctx.mark_non_differentiable(lse)
    ctx.save_for_backward(*inputs, out, lse)


def _backward_tiles(ctx, grad_out: Tensor, grad_lse: Tensor):
    return cpu_causal_tiles_backward(grad_out, *ctx.saved_tensors)


cpu_causal_tiles.register_autograd(_backward_tiles, setup_context=_setup_tiles)


COMPILED_BLOCK = 64


def _query_blocks(t: int) -> list[tuple[int, int]]:
    return _blocks(t, COMPILED_BLOCK)


def _causal_mask(s: int, e: int, device: torch.device) -> Tensor:
    """(e - s, e): query s + i may see keys 0 .. s + i."""
    return torch.arange(s, e, device=device).view(-1, 1) >= torch.arange(e, device=device).view(1, -1)


def _grouped(q: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Views of q as (B * H_kv, G, T, d) and of k, v as (B * H_kv, T, d): G query heads per K/V head."""
    B, H, T, D = q.shape
    Hk = k.shape[1]
    return q.reshape(B * Hk, H // Hk, T, D), k.reshape(B * Hk, T, D), v.reshape(B * Hk, T, D)


def _block_scores(qb: Tensor, kg: Tensor, s: int, e: int) -> Tensor:
    """fp32 scaled scores (B * H_kv, G, e - s, e) of the query block s..e, laid out (B * H_kv, G * (e - s), d),
    against keys 0..e."""
    scores = torch.bmm(qb, kg[:, :e].transpose(1, 2)).float() * qb.shape[-1] ** -0.5
    return scores.view(kg.shape[0], -1, e - s, e)


class CompiledCausalBlocks(torch.autograd.Function):
    """Causal attention written as bf16 matrix products and softmax arithmetic, for torch.compile on
    the CPU (bf16 compute).

    PyTorch's CPU flash kernel runs at the fp32 matmul rate whatever the input dtype, a third of
    the bf16 rate on CPUs with AVX512-BF16. Here the products are bf16 GEMMs (fp32 accumulation)
    and inductor fuses the mask, exp and sums between them. Queries go in blocks of 64 tokens, each
    against the keys up to its end only, so the masked half is skipped and a block's scores stay
    small; GQA shares each K/V head among its query heads by a view, without copies. Backward
    recomputes the scores from the saved log-sum-exp, as flash attention does, so autograd keeps
    only q, k, v, the output and one fp32 number per query. Measured fwd+bwd at 1 thread
    (16 x 8 heads x 512 x 32, bf16): 164 ms against 229 ms for the flash-kernel blocks. Scores are
    rounded to bf16 between the products (as eager bf16 attention does): relative error about
    4e-3 against fp32, where the fp32 kernel gives 2e-3.
    """

    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        B, H, T, D = q.shape
        qg, kg, vg = _grouped(q, k, v)
        BHk, G = kg.shape[0], qg.shape[1]
        outs, lses = [], []
        for s, e in _query_blocks(T):
            qb = qg[:, :, s:e].reshape(BHk, G * (e - s), D)
            scores = _block_scores(qb, kg, s, e).masked_fill(~_causal_mask(s, e, q.device), float("-inf"))
            lse = torch.logsumexp(scores, -1)
            p = torch.exp(scores - lse.unsqueeze(-1)).to(q.dtype).view(BHk, G * (e - s), e)
            outs.append(torch.bmm(p, vg[:, :e]).view(BHk, G, e - s, D))
            lses.append(lse)
        out = torch.cat(outs, 2).view(B, H, T, D)
        ctx.save_for_backward(q, k, v, out, torch.cat(lses, 2))
        return out

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        q, k, v, out, lse = ctx.saved_tensors
        B, H, T, D = q.shape
        qg, kg, vg = _grouped(q, k, v)
        BHk, G, scale = kg.shape[0], qg.shape[1], D ** -0.5
        grad = grad.contiguous()
        gg = grad.view(BHk, G, T, D)
        delta = (grad.float() * out.float()).sum(-1).view(BHk, G, T)  # rowsum(dO * O)
        dq, dk, dv = [], [], []
        for s, e in _query_blocks(T):
            n = G * (e - s)
            qb, gb = qg[:, :, s:e].reshape(BHk, n, D), gg[:, :, s:e].reshape(BHk, n, D)
            scores = _block_scores(qb, kg, s, e)
            p = torch.exp(scores - lse[:, :, s:e].unsqueeze(-1)).masked_fill(~_causal_mask(s, e, q.device), 0.0)
            dp = torch.bmm(gb, vg[:, :e].transpose(1, 2)).float().view(BHk, G, e - s, e)
            ds = (p * (dp - delta[:, :, s:e].unsqueeze(-1)) * scale).to(q.dtype).view(BHk, n, e)
            dv.append((e, torch.bmm(p.to(q.dtype).view(BHk, n, e).transpose(1, 2), gb)))
            dk.append((e, torch.bmm(ds.transpose(1, 2), qb)))
            dq.append(torch.bmm(ds, kg[:, :e]).view(BHk, G, e - s, D))

        def keys_sum(parts: list[tuple[int, Tensor]]) -> Tensor:
            # Block i's product covers keys 0 .. e_i: add them up, each over its own prefix.
            total = torch.zeros(BHk, T, D, dtype=torch.float32, device=q.device)
            for e, part in parts:
                total[:, :e] += part
            return total.view(k.shape).to(q.dtype)

        return torch.cat(dq, 2).view(B, H, T, D), keys_sum(dk), keys_sum(dv)
