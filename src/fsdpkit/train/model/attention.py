"""Causal attention, with or without a mask (packed documents, a sliding window).

Plain causal attention is PyTorch's scaled_dot_product_attention on every device: on GPUs its
flash kernel skips the masked half. A mask would push SDPA off flash onto a dense (T x T) path, so
on CUDA masked attention is FlexAttention with a block mask built once per batch: fully masked
blocks are skipped, grouped K/V heads are read as they are (no expansion), and it stays a fused
kernel at any length. The CPU, where fsdpkit is tested rather than run for speed, keeps the dense
reference (FlexAttention has no CPU backward)."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.nn.attention.flex_attention import create_block_mask, flex_attention


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


def document_ids(tokens: Tensor, eos_id: int) -> Tensor:
    """(B, T) index of the document each token belongs to in a packed sequence (an EOS token
    belongs to the document it ends). RoPE is relative, so positions need no reset at starts."""
    is_eos = (tokens == eos_id).long()
    return torch.cumsum(is_eos, dim=1) - is_eos


@dataclass
class AttentionMask:
    """What masked attention may see beyond causality: the same document (`doc`, (B, T) ids) and
    at most `window` tokens back. Built once per batch and shared by every layer; the fused form
    (a FlexAttention block mask) is made on first use and kept."""

    T: int
    doc: Tensor | None = None
    window: int | None = None
    _block: Any = None

    def dense(self, device: torch.device) -> Tensor:
        """(B or 1, 1, T, T) bool on `device`: the reference form, for SDPA."""
        i = torch.arange(self.T, device=device)
        offset = i[:, None] - i[None, :]
        mask = offset >= 0
        if self.window is not None:
            mask = mask & (offset < self.window)
        if self.doc is not None:
            return (mask & (self.doc[:, :, None] == self.doc[:, None, :])).unsqueeze(1)
        return mask[None, None]

    def block_mask(self, device: torch.device) -> Any:
        if self._block is None:
            doc, window = self.doc, self.window

            def mask_mod(b: Tensor, h: Tensor, q: Tensor, kv: Tensor) -> Tensor:
                keep = q >= kv
                if window is not None:
                    keep = keep & (q - kv < window)
                if doc is not None:
                    keep = keep & (doc[b, q] == doc[b, kv])
                return keep

            batch = doc.shape[0] if doc is not None else None
            # Compiled on CUDA, as FlexAttention's authors advise: eager creation evaluates the mask
            # on the whole B x T x T grid (a quarter of a GB at T=8192, B=4).
            self._block = create_block_mask(mask_mod, batch, None, self.T, self.T, device=device,
                                            _compile=torch.device(device).type == "cuda")
        return self._block


@functools.cache
def _compiled_flex() -> Any:
    return torch.compile(flex_attention, dynamic=False)


def flex(q: Tensor, k: Tensor, v: Tensor, block_mask: Any) -> Tensor:
    """FlexAttention, compiled once on CUDA: uncompiled it is an unfused reference, not a kernel
    (which is all the CPU, forward only, gets). Inside a compiled block (--compile) the block's
    graph takes it in directly."""
    fn = _compiled_flex() if q.device.type == "cuda" else flex_attention
    return fn(q, k, v, block_mask=block_mask, enable_gqa=k.shape[1] != q.shape[1])


def masked_attention(q: Tensor, k: Tensor, v: Tensor, mask: AttentionMask, fused: bool | None = None) -> Tensor:
    """Causal attention under `mask`: FlexAttention on CUDA (fused), SDPA with the dense mask
    elsewhere. `fused` forces one (the tests compare them)."""
    if fused is None:
        fused = q.device.type == "cuda"
    if fused:
        return flex(q, k, v, mask.block_mask(q.device))
    k, v = expand_kv(k, v, q.shape[1])
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask.dense(q.device))
