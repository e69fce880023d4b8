"""Run by test_nf4.py under torchrun: QLoRA's model built as the trainer builds it (FSDP2 over the
ranks, the base's projections in NF4, loaded from Hugging Face weights), then on rank 0 what the
test reads: each NF4 projection's shards gathered and compared with torchao's `to_nf4` of the whole
weight, the bytes a rank holds for them, and the logits of a fixed batch.
Usage: torchrun --nproc-per-node 2 tests/train/model/nf4_worker.py OUT_DIR [trainer flags]"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as tdist
from safetensors.torch import load_file
from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import to_nf4

from fsdpkit.train.config import parse_args
from fsdpkit.train.model import nf4
from fsdpkit.train.model.hf import load_hf_into
from fsdpkit.train.parallel.shard import build_model
from fsdpkit.train.runtime import dist

INNER = ("quantized_data", "quantized_scalers", "quantization_factor")


def gathered(t: torch.Tensor) -> torch.Tensor:
    parts = [torch.empty_like(t) for _ in range(tdist.get_world_size())]
    tdist.all_gather(parts, t.contiguous())
    return torch.cat(parts)


if __name__ == "__main__":
    out = Path(sys.argv[1])
    cfg = parse_args(sys.argv[2:])
    rt = dist.setup("cpu")
    model = build_model(cfg.shape, cfg.parallel, cfg.data.seq_len, cfg.seed, rt, cfg.lora_shape)
    base = Path(cfg.checkpoint.init_from_hf)
    load_hf_into(model, base, cfg.shape)
    weights = load_file(str(base / "model.safetensors"))
    same: dict[str, bool] = {}
    for name, p in model.named_parameters():
        if not nf4.is_nf4(p):
            continue
        local = p._local_tensor
        whole = {k: gathered(getattr(local, k)) for k in INNER}
        if rt.rank == 0:
            ref = to_nf4(weights[name].float(), nf4.BLOCK, nf4.SCALER_BLOCK)
            same[name] = all(torch.equal(whole[k], getattr(ref, k)) for k in INNER) and \
                torch.equal(local.scaler_mean, ref.scaler_mean)
    stored, elements = nf4.nf4_bytes(model)
    tokens = torch.randint(0, 300, (2, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        logits = model(tokens)
    if rt.rank == 0:
        torch.save(logits, out / "logits.pt")
        (out / "result.json").write_text(json.dumps({"same": same, "stored": stored, "elements": elements,
                                                     "trained": [n for n, p in model.named_parameters()
                                                                 if p.requires_grad]}))
    dist.leave(0)
