"""Validation: the run's objective's mean loss over the first N held-out batches, the same batches
every time, averaged over ranks."""

from __future__ import annotations

from typing import cast

import torch

from fsdpkit.train.data import Batch, BatchStream
from fsdpkit.train.data.pipeline import data_pipeline
from fsdpkit.train.dpo import means
from fsdpkit.train.model.transformer import Transformer
from fsdpkit.train.objective import Objective
from fsdpkit.train.parallel.shard import autocast
from fsdpkit.train.runtime import dist
from fsdpkit.train.sections import ParallelConfig, ResolvedData


class Validator:
    """Mean loss over the first N held-out batches, the same batches every time, averaged over ranks."""

    def __init__(self, d: ResolvedData, batches: int, seed: int, par: ParallelConfig, rt: dist.Runtime,
                 objective: Objective):
        """`batches` per pass at most (log.validation_batches); `par` for the compute dtype."""
        pipe = data_pipeline(d, seed, d.val_split, verbose=rt.is_main)
        self.source = pipe.source
        self.stream = BatchStream(pipe.source, pipe.tokenizer, d.seq_len, d.val_batch_size, rt.data_rank, rt.data_ranks,
                                  seed, shuffle_buffer=0, epochs=1, chat=pipe.chat, preference=pipe.preference)
        # Every rank must run the same number of forwards (FSDP collectives): count on each rank,
        # deterministically, how many whole global batches the held-out split holds.
        available = self.stream.count_blocks() // (d.val_batch_size * rt.data_ranks)
        self.batches = min(batches, available)
        self.objective = objective
        self.rows, self.par, self.rt = d.train_batch_size, par, rt
        # The last pass's preference metrics (TRL's names, means over every rank's pairs): DPO only.
        self.metrics: dict[str, float] = {}

    @torch.no_grad()
    def __call__(self, model: Transformer) -> float | None:
        if self.batches == 0:
            return None
        model.eval()
        total = torch.zeros((), device=self.rt.device)
        sums: torch.Tensor | None = None
        # In slices of the training micro-batch: validation then never needs more memory than a
        # training step (a 16-sequence batch of 8192 tokens has 34 GB of bf16 logits at a 128k
        # vocabulary, where the compiled loss is not chunked). Blocks are full, so the batch's mean
        # is the slices' means weighted by their sizes.
        rows = self.rows
        device = self.rt.device
        for _, batch in zip(range(self.batches), self.stream, strict=False):
            x, y, docs = batch.inputs, batch.targets, batch.docs
            for start in range(0, x.shape[0], rows):
                part = slice(start, start + rows)
                with autocast(self.par, self.rt):
                    step = self.objective(model, Batch(x[part], y[part], batch.indices[part],
                                                       None if docs is None else docs[part]), device)
                total += step.loss.float() * (x[part].shape[0] / x.shape[0])
                if step.sums is not None:
                    sums = step.sums if sums is None else sums + step.sums
        model.train()
        if sums is not None:   # a sum over ranks (the mean times the ranks: the ratios are the same)
            sums = dist.all_reduce_mean(sums, self.rt).cpu()
            self.metrics = means(sums)
        return cast("float | None", dist.all_reduce_mean(total / self.batches, self.rt).item())
