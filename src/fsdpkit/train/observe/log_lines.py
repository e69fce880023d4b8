"""The trainer's progress line in one place: the trainer writes it, and the job side reads it
(`fsdpkit job watch`, the HyperPod log-monitoring rules). No torch, so job commands share it.

Patterns stay in RE2's subset (no lookaround, no backreferences): the HyperPod training operator,
written in Go, evaluates them too."""

from __future__ import annotations

import re

# "Batch 25 Loss: 2.91807, Speed: ..., tokens/s: 8918, ..." (the reference example's opening).
STEP_PREFIX = "Batch {step} Loss: {loss:.5f}, "

# A step line, whatever its loss (nan and inf included).
ANY_STEP = r"Batch \d+ Loss: "
# A step line whose loss is a finite number; the one group captures the loss.
FINITE_STEP = r"Batch \d+ Loss: (\d+\.\d+), "
# Any step line's step number, rank 0's or a node's (`job watch` times each node's steps by it).
STEP = re.compile(r"Batch (\d+) Loss: ")
# The fields `job watch` reads: step, loss (finite or not) and tokens/s.
PROGRESS = re.compile(r"Batch (\d+) Loss: ([\d.]+|nan|inf|-inf).*?tokens/s: (\d+)")


def node_line(step: int, loss: float, node: int) -> str:
    """What the first process of a node other than rank 0's prints at each logging step."""
    return STEP_PREFIX.format(step=step, loss=loss) + f"node {node}"
