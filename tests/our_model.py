"""fsdpkit's own model loaded from a Hugging Face directory (the fine-tuning tests compare with it)."""

from __future__ import annotations

import torch

from fsdpkit.train.model.hf import load_hf_into
from fsdpkit.train.model.hf_config import model_config_from_hf
from fsdpkit.train.model.transformer import Transformer


def load_ours(hf_dir):
    """fsdpkit's model with a Hugging Face directory's weights, for evaluation."""
    cfg = model_config_from_hf(hf_dir)
    with torch.device("meta"):
        model = Transformer(cfg, rope_len=256)
    model.to_empty(device="cpu")
    model.init_weights()
    load_hf_into(model, hf_dir, cfg)
    return model.eval()
