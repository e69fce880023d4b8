"""The planner's view of a TrainConfig: the same config that then runs the job."""

from __future__ import annotations

from fsdpkit.plan.memory import Workload
from fsdpkit.train.config import TrainConfig
from fsdpkit.train.model.config import loss_chunk_size


def workload(cfg: TrainConfig, world: int, device: str, nodes: int = 1) -> Workload:
    """`world` ranks on `nodes` nodes; `device` "cuda" or "cpu" decides the dtype and attention
    kernel the trainer would pick."""
    m, par = cfg.shape, cfg.parallel
    compute = par.precision(device)
    compiled = par.compiles(device)
    shard = par.shard_ranks(world, nodes)
    return Workload(model=m, seq=cfg.data.seq_len, micro_batch=cfg.data.train_batch_size,
                    val_batch=cfg.data.val_batch_size,
                    grad_accum=cfg.data.grad_accum_steps, world=world, shard=shard, compute=compute,
                    reduce=par.reduce_dtype, ac=par.activation_checkpointing, ac_every=par.ac_every,
                    cpu_offload=par.cpu_offload, prefetch=par.fsdp_prefetch, reshard=par.reshard_after_forward,
                    loss_chunk=loss_chunk_size(m.vocab_size, par.loss_chunk_tokens, compiled),
                    compiled=compiled, fused_norm=device == "cuda", lora=cfg.lora_shape,
                    dpo=cfg.loss.objective == "dpo", cp=par.context_parallel, ep=par.expert_parallel)
