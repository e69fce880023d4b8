"""Context parallel: every sequence split over the N ranks of a group, attention over all of it.

Each rank holds a contiguous 1/N of every sequence's tokens through embedding, norms, MLP and loss.
Attention needs every token, so around it two all-to-alls trade the split (DeepSpeed-Ulysses):
before, the sequence split for a head split (each rank then holds all T tokens of 1/N of the
heads), so attention runs whole with the batch's full mask (causal, packed documents, a sliding
window) in whichever kernel the device has, FlexAttention included; after, back again. Each
all-to-all moves (N-1)/N of q, k, v or the output; activations per rank fall to 1/N.

Torch's own context_parallel (ring attention over SDPA) has no CPU sharding rule and no document
masks; an all-to-all over heads needs neither, at the price of N dividing the query heads.

A rank's loss is its share of its group's mean (its targets' summed loss over the group's target
count), times N: every mean over ranks (FSDP's gradient average, the logged loss) is then the mean
over sequences, whatever the number of targets each rank's slice holds."""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist
from torch import Tensor
from torch.distributed import _functional_collectives as funcol


@dataclass(frozen=True)
class SequenceSplit:
    """This rank's place in its context-parallel group: `size` ranks share every sequence, this one
    holds the `rank`-th contiguous slice of it."""

    group: dist.ProcessGroup
    size: int
    rank: int

    def local(self, x: Tensor, dim: int = 1) -> Tensor:
        """This rank's slice of `x` along its sequence dimension `dim`."""
        n = x.shape[dim] // self.size
        return x.narrow(dim, self.rank * n, n)

    def gather_sequence(self, x: Tensor) -> Tensor:
        """(B, H, T/N, d) of every head -> (B, H/N, T, d) of this rank's heads."""
        B, H, t, d = x.shape
        n = self.size
        # Part j (heads j*H/N onwards, of this rank's tokens) goes to rank j; part j received is
        # rank j's tokens of this rank's heads, so the parts in order are the whole sequence.
        send = x.reshape(B, n, H // n, t, d).transpose(0, 1).contiguous()
        recv = funcol.all_to_all_single_autograd(send, None, None, self.group)
        return recv.permute(1, 2, 0, 3, 4).reshape(B, H // n, n * t, d)

    def scatter_sequence(self, x: Tensor) -> Tensor:
        """(B, H/N, T, d) of this rank's heads -> (B, H, T/N, d) of every head: the inverse."""
        B, h, T, d = x.shape
        n = self.size
        send = x.reshape(B, h, n, T // n, d).permute(2, 0, 1, 3, 4).contiguous()
        recv = funcol.all_to_all_single_autograd(send, None, None, self.group)
        return recv.transpose(0, 1).reshape(B, n * h, T // n, d)

    def total(self, x: Tensor) -> Tensor:
        """The sum of `x` over the group (not differentiated: a count)."""
        return funcol.all_reduce(x.detach(), "sum", self.group)


def sequence_split(group: dist.ProcessGroup) -> SequenceSplit:
    return SequenceSplit(group, dist.get_world_size(group), dist.get_rank(group))

