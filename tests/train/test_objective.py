"""The step's objective as the trainer and the validator call it: next-token cross-entropy (the DPO
objective is tested beside DPO, tests/train/test_dpo.py)."""

from __future__ import annotations

import torch

from fsdpkit.train.data import ByteTokenizer
from fsdpkit.train.data.stream import Batch
from fsdpkit.train.model.config import ModelConfig
from fsdpkit.train.model.transformer import Transformer
from fsdpkit.train.objective import NextToken


def test_next_token_is_the_model_s_loss_with_the_run_s_document_masking():
    torch.manual_seed(0)
    model = Transformer(ModelConfig(vocab_size=258, dim=32, n_layers=1, n_heads=2, n_kv_heads=1, ffn_dim=48,
                                    max_seq_len=64), rope_len=64)
    model.init_weights(seed=1)
    eos = ByteTokenizer.eos_id
    tokens = torch.randint(0, 256, (2, 17), generator=torch.Generator().manual_seed(2))
    tokens[:, 6] = eos   # two documents in each row
    batch = Batch(tokens[:, :-1], tokens[:, 1:], [0, 1])
    with torch.no_grad():
        plain = NextToken()(model, batch, torch.device("cpu"))
        masked = NextToken(eos)(model, batch, torch.device("cpu"))
        ce, total = model.loss(batch.inputs, batch.targets, eos)
    assert masked.loss.item() == ce.item() and masked.total.item() == total.item() and masked.sums is None
    assert plain.loss.item() == model.loss(batch.inputs, batch.targets)[0].item()
    assert plain.loss.item() != masked.loss.item()   # attention across the document end changes the loss
    docs = torch.cat([torch.ones(2, 8, dtype=torch.long), 2 * torch.ones(2, 8, dtype=torch.long)], dim=1)
    with torch.no_grad():
        by_docs = NextToken()(model, batch._replace(docs=docs), torch.device("cpu"))
    assert by_docs.loss.item() == model.loss(batch.inputs, batch.targets, None, docs)[0].item()
