"""Run by test_context.py, alone or under torchrun: one forward and backward of the trainer's
objective over a fixed global batch of whole sequences, the model built as the trainer builds it
(FSDP2 over every rank, context parallel as the flags say). Rank 0 writes the loss and every
parameter's whole gradient; each rank writes the bytes of the floating-point tensors its forward
kept for backward (its activations). Several masks are stepped in turn in one launch, each on a
model built anew from the seed (the ranks' start-up is most of a launch's cost), each case's files
under OUT_DIR/MASK/.
Usage: [torchrun --nproc-per-node N] tests/train/model/context_worker.py OUT_DIR SEQUENCES MASKS.json
[trainer flags]; MASKS.json: {mask: [its own trainer flags]}"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from torch.distributed.tensor import DTensor

from fsdpkit.train.config import parse_args
from fsdpkit.train.data.stream import Batch
from fsdpkit.train.objective import NextToken
from fsdpkit.train.parallel.shard import build_model
from fsdpkit.train.runtime import dist

EOS = 1


def global_batch(sequences: int, seq_len: int, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(sequences, seq_len) inputs and targets, documents of random lengths ended by EOS."""
    gen = torch.Generator().manual_seed(1)
    tokens = torch.randint(2, vocab, (sequences, seq_len + 1), generator=gen)
    ends = torch.rand(tokens.shape, generator=gen) < 8 / seq_len   # about 8 documents a sequence
    tokens[ends] = EOS
    return tokens[:, :-1], tokens[:, 1:]


def step(out: Path, sequences: int, cfg, rt: dist.Runtime) -> None:
    """One forward and backward of the trainer's objective: its files in `out`."""
    model = build_model(cfg.shape, cfg.parallel, cfg.data.seq_len, cfg.seed, rt)
    inputs, targets = global_batch(sequences, cfg.data.seq_len, cfg.shape.vocab_size)
    rows = slice(rt.data_rank * sequences // rt.data_ranks, (rt.data_rank + 1) * sequences // rt.data_ranks)
    batch = Batch(inputs[rows], targets[rows], [])
    kept: dict[int, int] = {}

    def keep(t: torch.Tensor) -> torch.Tensor:
        if t.is_floating_point():
            kept[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
        result = NextToken(EOS if cfg.data.document_masking else None)(model, batch, rt.device)
    result.total.backward()
    loss = dist.all_reduce_mean(result.loss.detach(), rt)
    grads = {n: (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad) for n, p in model.named_parameters()}
    (out / f"activations-rank{rt.rank}.json").write_text(json.dumps(sum(kept.values())))
    if rt.rank == 0:
        torch.save({"loss": loss, "grads": grads}, out / "step.pt")


if __name__ == "__main__":
    out, sequences, masks = Path(sys.argv[1]), int(sys.argv[2]), json.loads(Path(sys.argv[3]).read_text())
    configs = {mask: parse_args([*sys.argv[4:], *flags]) for mask, flags in masks.items()}
    first = next(iter(configs.values()))
    rt = dist.setup("cpu", first.parallel.context_parallel)
    for mask, cfg in configs.items():
        assert cfg.parallel.context_parallel == rt.context_parallel, "one context-parallel degree a launch"
        (out / mask).mkdir(parents=True, exist_ok=True)
        step(out / mask, sequences, cfg, rt)
    dist.leave(0)
