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

# The trainer's last line on every node: it finished, it stopped on SIGTERM with its checkpoint
# saved, or a resumed run had nothing left to do. HyperPod's rules stop watching at it (stopPattern).
DONE = "fsdpkit: done after {steps} steps"
STOPPED = "fsdpkit: stopping at step {step} on SIGTERM"
NOTHING_TO_DO = "fsdpkit: nothing to do"
FINAL = r"fsdpkit: (done after \d+ steps|stopping at step \d+ on SIGTERM|nothing to do)"


# What the trainer's lines about checkpoint.tiered start with when the in-memory tier is off (the
# package missing, the store not answering): a stop's save then goes to shared storage, in a grace
# planned for node memory, and `job watch` says so.
TIERED_OFF = "checkpoint.tiered: "


def node_line(step: int, loss: float, node: int) -> str:
    """What the first process of a node other than rank 0's prints at each logging step."""
    return STEP_PREFIX.format(step=step, loss=loss) + f"node {node}"


def on_node(line: str, node: int) -> str:
    """A line of rank 0's as the first process of another node says it."""
    return f"{line} (node {node})"
