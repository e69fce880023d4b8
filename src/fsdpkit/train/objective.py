"""What a step minimises, the same for training and validation: next-token cross-entropy (language
modelling, SFT) or a preference loss (DPO, fsdpkit.train.dpo) against a reference."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Protocol

import torch

from fsdpkit.train.data.stream import Batch
from fsdpkit.train.dpo import LossKind, batch_answers, preference_loss
from fsdpkit.train.model.lora import adapters_disabled
from fsdpkit.train.model.transformer import Transformer


@dataclass
class StepLoss:
    """One batch's loss as reported, the total that is differentiated (the loss plus MoE balancing),
    and, for a preference loss, the sums of TRL's metrics with the pair count last."""

    loss: torch.Tensor
    total: torch.Tensor
    sums: torch.Tensor | None = None


class Objective(Protocol):
    def __call__(self, model: Transformer, batch: Batch, device: torch.device) -> StepLoss: ...


@dataclass
class NextToken:
    """Mean next-token cross-entropy over the batch's targets; `eos_id` masks attention at
    document ends where the run asks for it (chat batches bring their own document ids)."""

    eos_id: int | None = None

    def __call__(self, model: Transformer, batch: Batch, device: torch.device) -> StepLoss:
        x, y = batch.inputs.to(device, non_blocking=True), batch.targets.to(device, non_blocking=True)
        docs = None if batch.docs is None else batch.docs.to(device, non_blocking=True)
        ce, total = model.loss(x, y, self.eos_id, docs)
        return StepLoss(ce, total)


@dataclass
class DPO:
    """DPO against `reference`, a frozen copy of the starting model; None: the policy itself with
    its LoRA adapters off (the base it started from)."""

    reference: Transformer | None
    beta: float
    kind: LossKind

    def __call__(self, model: Transformer, batch: Batch, device: torch.device) -> StepLoss:
        reference = self.reference or model
        off = adapters_disabled(model) if self.reference is None else contextlib.nullcontext()
        with torch.no_grad(), off:
            ref = batch_answers(reference.token_logps, batch, device)
        out = preference_loss(batch_answers(model.token_logps, batch, device), ref, self.beta, self.kind)
        return StepLoss(out.loss, out.loss, torch.cat([out.sums, out.pairs[None]]))
