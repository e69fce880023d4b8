"""AdamW with weight decay only on matrices, the clipped step, and the warm-up + decay schedule."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from fsdpkit.train.sections import OptimConfig, ResolvedOptim


def param_groups(model: nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """Decay weight matrices; never norms, biases or embeddings (tied heads count as embeddings).
    Expert-parallel weights, DTensors on a mesh of their own, come in a group of their own after
    these two: one for-each or fused kernel takes the tensors of one mesh."""
    meshes: list[Any] = []
    groups: dict[tuple[int, bool], list[nn.Parameter]] = {(0, True): [], (0, False): []}
    seen: set[int] = set()
    for name, p in model.named_parameters():
        if not p.requires_grad or id(p) in seen:
            continue
        seen.add(id(p))
        mesh = _mesh_of(p)
        if mesh not in meshes:
            meshes.append(mesh)
        decays = not (p.ndim < 2 or "embed_tokens" in name or name.endswith("norm.weight"))
        groups.setdefault((meshes.index(mesh), decays), []).append(p)
    return [{"params": groups[k], "weight_decay": weight_decay if k[1] else 0.0}
            for k in sorted(groups, key=lambda k: (k[0], not k[1]))]


def _mesh_of(p: torch.Tensor) -> Any:
    return p.device_mesh if isinstance(p, DTensor) else None


def build_optimizer(model: nn.Module, o: OptimConfig) -> torch.optim.Optimizer:
    # Fused: one kernel over all parameters (far fewer launches than foreach).
    impl = {"fused": True} if o.fused_optimizer else {"foreach": True}
    return torch.optim.AdamW(param_groups(model, o.weight_decay), lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps,
                             **impl)


def gradient_norm(params: list[nn.Parameter]) -> torch.Tensor:
    """The global L2 norm of the gradients, one fp32 number on the device (sharded gradients'
    partial norms are reduced across ranks; each mesh's apart, then combined)."""
    by_mesh: dict[Any, list[torch.Tensor]] = {}
    for p in params:
        if p.grad is not None:
            by_mesh.setdefault(_mesh_of(p), []).append(p.grad)
    norms = []
    for grads in by_mesh.values():
        norm = torch.nn.utils.get_total_norm(grads, foreach=True)
        norms.append(norm.full_tensor() if isinstance(norm, DTensor) else norm)
    if len(norms) == 1:
        return norms[0]
    return torch.stack(norms).square().sum().sqrt() if norms else torch.zeros(())


def clipped_step(optimizer: torch.optim.Optimizer, max_norm: float) -> torch.Tensor:
    """Clip the gradients to a global norm of `max_norm` (0: no clipping), take the optimizer step,
    and return the norm before clipping. With the fused optimizer it never waits on the device.

    The fused AdamW kernel divides each gradient by `grad_scale` as it reads it, so clipping there
    costs no pass over the gradients of its own: clip_grad_norm_'s separate multiply reads and
    writes every gradient once more (fp32: 8 bytes per parameter, 10 GB a step at 1.2B parameters).
    With `found_inf` set the kernel leaves weights and moments alone, so a step whose gradients hold
    inf or nan is skipped instead of poisoning the weights (as GradScaler does for fp16).
    """
    params = [p for group in optimizer.param_groups for p in group["params"]]
    norm = gradient_norm(params)
    if optimizer.defaults.get("fused"):
        # Attributes the fused AdamW kernel reads (torch.optim.adamw._fused_adamw), not declared on Optimizer.
        optimizer.grad_scale = (norm / max_norm).clamp(min=1.0).float() if max_norm else None
        optimizer.found_inf = (~norm.isfinite()).float()
    elif not norm.isfinite():  # the for-each kernels cannot skip on the device: one read-back a step
        return norm
    elif max_norm:
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm, foreach=True)
    optimizer.step()
    return norm


def lr_at(step: int, o: ResolvedOptim) -> float:
    """Learning rate for optimizer step `step` (0-based): linear warm-up, then decay to min_lr."""
    warmup = o.warmup_steps
    if step < warmup:
        return o.lr * (step + 1) / warmup
    if o.lr_decay_style == "constant":
        return o.lr
    decay_steps = max(1, (o.lr_decay_iters or o.max_steps) - warmup)
    progress = min(1.0, (step - warmup) / decay_steps)
    if o.lr_decay_style == "linear":
        factor = 1.0 - progress
    else:
        factor = 0.5 * (1.0 + math.cos(math.pi * progress))
    floor = o.min_lr
    return floor + (o.lr - floor) * factor


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr
