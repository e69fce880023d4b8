"""The peers fsdpkit is measured against, on fsdpkit's batches (the same tokens), so only the
training differs.

The baseline: training done the way the reference FSDP example does it. Hugging Face
`transformers` `LlamaForCausalLM` built from the same model config (SDPA attention), built whole
on the CPU as the reference does, `fully_shard` on every decoder layer and on the root, bf16
parameters in compute where the run asks for it (fp32 gradient reduction), AdamW with PyTorch's
defaults for the device, gradient clipping, the loss from the model's own loss function.

The compiled peer: what a transformers user does on one GPU, the same model under
`torch.compile`, one process, either fp32 weights under bf16 autocast (what fsdpkit does with one
process) or the weights themselves in bf16.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from fsdpkit.train.config import TrainConfig
from fsdpkit.train.data import BatchStream, get_source, get_tokenizer
from fsdpkit.train.model.hf_config import hf_config_dict
from fsdpkit.train.runtime.dist import Runtime


def hf_config(cfg: TrainConfig) -> Any:
    """The transformers config of the run's model, made locally (no hub)."""
    from transformers import AutoConfig

    d = hf_config_dict(cfg.shape)
    d.pop("architectures")
    return AutoConfig.for_model(d.pop("model_type"), **d)


def hf_model(cfg: TrainConfig) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(cfg.seed)
    return AutoModelForCausalLM.from_config(hf_config(cfg), attn_implementation="sdpa")


def build(cfg: TrainConfig, rt: Runtime, dtype: torch.dtype) -> torch.nn.Module:
    model = hf_model(cfg)
    mesh = init_device_mesh(rt.device.type, (rt.world_size,))
    mp = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    return model.to(rt.device)


def train_steps(cfg: TrainConfig, rt: Runtime, dtype: torch.dtype, steps: int) -> list[float]:
    """Seconds per optimizer step for `steps` steps (the loss is read every step, as the reference
    logs it, which is also what makes the step time a true wall time on a GPU)."""
    return _train(cfg, rt, build(cfg, rt, dtype), contextlib.nullcontext, steps)


def train_steps_compiled(cfg: TrainConfig, rt: Runtime, weights: str, steps: int, compile: bool = True) -> list[float]:
    """The compiled peer: `weights` "fp32" (under bf16 autocast) or "bf16". `compile=False` runs the
    same model eagerly (the smoke's peer: every path of the row but torch.compile's cold start)."""
    model = hf_model(cfg).to(rt.device, torch.bfloat16 if weights == "bf16" else torch.float32)
    compiled = torch.compile(model) if compile else model

    def region() -> contextlib.AbstractContextManager:
        if weights == "bf16":
            return contextlib.nullcontext()
        return torch.autocast(rt.device.type, dtype=torch.bfloat16)

    return _train(cfg, rt, compiled, region, steps, params=list(model.parameters()))


def batches(cfg: TrainConfig, rt: Runtime) -> Iterator[tuple[torch.Tensor, torch.Tensor, Any]]:
    """fsdpkit's batches of the run, this rank's share."""
    d = cfg.data
    source, tok = get_source(d.dataset, d.train_split, cfg.seed), get_tokenizer(d.tokenizer)
    return iter(BatchStream(source, tok, d.seq_len, d.train_batch_size, rt.rank, rt.world_size, cfg.seed))


def _train(cfg: TrainConfig, rt: Runtime, model: torch.nn.Module,
           region: Callable[[], contextlib.AbstractContextManager], steps: int,
           params: list[torch.nn.Parameter] | None = None) -> list[float]:
    params = params or list(model.parameters())
    o = cfg.optim
    optimizer = torch.optim.AdamW(params, lr=o.lr, betas=(o.beta1, o.beta2), weight_decay=o.weight_decay)
    stream = batches(cfg, rt)
    model.train()
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        batch = next(stream)
        x, y = batch.inputs, batch.targets
        x, y = x.to(rt.device), y.to(rt.device)
        # shift_labels: the targets are already shifted, so every position has its next token.
        with region():
            loss = model(input_ids=x, labels=y, shift_labels=y).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, o.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        loss.item()
        times.append(time.perf_counter() - start)
    return times
