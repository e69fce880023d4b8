"""Expert parallel: the experts of every MoE layer split over the N ranks of a group, tokens sent to
the rank of their expert and back (all-to-all, dropless).

Each rank routes its own tokens as before; the (token, slot) rows, sorted by expert, go to the rank
that holds their expert in one all-to-all (the counts per expert first, so every rank knows what
it receives), run there through its experts' grouped products, and come back in a second
all-to-all to be weighted and added to their tokens. Whatever the degree, a token meets the same
expert weights, so a step is EP=1's (the sums in another order).

The expert weights are DTensors sharded by expert over the group (their checkpoints reshard
between degrees as any DTensor's); FSDP leaves them alone. Ranks in different groups that hold
the same experts (the world over N replicas of them) add up their gradients once per optimizer
step (`finish_grads`)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed import _functional_collectives as funcol


@dataclass(frozen=True)
class ExpertSplit:
    """This rank's place among the ranks its MoE layers' experts are split over: `size` ranks,
    this one `rank`-th, holding experts rank * E/size onwards; `replicas`, the group of ranks that
    hold the same experts (None: no other does); `world`, every rank of the run."""

    group: dist.ProcessGroup
    size: int
    rank: int
    replicas: dist.ProcessGroup | None
    world: int

    def exchange(self, rows: Tensor, counts: Tensor, run: Callable[[Tensor, Tensor], Tensor]) -> Tensor:
        """`rows` (this rank's routed slots, sorted by expert) through their experts' `run`, on the
        ranks that hold them; `counts` (E,): rows per expert. Returns the rows' outputs in order."""
        n, local = self.size, counts.numel() // self.size
        # Block j of `counts` (experts j * E/N onwards) goes to rank j: each rank learns how many rows
        # of each of its experts every rank sends. The split sizes are read on the host (one sync).
        received = funcol.all_to_all_single(counts, None, None, self.group).view(n, local)
        send = counts.view(n, local).sum(dim=1).tolist()
        recv = received.sum(dim=1).tolist()
        got = funcol.all_to_all_single_autograd(rows, recv, send, self.group)
        # Rank j's block is sorted by expert; grouped by expert across the blocks for the products.
        expert = torch.arange(local, device=rows.device).repeat(n).repeat_interleave(received.reshape(-1))
        order = torch.argsort(expert, stable=True)
        out = run(got[order], received.sum(dim=0))[torch.argsort(order)]
        return funcol.all_to_all_single_autograd(out, send, recv, self.group)

    def finish_grads(self, grads: list[Tensor]) -> None:
        """Gradients of this rank's expert weights, as FSDP leaves everything else's: summed over
        the ranks that hold the same experts, and divided by the world (each already holds the sum
        over its group's tokens; a loss is one rank's mean)."""
        for g in grads:
            if self.replicas is not None:
                dist.all_reduce(g, group=self.replicas)
            g.div_(self.world)
