"""LoRA (Hu et al. 2021): a frozen projection plus a trained low-rank update, y = W x + (alpha / r) B A x.

An adapted projection stays an `nn.Linear` under its own name, with `lora_A` and `lora_B` beside
its weight, so the base weights keep their Hugging Face names (import and export are unchanged)
and the adapters are named as PEFT names them (`...q_proj.lora_A.weight`). Adapters are added on
the meta device before FSDP2 shards the model; the base weights are frozen, so gradients,
optimizer state and checkpoints hold the adapters alone.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import nn

from fsdpkit.train.model import nf4
from fsdpkit.train.model.config import LoraShape


class LoRALinear(nn.Linear):
    """A linear layer with a low-rank adapter; B starts at zero, so the adapted model starts as the base."""

    def __init__(self, base: nn.Linear, lora: LoraShape):
        super().__init__(base.in_features, base.out_features, bias=base.bias is not None,
                         device=base.weight.device, dtype=base.weight.dtype)
        self.lora_A = nn.Linear(base.in_features, lora.rank, bias=False, device=base.weight.device)
        self.lora_B = nn.Linear(lora.rank, base.out_features, bias=False, device=base.weight.device)
        self.scale = lora.scale
        self.dropout = nn.Dropout(lora.dropout) if lora.dropout else nn.Identity()
        self.enabled = True   # off: the frozen base alone (a preference loss's reference)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        base = F.linear(x, self.weight, self.bias)
        return base + self.lora_B(self.lora_A(self.dropout(x))) * self.scale if self.enabled else base


@contextlib.contextmanager
def adapters_disabled(model: nn.Module) -> Iterator[None]:
    """The model as its base computes it, adapters off, for the length of the block: the reference
    of a preference loss without a second copy of the model."""
    layers = [m for m in model.modules() if isinstance(m, LoRALinear)]
    for m in layers:
        m.enabled = False
    try:
        yield
    finally:
        for m in layers:
            m.enabled = True


def is_adapter(name: str) -> bool:
    """Whether a parameter (or state-dict key) is a LoRA adapter's A or B, by its name."""
    return ".lora_A." in name or ".lora_B." in name


def add_adapters(model: nn.Module, lora: LoraShape) -> list[str]:
    """Replace every target projection with its adapted form and freeze all but the adapters;
    returns the adapted modules' names. Called on the meta device, before sharding."""
    adapted = []
    for name, module in list(model.named_modules()):
        for child_name, child in list(module.named_children()):
            if child_name in lora.targets and type(child) is nn.Linear:
                setattr(module, child_name, LoRALinear(child, lora))
                adapted.append(f"{name}.{child_name}" if name else child_name)
    for pname, p in model.named_parameters():
        p.requires_grad_(is_adapter(pname))
    return adapted


def merge_adapters(state: dict[str, torch.Tensor], lora: LoraShape) -> dict[str, torch.Tensor]:
    """A full state dict with adapters as the plain weights they add up to (`W + scale * B A`),
    the adapter tensors dropped: what a merged Hugging Face export holds. Over an NF4 base (QLoRA)
    W is the base as the run trained against it: every projection quantized once and read back."""
    out = {}
    for name, t in state.items():
        if is_adapter(name):
            continue
        prefix = name.removesuffix(".weight")
        if lora.nf4 and nf4.is_projection(prefix):
            t = nf4.dequantized(t).to(t.dtype)
        if f"{prefix}.lora_A.weight" in state:
            a, b = state[f"{prefix}.lora_A.weight"].float(), state[f"{prefix}.lora_B.weight"].float()
            t = (t.float() + lora.scale * (b @ a)).to(t.dtype)
        out[name] = t
    return out


def adapter_tensors(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The adapters alone, under the names PEFT saves them with (`base_model.model.` prefixed, no
    adapter name)."""
    return {f"base_model.model.{k}": v for k, v in state.items() if is_adapter(k)}
