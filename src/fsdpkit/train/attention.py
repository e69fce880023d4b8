"""Causal attention: PyTorch's scaled_dot_product_attention on every device. On GPUs its flash and
memory-efficient kernels skip the masked half; on the CPU (where fsdpkit is tested, not run for
speed) it is PyTorch's own CPU kernel."""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor


def causal_attention(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
    """softmax(q k^T / sqrt(d), causal) v for q (B, H, T, d) and k, v (B, H_kv, T, d), H_kv dividing H."""
    k, v = expand_kv(k, v, q.shape[1])
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def expand_kv(k: Tensor, v: Tensor, n_heads: int) -> tuple[Tensor, Tensor]:
    """Repeat grouped K/V heads to one per query head. Expanding (rather than SDPA's enable_gqa)
    keeps every SDPA backend, flash included, usable on every device."""
    rep = n_heads // k.shape[1]
    if rep == 1:
        return k, v
    return k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
