"""LoRA and QLoRA against full fine-tuning of the same base: tokens/s and the memory a step holds.

    python -m benchmarks.lora_finetune                              # debug preset on this machine
    python -m benchmarks.lora_finetune --preset llama3_2_1b --layers 8 --seq-len 2048   # on a GPU
    python -m benchmarks.lora_finetune --smoke                      # seconds; what CI runs

The base is written once as Hugging Face weights (fsdpkit's own export of the preset's shape), and
each mode trains from it as a user's run would: `--init-from-hf` (plus `--lora 1`), the trainer's
model, optimizer and clipped step, one process, random tokens. Reported per mode: the median step
time after warm-up as tokens/s, the trainable parameters, and the peak bytes of live tensors over
the measured steps (the CUDA allocator's peak on a GPU; on the CPU the same figure from
torch.profiler's allocation events), with the part that is gradients and optimizer state, and
the bytes the base's weights take (QLoRA's projections in NF4). The smoke's tiny shape is widened
where NF4 needs whole blocks (4 KV heads, ffn 384).
"""

from __future__ import annotations

import contextlib
import statistics
import tempfile
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from benchmarks.common import append_rows, device_of, environment, model_arguments, publish, replayed
from fsdpkit.errors import UserError
from fsdpkit.train.config import parse_args
from fsdpkit.train.model import nf4
from fsdpkit.train.model.config import check_nf4_layout
from fsdpkit.train.model.hf import load_hf_into, save_hf
from fsdpkit.train.model.transformer import Transformer
from fsdpkit.train.optim import build_optimizer, clipped_step
from fsdpkit.train.parallel.shard import autocast, build_model
from fsdpkit.train.runtime.dist import Runtime


def write_base(flags: list[str], out: Path) -> None:
    """The preset's shape (with --layers) as Hugging Face weights: the base both modes start from."""
    cfg = parse_args(flags)
    with torch.device("meta"):
        model = Transformer(cfg.shape, rope_len=cfg.data.seq_len)
    model.to_empty(device="cpu")
    model.init_weights(seed=0)
    save_hf(model.state_dict(), cfg.shape, out, torch.float32)


def tensor_peak(prof: profile) -> int:
    live = peak = 0
    for e in sorted((e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"),
                    key=lambda e: e.start_ns()):
        live += e.nbytes()
        peak = max(peak, live)
    return peak


def run_mode(flags: list[str], device: torch.device, steps: int, warmup: int) -> dict:
    cfg = parse_args(flags)
    rt = Runtime(0, 1, 0, 1, device)
    model = build_model(cfg.shape, cfg.parallel, cfg.data.seq_len, cfg.seed, rt, cfg.lora_shape)
    load_hf_into(model, Path(cfg.checkpoint.init_from_hf or ""), cfg.shape)
    optimizer = build_optimizer(model, cfg.optim)
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, cfg.shape.vocab_size, (cfg.data.train_batch_size, cfg.data.seq_len + 1),
                           generator=gen).to(device)

    def step() -> None:
        with autocast(cfg.parallel, rt):
            _, total = model.loss(tokens[:, :-1], tokens[:, 1:])
        total.backward()
        clipped_step(optimizer, cfg.optim.grad_clip)
        optimizer.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.synchronize()

    for _ in range(warmup):
        step()
    times = []
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    watch = profile(activities=[ProfilerActivity.CPU], profile_memory=True) if device.type == "cpu" else None
    with watch or contextlib.nullcontext():
        for _ in range(steps):
            t0 = time.perf_counter()
            step()
            times.append(time.perf_counter() - t0)
    quantized, _ = nf4.nf4_bytes(model)
    weights = quantized + sum(p.numel() * p.element_size() for p in model.parameters() if not nf4.is_nf4(p))
    held = weights + sum(
        t.numel() * t.element_size() for s in optimizer.state.values() for t in s.values() if torch.is_tensor(t))
    # CPU: what the steps allocated beyond what was live before them (weights, moments), plus that.
    peak = held + tensor_peak(watch) if watch is not None else torch.cuda.max_memory_allocated()
    if device.type == "cuda":
        peak = max(peak, base)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    tok = cfg.data.train_batch_size * cfg.data.seq_len
    mode = ("qlora" if cfg.adapters.base_dtype == "nf4" else "lora") if cfg.adapters.lora else "full"
    return {"mode": mode, "tokens_per_s": tok / statistics.median(times), "weight_bytes": weights,
            "trainable": trainable, "params": sum(p.numel() for p in model.parameters()), "peak_bytes": peak,
            "optimizer_bytes": sum(t.numel() * t.element_size() for s in optimizer.state.values()
                                   for t in s.values() if torch.is_tensor(t) and t.ndim > 0)}


