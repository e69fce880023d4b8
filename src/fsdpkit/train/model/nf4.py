"""QLoRA's frozen base (Dettmers et al. 2023): the decoder's projections stored as 4-bit NormalFloat.

Each projection's weight is torchao's `NF4Tensor`: codes of 4 bits, one absmax scaler per block of
64 elements, the scalers themselves quantized to int8 per block of 256 around their mean (double
quantization), about 0.52 bytes a parameter. FSDP2 shards and all-gathers it through the tensor's
own `fsdp_pre_all_gather` hooks, so what crosses the network is the 4-bit form too; `F.linear`
dequantizes it for each matmul, and its backward does so again instead of keeping the
full-precision weight.

A shard must hold whole double-quantization groups (64 x 256 elements), so each projection's rows
divide evenly over the shard ranks in multiples of that; `config.check_nf4_layout` says which
projection does not, before anything is built (without torch: job commands check it too). Every
rank quantizes only its own rows, with the mean of the whole projection's scalers (gathered: 1/64
of the elements), so a sharded base is byte for byte `to_nf4` of the whole weight, at any world
size.

torchao is imported when a run asks for NF4, not before: importing it costs seconds and logs
warnings about its GPU kernels, which every other run (and every torchrun worker) would pay.
"""

from __future__ import annotations

import functools
import importlib
import logging
import sys
import warnings
from types import ModuleType
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Shard

from fsdpkit.errors import UserError
from fsdpkit.train.model.config import NF4_BLOCK as BLOCK
from fsdpkit.train.model.config import NF4_SCALER_BLOCK as SCALER_BLOCK
from fsdpkit.train.sections import LORA_TARGETS

_NF4_MODULE = "torchao.quantization.quantize_.workflows.nf4.nf4_tensor"


@functools.cache
def _torchao() -> ModuleType:
    # Its GPU kernels' load failures and torch's notes on its registrations do not concern NF4.
    quiet = [logging.getLogger(name) for name in ("torchao", "torch.utils._pytree")]
    levels = [q.level for q in quiet]
    for q in quiet:
        q.setLevel(logging.ERROR)
    # torch.compile's cache notes, once a rank, that the tensor offers no stable hash: it then
    # compiles without that cache, which is all the note says.
    warnings.filterwarnings("ignore", message="NF4Tensor does not implement _stable_hash_for_caching")
    try:
        return importlib.import_module(_NF4_MODULE)
    except ImportError:
        raise UserError("base_dtype: nf4 needs torchao >= 0.18 (pip install 'fsdpkit[qlora]', or torchao in the "
                        "training image)") from None
    finally:
        for q, level in zip(quiet, levels, strict=True):
            q.setLevel(level)


def check_available() -> None:
    """Refuse in one line, before any process starts, a QLoRA run where torchao is missing."""
    _torchao()


def is_projection(module_name: str) -> bool:
    """Whether a module (by name) is one of the decoder blocks' dense projections."""
    return module_name.rsplit(".", 1)[-1] in LORA_TARGETS


def projections(model: nn.Module) -> list[tuple[str, nn.Linear]]:
    """The decoder blocks' dense projections, by module name: what QLoRA holds in NF4 (adapted or
    not). Embeddings, norms and the output head stay in the run's dtype, as in QLoRA."""
    return [(name, m) for name, m in model.named_modules() if isinstance(m, nn.Linear) and is_projection(name)]


def quantize_base(model: nn.Module) -> None:
    """Make every projection's weight an NF4 parameter (frozen). On the meta device, before FSDP2
    shards the model: FSDP takes the tensor type as it finds it."""
    for _, m in projections(model):
        m.weight = nn.Parameter(_torchao().to_nf4(m.weight, BLOCK, SCALER_BLOCK), requires_grad=False)


def _local(p: torch.Tensor) -> Any:
    # FSDP reads the inner tensors of this very object (a view of it would not do).
    return p._local_tensor if isinstance(p, DTensor) else p


def device_of(p: torch.Tensor) -> torch.device:
    return _local(p).quantized_data.device


def is_nf4(p: torch.Tensor) -> bool:
    """Whether `p` is stored in NF4 (no NF4 tensor exists before torchao's module is loaded)."""
    module = sys.modules.get(_NF4_MODULE)
    return module is not None and isinstance(_local(p), module.NF4Tensor)


def _shard_group(p: torch.Tensor) -> dist.ProcessGroup | None:
    """The process group over which `p`'s rows are sharded (None: not sharded)."""
    if not isinstance(p, DTensor):
        return None
    dims = [i for i, pl in enumerate(p.placements) if isinstance(pl, Shard)]
    return p.device_mesh.get_group(dims[0]) if dims else None


def _whole_scalers(scalers: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    if group is None or dist.get_world_size(group) == 1:
        return scalers
    parts = [torch.empty_like(scalers) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, scalers.contiguous(), group=group)
    return torch.cat(parts)


@torch.no_grad()
def store(p: torch.Tensor, rows: torch.Tensor) -> None:
    """Quantize this rank's rows of a projection into its NF4 parameter `p` (a collective over the
    shard ranks: every rank calls it for every NF4 parameter, in the same order)."""
    ao, local = _torchao(), _local(p)
    rows = rows.to(device=local.quantized_data.device, dtype=local.dtype).contiguous()
    scalers = ao.get_block_absmax(rows.flatten(), BLOCK)
    mean = _whole_scalers(scalers, _shard_group(p)).mean()   # torchao's mean, over the whole projection
    centred = (scalers - mean).view(-1, SCALER_BLOCK)
    factor = 256 / (2 * centred.abs().amax(dim=1))
    codes = ao.NF4Tensor.from_tensor(rows, BLOCK, SCALER_BLOCK)   # its 4-bit codes do not depend on the mean
    local.quantized_data.copy_(codes.quantized_data)
    local.quantized_scalers.copy_((centred * factor[:, None]).round().clamp(-128, 127).flatten().to(torch.int8))
    local.quantization_factor.copy_(factor)
    # Scalars that materialising on a device leaves on the meta device: set, not copied.
    local.scaler_mean = mean
    local.nf4 = codes.nf4


def dequantized(t: torch.Tensor) -> torch.Tensor:
    """A full-precision weight as the NF4 base holds it: quantized once and read back."""
    return _torchao().to_nf4(t.contiguous(), BLOCK, SCALER_BLOCK).get_original_weight()


def nf4_bytes(model: nn.Module) -> tuple[int, int]:
    """(bytes this rank holds for its NF4 parameters, their elements on this rank)."""
    total = elements = 0
    for p in model.parameters():
        if is_nf4(p):
            local = _local(p)
            total += sum(t.numel() * t.element_size() for t in
                         (local.quantized_data, local.quantized_scalers, local.quantization_factor))
            elements += local.numel()
    return total, elements
