"""The tail of a training step on its own: the gradient norm, clipping and AdamW over a preset's weights.

    python -m benchmarks.optimizer_step --preset llama3_2_1b --device cuda   # on a GPU: 1.2B fp32 weights
    python -m benchmarks.optimizer_step --smoke                              # seconds; what CI runs

The weights are fp32, as the trainer keeps them (one process under autocast, or FSDP's shards), and
the gradients random. Each way of doing the tail is timed alone (median of the measured repeats
after warm-up; CUDA events on a GPU), with the bytes it must move through memory, so the time can
be set against the device's bandwidth:

- "clip_grad_norm_ + AdamW": what the trainer did before, and what most trainers do: the norm
  (reads every gradient), a multiply (reads and writes every gradient), then the optimizer;
- "clipped_step": fsdpkit's, the clipping done inside the fused AdamW kernel (fsdpkit.train.optim);
- the pieces: the norm alone, the multiply alone, fused AdamW alone.
"""

from __future__ import annotations

import dataclasses
import statistics
import time

import torch

from benchmarks.common import append_rows, device_of, environment, model_arguments, publish, replayed
from fsdpkit.train.model.presets import get_preset
from fsdpkit.train.model.transformer import Transformer
from fsdpkit.train.optim import clipped_step, gradient_norm


def timer(device: torch.device, fn, repeats: int, warmup: int) -> float:
    """Median seconds of fn() over `repeats` calls after `warmup` calls."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1000)
        else:
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def run(preset: str, device: torch.device, repeats: int, warmup: int, layers: int | None) -> dict:
    cfg = get_preset(preset)
    if layers:
        cfg = dataclasses.replace(cfg, n_layers=layers)
    with torch.device("meta"):
        model = Transformer(cfg, rope_len=16)
    model.to_empty(device=device)
    params = list(model.parameters())
    gen = torch.Generator(device=device).manual_seed(0)
    for p in params:
        p.data.normal_(0, 0.02, generator=gen)
        p.grad = torch.randn(p.shape, device=device, generator=gen) * 1e-3
    n = sum(p.numel() for p in params)
    grads = [p.grad for p in params]
    max_norm = 1e-4  # below the gradients' norm, so the clipping really scales

    def optimizer() -> torch.optim.Optimizer:
        return torch.optim.AdamW(params, lr=1e-6, fused=True)

    before, ours, alone = optimizer(), optimizer(), optimizer()

    def clip_then_step() -> None:
        torch.nn.utils.clip_grad_norm_(params, max_norm, foreach=True)
        before.step()

    coef = torch.tensor(0.999, device=device)
    # name -> (function, bytes it must move: 4 per fp32 value read or written)
    cases = {
        "clip_grad_norm_ + AdamW": (clip_then_step, 4 * n * (1 + 2 + 7)),
        "clipped_step (clip inside fused AdamW)": (lambda: clipped_step(ours, max_norm), 4 * n * (1 + 8)),
        "gradient norm alone": (lambda: gradient_norm(params), 4 * n),
        "gradient multiply alone": (lambda: torch._foreach_mul_(grads, coef), 4 * n * 2),
        # param, grad, exp_avg, exp_avg_sq read; param, exp_avg, exp_avg_sq written
        "fused AdamW alone": (alone.step, 4 * n * 7),
    }
    rows = []
    for name, (fn, nbytes) in cases.items():
        seconds = timer(device, fn, repeats, warmup)
        rows.append({"case": name, "ms": seconds * 1000, "bytes": nbytes, "gb_per_s": nbytes / seconds / 1e9})
        print(f"{name:42} {seconds * 1000:9.2f} ms  {nbytes / seconds / 1e9:8.1f} GB/s", flush=True)
    return {"preset": preset, "layers": cfg.n_layers, "params": n, "device": device.type, "rows": rows}


def main(argv: list[str] | None = None) -> int:
    parser = model_arguments(__doc__, "optimizer_step.json", "the tiny preset, a few repeats (CI)")
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args(argv)
    if replayed(args, write_results_md):
        return 0
    device = device_of(args)
    preset, repeats = ("tiny", 3) if args.smoke else (args.preset, args.repeats)
    result = {"env": environment(), **run(preset, device, repeats, 1 if args.smoke else 3, args.layers)}
    return publish(args, result, write_results_md)


def write_results_md(result: dict) -> None:
    env = result["env"]
    append_rows("Optimizer step: gradient norm, clipping, AdamW (fp32 weights)",
                ["date", "device", "torch", "preset", "params", "case", "ms", "GB/s moved", "commit"],
                [[env["date"], env["device"], env["torch"], result["preset"], f"{result['params'] / 1e6:,.0f}M",
                  r["case"], f"{r['ms']:.2f}", f"{r['gb_per_s']:.0f}", env["commit"]] for r in result["rows"]])


if __name__ == "__main__":
    raise SystemExit(main())
