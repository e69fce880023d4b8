"""The baseline fsdpkit is measured against: training done the way the reference FSDP example does it.

Hugging Face `transformers` `LlamaForCausalLM` built from the same model config (SDPA attention),
built whole on the CPU as the reference does, `fully_shard` on every decoder layer and on the
root, bf16 parameters in compute where the run asks for it (fp32 gradient reduction), AdamW with
PyTorch's defaults for the device, gradient clipping, the loss from the model's own loss function.
The batches are fsdpkit's (the same tokens), so only the training differs.
"""

from __future__ import annotations

import time

import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from fsdpkit.train.config import TrainConfig
from fsdpkit.train.data import BatchStream, get_source, get_tokenizer
from fsdpkit.train.dist import Runtime
from fsdpkit.train.hf_config import hf_config_dict


def build(cfg: TrainConfig, rt: Runtime, dtype: torch.dtype) -> torch.nn.Module:
    from transformers import AutoConfig, AutoModelForCausalLM

    d = hf_config_dict(cfg.shape)
    d.pop("architectures")
    hf_cfg = AutoConfig.for_model(d.pop("model_type"), **d)
    torch.manual_seed(cfg.seed)
    model = AutoModelForCausalLM.from_config(hf_cfg, attn_implementation="sdpa")
    mesh = init_device_mesh(rt.device.type, (rt.world_size,))
    mp = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    return model.to(rt.device)


def train_steps(cfg: TrainConfig, rt: Runtime, dtype: torch.dtype, steps: int) -> list[float]:
    """Seconds per optimizer step for `steps` steps (the loss is read every step, as the reference
    logs it, which is also what makes the step time a true wall time on a GPU)."""
    model = build(cfg, rt, dtype)
    o = cfg.optim
    optimizer = torch.optim.AdamW(model.parameters(), lr=o.lr, betas=(o.beta1, o.beta2),
                                  weight_decay=o.weight_decay)
    d = cfg.data
    source, tok = get_source(d.dataset, d.train_split, cfg.seed), get_tokenizer(d.tokenizer)
    stream = iter(BatchStream(source, tok, cfg.data.seq_len, d.train_batch_size, rt.rank, rt.world_size, cfg.seed))
    model.train()
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        x, y, _ = next(stream)
        x, y = x.to(rt.device), y.to(rt.device)
        # shift_labels: the targets are already shifted, so every position has its next token.
        loss = model(input_ids=x, labels=y, shift_labels=y).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), o.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        loss.item()
        times.append(time.perf_counter() - start)
    return times
