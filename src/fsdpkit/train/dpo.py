"""Direct preference optimisation (Rafailov et al. 2023) as TRL's DPOTrainer computes it: each
answer's log-probability summed over its tokens, under the policy and under the reference (the
model as training started); the loss of their log-ratios' difference (sigmoid, IPO or hinge); and
the rewards TRL reports (beta times each log-ratio), their margins and how often the chosen answer
wins.

The reference is the starting model: with LoRA the same model with its adapters off (no second
copy), else a frozen copy sharded as the policy is. Batches are packed preference rows
(fsdpkit.train.data.preference): a token's sequence number says which answer of which pair it
belongs to."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F

from fsdpkit.train.data.stream import IGNORE, Batch

LossKind = Literal["sigmoid", "ipo", "hinge"]
# The metrics TRL logs for DPO, in its names.
METRICS = ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen",
           "logps/rejected")


@dataclass
class Answers:
    """Per pair of a batch (rows x the most pairs a row can hold), the sum of each answer's token
    log-probabilities, its token count, and whether the pair is there (a row's unused slots are not)."""

    chosen: torch.Tensor
    rejected: torch.Tensor
    chosen_tokens: torch.Tensor
    rejected_tokens: torch.Tensor
    present: torch.Tensor


def answers(token_logps: torch.Tensor, targets: torch.Tensor, seqs: torch.Tensor) -> Answers:
    """Each answer's summed log-probability, from the (B, T) log-probabilities of a batch's targets
    and its tokens' sequence numbers (chosen of a row's k-th pair 2k+1, rejected 2k+2, padding 0).
    Fixed shapes throughout, so nothing waits on the device."""
    rows, width = seqs.shape
    # A row of width + 1 tokens holds at most (width + 1) // 2 pairs: numbers up to width + 1.
    slots = width + 2
    flat = (seqs + slots * torch.arange(rows, device=seqs.device)[:, None]).flatten()
    kept = (targets != IGNORE).flatten()

    def per_sequence(values: torch.Tensor) -> torch.Tensor:
        out = torch.zeros(rows * slots, dtype=values.dtype, device=values.device)
        return out.index_add_(0, flat, values).view(rows, slots)

    sums = per_sequence(torch.where(kept, token_logps.flatten().float(), 0.0))
    counts = per_sequence(kept.float())
    tokens = per_sequence(torch.ones_like(kept, dtype=torch.float32))
    pairs = (width + 1) // 2
    chosen, rejected = slice(1, 2 * pairs, 2), slice(2, 2 * pairs + 1, 2)
    return Answers(sums[:, chosen], sums[:, rejected], counts[:, chosen], counts[:, rejected],
                   (tokens[:, chosen] > 0) & (tokens[:, rejected] > 0))


@dataclass
class Outcome:
    """A batch's loss (mean over its pairs) and the sums TRL's metrics are means of."""

    loss: torch.Tensor
    sums: torch.Tensor   # one per METRICS entry, summed over the batch's pairs
    pairs: torch.Tensor


def preference_loss(policy: Answers, reference: Answers, beta: float, kind: LossKind) -> Outcome:
    """The loss as TRL's DPOTrainer defines it for `kind`, over the pairs present."""
    chosen_ratio = policy.chosen - reference.chosen
    rejected_ratio = policy.rejected - reference.rejected
    delta = chosen_ratio - rejected_ratio
    if kind == "sigmoid":
        per_pair = -F.logsigmoid(beta * delta)
    elif kind == "hinge":
        per_pair = torch.relu(1 - beta * delta)
    else:   # ipo: per answer token, as TRL normalises it
        per_token = (chosen_ratio / policy.chosen_tokens.clamp(min=1.0)
                     - rejected_ratio / policy.rejected_tokens.clamp(min=1.0))
        per_pair = (per_token - 1 / (2 * beta)) ** 2
    present = policy.present
    pairs = present.sum()
    loss = torch.where(present, per_pair, 0.0).sum() / pairs.clamp(min=1)
    with torch.no_grad():
        chosen_reward, rejected_reward = beta * chosen_ratio, beta * rejected_ratio
        values = (chosen_reward, rejected_reward, (chosen_reward > rejected_reward).float(),
                  chosen_reward - rejected_reward, policy.chosen, policy.rejected)
        sums = torch.stack([torch.where(present, v, 0.0).sum() for v in values])
    return Outcome(loss, sums, pairs.float())


def means(sums: torch.Tensor) -> dict[str, float]:
    """TRL's metrics from their sums over pairs with the pair count last (an Outcome's, or several
    batches' and ranks' added up)."""
    return {name: float(total / sums[-1].clamp(min=1)) for name, total in zip(METRICS, sums[:-1], strict=True)}


def batch_answers(logps: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor], batch: Batch,
                  device: torch.device) -> Answers:
    """A packed preference batch's answers under a model (`logps` is its token_logps)."""
    assert batch.docs is not None   # preference rows always carry their sequence numbers
    x, y = batch.inputs.to(device, non_blocking=True), batch.targets.to(device, non_blocking=True)
    seqs = batch.docs.to(device, non_blocking=True)
    return answers(logps(x, y, seqs), y, seqs)

