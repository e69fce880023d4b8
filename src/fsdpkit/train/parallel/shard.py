"""Build the model on the meta device, apply activation checkpointing, compile and FSDP2, materialise.

Order matters: activation checkpointing and torch.compile wrap each block first, then every block
and the root get `fully_shard`, and only then are the parameters allocated (each rank holds its
shard only) and initialised. Initialisation draws each parameter's full value from a generator
seeded by its name and keeps this rank's slice, so any world size starts from the same weights.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Callable
from typing import Any, cast

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, OffloadPolicy, fully_shard
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from fsdpkit.errors import UserError
from fsdpkit.train.model import nf4
from fsdpkit.train.model.config import LoraShape, ModelConfig, check_nf4_layout, loss_chunk_size
from fsdpkit.train.model.context import SequenceSplit, sequence_split
from fsdpkit.train.model.expert_parallel import ExpertSplit
from fsdpkit.train.model.hf import local_rows
from fsdpkit.train.model.lora import add_adapters
from fsdpkit.train.model.transformer import MoE, Transformer
from fsdpkit.train.runtime.dist import Runtime
from fsdpkit.train.sections import ParallelConfig

log = logging.getLogger(__name__)
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def compute_dtype(par: ParallelConfig, device_type: str) -> torch.dtype:
    return DTYPES[par.precision(device_type)]


def build_mesh(rt: Runtime, par: ParallelConfig) -> DeviceMesh:
    """1-D mesh for full sharding; a real 2-D (replicate, shard) mesh for hybrid (HSDP)."""
    if par.sharding_strategy == "hybrid":
        replicas = par.replicas(rt.world_size, rt.num_nodes)
        return init_device_mesh(rt.device.type, (replicas, rt.world_size // replicas),
                                mesh_dim_names=("dp_replicate", "dp_shard"))
    return init_device_mesh(rt.device.type, (rt.world_size,), mesh_dim_names=("dp_shard",))


def sequence_group(rt: Runtime) -> SequenceSplit | None:
    """This rank's context-parallel group: `context_parallel` consecutive ranks, so one node's
    (fsdpkit.train.runtime.dist.setup refuses a degree that does not divide a node's processes).
    FSDP still shards over the whole world: the group's ranks hold different shards of one model."""
    if rt.context_parallel == 1:
        return None
    group, _ = dist.new_subgroups(group_size=rt.context_parallel)
    return sequence_split(group)


def split_experts(model: Transformer, rt: Runtime) -> set[torch.nn.Parameter]:
    """Expert parallel: every MoE layer's expert weights made DTensors sharded by expert over
    groups of `expert_parallel` consecutive ranks (replicated across the groups), and the layers
    told their split; returns the weights, which FSDP is to leave alone. On the meta device, before
    anything is allocated: each rank then allocates its experts only."""
    degree = rt.expert_parallel
    if degree == 1:
        return set()
    mesh = init_device_mesh(rt.device.type, (rt.world_size // degree, degree), mesh_dim_names=("replicas", "ep"))
    replicas = mesh["replicas"].get_group() if rt.world_size > degree else None
    split = ExpertSplit(mesh["ep"].get_group(), degree, mesh["ep"].get_local_rank(), replicas, rt.world_size)
    owned: set[torch.nn.Parameter] = set()
    for layer in model.blocks():
        if not isinstance(layer.mlp, MoE):
            continue
        experts = layer.mlp.experts
        for name in ("gate_up_proj", "down_proj"):
            weight = torch.nn.Parameter(distribute_tensor(getattr(experts, name), mesh["ep"], [Shard(0)],
                                                          src_data_rank=None))
            setattr(experts, name, weight)
            owned.add(weight)
        experts.split = split
    return owned


def expert_grads(model: Transformer) -> None:
    """Expert-parallel weights' gradients finished as FSDP finishes the others' (ExpertSplit.finish_grads):
    once per optimizer step, after its last backward."""
    for layer in model.blocks():
        if isinstance(layer.mlp, MoE) and (split := layer.mlp.experts.split) is not None:
            grads = [p.grad for p in layer.mlp.experts.parameters() if p.grad is not None]
            split.finish_grads([g.to_local() if isinstance(g, DTensor) else g for g in grads])


def apply_activation_checkpointing(model: Transformer, mode: str, every: int) -> None:
    for i, layer in enumerate(model.blocks()):
        layer.checkpoint = mode == "full" or (mode == "selective" and i % every == 0)


def shard_count(mesh: DeviceMesh | None) -> int:
    """Ranks each parameter is sharded over (1: not sharded)."""
    return mesh["dp_shard"].size() if mesh is not None else 1


def apply_fsdp(model: Transformer, mesh: DeviceMesh, par: ParallelConfig, device_type: str,
               ignored: set[torch.nn.Parameter] | None = None) -> None:
    param_dtype = compute_dtype(par, device_type)
    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=DTYPES[par.reduce_dtype])
    offload = CPUOffloadPolicy(pin_memory=device_type == "cuda") if par.cpu_offload else OffloadPolicy()
    layers = model.blocks()
    for i, layer in enumerate(layers):
        # The last block's parameters are needed again at once by backward: keep them gathered.
        reshard = par.reshard_after_forward and i < len(layers) - 1
        fully_shard(layer, mesh=mesh, reshard_after_forward=reshard, mp_policy=mp, offload_policy=offload,
                    ignored_params=ignored)
    fully_shard(model, mesh=mesh, reshard_after_forward=par.reshard_after_forward, mp_policy=mp,
                offload_policy=offload, ignored_params=ignored)
    set_prefetch([cast(FSDPModule, layer) for layer in layers], par.fsdp_prefetch)


def set_prefetch(layers: list[FSDPModule], depth: int) -> None:
    """Issue the all-gathers of the next `depth` blocks when a block starts (forward) and of the
    previous `depth` blocks in backward, so communication overlaps compute even when the CPU is
    not running ahead of the GPU (FSDP2 on its own prefetches one block in backward only)."""
    if depth == 0:
        return
    for i, layer in enumerate(layers):
        layer.set_modules_to_forward_prefetch(layers[i + 1:i + 1 + depth])
        layer.set_modules_to_backward_prefetch(layers[max(0, i - depth):i][::-1])


def apply_float8(model: Transformer, device: torch.device, recipe: str, head: bool) -> None:
    """Float8 matmuls with dynamic scaling (torchao) where the GPU has float8 tensor cores."""
    if device.type != "cuda" or torch.cuda.get_device_capability(device) < (8, 9):
        raise UserError("float8: needs an NVIDIA GPU with float8 tensor cores (Ada, Hopper or newer)")
    convert_float8(model, recipe, head)


def convert_float8(model: Transformer, recipe: str, head: bool) -> None:
    """Every decoder linear layer to torchao's float8 training linear with `recipe`'s scaling; the
    output head only with `head` (its logits feed the loss). Device-independent: torchao's float8
    GEMM runs on the CPU too, which is how the suite tests this path."""
    try:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    except ImportError:
        raise UserError("float8: needs torchao (pip install torchao)") from None

    def wanted(module: torch.nn.Module, fqn: str) -> bool:
        # float8 GEMMs need both dimensions divisible by 16
        return isinstance(module, torch.nn.Linear) and (head or fqn != "lm_head") and \
            module.in_features % 16 == 0 and module.out_features % 16 == 0

    convert_to_float8_training(model, config=Float8LinearConfig.from_recipe_name(recipe), module_filter_fn=wanted)


def fill_sharded(p: torch.Tensor, init_fn: Callable[[torch.Tensor], None]) -> None:
    """Initialise the full parameter once, keep this rank's shard (no communication; an NF4
    parameter's quantization gathers its block scalers)."""
    if nf4.is_nf4(p):
        full = torch.empty(p.shape, dtype=p.dtype, device=nf4.device_of(p))
        init_fn(full)
        nf4.store(p, full[local_rows(p)[0]])
        return
    if not isinstance(p, DTensor):
        init_fn(p)
        return
    local = p.to_local()
    full = torch.empty(p.shape, dtype=p.dtype, device=local.device)
    init_fn(full)
    shard = distribute_tensor(full, p.device_mesh, p.placements, src_data_rank=None).to_local()
    local.copy_(shard)


def build_model(shape: ModelConfig, par: ParallelConfig, rope_len: int, seed: int, rt: Runtime,
                lora: LoraShape | None = None) -> Transformer:
    """The model of this shape, initialised from `seed`, with LoRA adapters (base frozen, in NF4 for
    QLoRA) and the parallel section's wrappings: float8, activation checkpointing, compiled blocks,
    FSDP2 over the runtime's mesh."""
    mesh = build_mesh(rt, par) if rt.distributed else None
    with torch.device("meta"):
        model = Transformer(shape, rope_len=rope_len)
        if lora is not None:
            add_adapters(model, lora)
        if lora is not None and lora.nf4:
            check_nf4_layout(shape, shard_count(mesh), rt.world_size)
            nf4.quantize_base(model)
    model.loss_chunk_tokens = loss_chunk_size(model.cfg.vocab_size, par.loss_chunk_tokens, bool(par.compile))
    model.split_sequences(sequence_group(rt))
    expert_weights = split_experts(model, rt)
    if par.float8:
        apply_float8(model, rt.device, par.float8_recipe, par.float8_head)
    apply_activation_checkpointing(model, par.activation_checkpointing, par.ac_every)
    if par.compile:
        if par.compile_cache_dir:
            # Inductor's and Triton's on-disk caches: a restarted job reuses the compiled kernels.
            os.environ["TORCHINDUCTOR_CACHE_DIR"] = par.compile_cache_dir
            os.environ["TRITON_CACHE_DIR"] = os.path.join(par.compile_cache_dir, "triton")
        # Compile is on by default on GPUs, so a block it cannot take must not stop the run: that
        # frame runs eagerly and dynamo says so once, in a warning naming it.
        torch._dynamo.config.suppress_errors = True
        # Grouped expert products trace in bf16 only (their meta kernel refuses fp32): on the CPU a
        # mixture-of-experts block stays eager rather than failing to compile at every step.
        eager_experts = shape.is_moe and rt.device.type == "cpu"
        if eager_experts:
            log.info("fsdpkit: compile: mixture-of-experts blocks run eagerly on the CPU (grouped expert products "
                     "compile on CUDA in bf16)")
        for layer in model.blocks():
            if not eager_experts:
                layer.compile()
        model.output_loss = torch.compile(model.output_loss)  # type: ignore[method-assign]  # the loss, compiled
    if mesh is not None:
        apply_fsdp(model, mesh, par, rt.device.type, expert_weights)
    # Offloaded shards live on the CPU; unsharded (single-process) models always sit on the device.
    init_device = torch.device("cpu") if par.cpu_offload and rt.distributed else rt.device
    model.to_empty(device=init_device)
    model.init_weights(seed=seed, fill=fill_sharded)
    return model


def describe_mesh(model: torch.nn.Module) -> str:
    """The device mesh the parameters are sharded over, e.g. 'dp_replicate=2 x dp_shard=4'."""
    p = next(model.parameters())
    if not isinstance(p, DTensor):
        return "none (one process, unsharded)"
    mesh = p.device_mesh
    names = mesh.mesh_dim_names or tuple(f"dim{i}" for i in range(mesh.ndim))
    return " x ".join(f"{n}={s}" for n, s in zip(names, mesh.shape, strict=True))


def autocast(par: ParallelConfig, rt: Runtime) -> contextlib.AbstractContextManager[Any]:
    """Mixed precision for the unsharded single-process path (FSDP2 casts parameters itself)."""
    dtype = compute_dtype(par, rt.device.type)
    if rt.distributed or dtype == torch.float32:
        return contextlib.nullcontext()
    return cast("contextlib.AbstractContextManager[Any]", torch.autocast(rt.device.type, dtype=dtype))