def main(argv: list[str] | None = None) -> int:
    parser = model_arguments(__doc__, "lora_finetune.json", "the tiny preset, two steps (CI)")
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--rank", type=int, default=16, help="LoRA rank")
    parser.add_argument("--steps", type=int, default=6)
    args = parser.parse_args(argv)
    if replayed(args, write_results_md):
        return 0
    device = device_of(args)
    kind = device.type
    preset, seq, batch, steps = ("tiny", 64, 2, 2) if args.smoke else (args.preset, args.seq_len, args.batch,
                                                                     args.steps)
    shape = ["--preset", preset, "--seq-len", str(seq), "--train-batch-size", str(batch), "--device", kind,
             *(["--n-layers", str(args.layers)] if args.layers else []),
             *(["--n-kv-heads", "4", "--ffn-dim", "384"] if args.smoke else [])]
    with tempfile.TemporaryDirectory() as tmp:
        base = Path(tmp) / "base"
        write_base(shape, base)
        common = [*shape, "--init-from-hf", str(base)]
        warmup = 2 if kind == "cuda" else 1   # on a GPU the first steps compile the blocks
        lora = [*common, "--lora", "1", "--lora-rank", str(args.rank)]
        rows = [run_mode(common, device, steps, warmup), run_mode(lora, device, steps, warmup)]
        try:   # a shape whose projections hold no whole NF4 blocks (debug's ffn 688) has no QLoRA row
            check_nf4_layout(parse_args(lora).shape, 1)
            rows.append(run_mode([*lora, "--base-dtype", "nf4"], device, steps, warmup))
        except UserError as e:
            print(f"qlora: not run: {e}", flush=True)
    for r in rows:
        print(f"{r['mode']:5} {r['tokens_per_s']:10,.0f} tokens/s  trainable {r['trainable'] / 1e6:8.2f}M  "
              f"peak {r['peak_bytes'] / 2**20:9.1f} MiB  weights {r['weight_bytes'] / 2**20:9.1f} MiB  "
              f"optimizer {r['optimizer_bytes'] / 2**20:8.1f} MiB", flush=True)
    result = {"env": environment(), "preset": preset, "layers": args.layers, "seq_len": seq, "batch": batch,
              "rank": args.rank, "device": kind, "rows": rows}
    return publish(args, result, write_results_md)


def write_results_md(result: dict) -> None:
    env = result["env"]
    shape = f"{result['preset']}" + (f" ({result['layers']} layers)" if result["layers"] else "")
    append_rows("LoRA against full fine-tuning (one process, the same base)",
                ["date", "device", "torch", "model", "seq x batch", "mode", "tokens/s", "trainable", "peak MiB",
                 "optimizer MiB", "commit"],
                [[env["date"], env["device"], env["torch"], shape, f"{result['seq_len']} x {result['batch']}",
                  r["mode"] + (f" r={result['rank']}" if r["mode"] != "full" else ""), f"{r['tokens_per_s']:,.0f}",
                  f"{r['trainable'] / 1e6:.2f}M", f"{r['peak_bytes'] / 2**20:.1f}",
                  f"{r['optimizer_bytes'] / 2**20:.1f}", env["commit"]] for r in result["rows"]])


if __name__ == "__main__":
    raise SystemExit(main())
