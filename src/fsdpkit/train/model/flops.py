"""Model FLOPs per token as plain arithmetic: shared by the trainer's MFU (fsdpkit.train.observe.metrics)
and the capacity planner (fsdpkit.plan), which must not need torch."""

from __future__ import annotations

from fsdpkit.train.model.config import ModelConfig, count_params


def flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
    """Training FLOPs per token: 6 x the (active) parameters that multiply in a matmul, plus
    attention scores.

    Every parameter counts but the input embedding, whose lookup is free. A head tied to the
    embedding still multiplies (hidden x vocab per token, a fifth of llama3_2_1b's work): counting
    it is what PaLM, which ties its embeddings, does. The attention term is 12 x layers x heads x
    head_dim x context (forward and backward of QK^T and AV), the convention of PaLM and
    torchtitan; a sliding window caps the context.
    """
    lookup = 0 if cfg.tie_embeddings else cfg.vocab_size * cfg.dim  # a tied table is the head's weight too
    n = count_params(cfg, active=True) - lookup
    context = min(seq_len, cfg.sliding_window or seq_len)
    return 6 * n + 12 * cfg.n_layers * cfg.n_heads * cfg.head_size * context
