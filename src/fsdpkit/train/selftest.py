"""`fsdpkit selftest --level quick|standard|full`: does this environment (an image, a node) have
what training needs? What `fsdpkit image test` runs inside an image; imports only the training side.

quick     the packages import; versions; what accelerators and collectives are visible
standard  + every preset's model builds on the meta device with its published size
full      + one forward/backward/optimizer step of the debug preset (on the GPU if there is one)
"""

from __future__ import annotations

import importlib
import json
import sys
import time
from collections.abc import Callable
from typing import Any

from fsdpkit.effects import Effect, declare
from fsdpkit.envelope import Parser, emit_error, emit_json
from fsdpkit.errors import UserError

LEVELS = ("quick", "standard", "full")
REQUIRED = ("torch", "numpy", "yaml", "safetensors", "tokenizers", "tqdm")


def _imports() -> dict[str, Any]:
    versions, missing = {}, []
    for name in REQUIRED:
        try:
            mod = importlib.import_module(name)
            versions[name] = getattr(mod, "__version__", "?")
        except ImportError as e:
            missing.append(f"{name} ({e})")
    if missing:
        raise RuntimeError(f"cannot import: {', '.join(missing)}")
    return versions


def _devices() -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    info: dict[str, Any] = {"cuda_available": torch.cuda.is_available(), "cuda_build": torch.version.cuda,
                            "gloo": dist.is_gloo_available(), "nccl": dist.is_nccl_available()}
    if torch.cuda.is_available():
        info["gpus"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
        info["nccl_version"] = ".".join(map(str, torch.cuda.nccl.version()))
    if not info["gloo"] and not info["nccl"]:
        raise RuntimeError("torch.distributed has neither gloo nor nccl: this torch build cannot train in parallel")
    return info


def _presets() -> dict[str, Any]:
    import torch

    from fsdpkit.train.model.config import count_params
    from fsdpkit.train.model.presets import PRESETS
    from fsdpkit.train.model.transformer import Transformer

    out = {}
    for name, cfg in PRESETS.items():
        with torch.device("meta"):
            model = Transformer(cfg)
        n = sum(p.numel() for p in model.parameters())
        if n != count_params(cfg):
            raise RuntimeError(f"preset {name}: built {n} parameters, expected {count_params(cfg)}")
        out[name] = n
    return out


def _step() -> dict[str, Any]:
    import torch

    from fsdpkit.train.model.presets import get_preset
    from fsdpkit.train.model.transformer import Transformer

    device = "cuda" if torch.cuda.is_available() else "cpu"
    cfg = get_preset("debug")
    torch.manual_seed(0)
    with torch.device("meta"):
        model = Transformer(cfg)
    model.to_empty(device=device)
    model.init_weights(seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randint(0, cfg.vocab_size, (2, 64), device=device)
    losses = []
    for _ in range(2):
        ce, total = model.loss(x[:, :-1], x[:, 1:], None)
        total.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(ce.detach()))
    if not all(v == v and v < 100 for v in losses):  # NaN or exploding
        raise RuntimeError(f"the debug step gave losses {losses}")
    return {"device": device, "losses": losses}


CHECKS: dict[str, list[tuple[str, Callable[[], Any]]]] = {
    "quick": [("imports", _imports), ("devices", _devices)],
    "standard": [("presets", _presets)],
    "full": [("train step", _step)],
}


def run(level: str) -> tuple[bool, list[dict[str, Any]]]:
    results, ok = [], True
    for lvl in LEVELS[:LEVELS.index(level) + 1]:
        for name, fn in CHECKS[lvl]:
            t0 = time.perf_counter()
            try:
                detail, status = fn(), "pass"
            except Exception as e:  # a failed check is a result, not a crash
                detail, status, ok = f"{type(e).__name__}: {e}", "fail", False
            results.append({"check": name, "level": lvl, "status": status,
                            "seconds": round(time.perf_counter() - t0, 2), "detail": detail})
    return ok, results


def build_parser() -> Parser:
    p = Parser(prog="fsdpkit selftest", description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("--level", choices=LEVELS, default="quick")
    p.add_argument("--json", action="store_true")
    declare(p, Effect.LONG)
    return p


def main(argv: list[str] | None = None) -> int:
    try:
        args = build_parser().parse_args(argv)
    except UserError as e:
        return emit_error(e, "--json" in (sys.argv[1:] if argv is None else argv))
    ok, results = run(args.level)
    if args.json:
        failed = [r for r in results if r["status"] == "fail"]
        message = f"selftest failed: {failed[0]['check']}: {str(failed[0]['detail'])[:300]}" if failed else None
        return emit_json(results, 0 if ok else 1, message, hint="fsdpkit image check Dockerfile finds PyTorch/"
                         "CUDA/EFA conflicts in an image's definition")
    else:
        for r in results:
            detail = r["detail"] if isinstance(r["detail"], str) else json.dumps(r["detail"], default=str)
            print(f"{'PASS' if r['status'] == 'pass' else 'FAIL'}  {r['check']:<10} {r['seconds']:>6.2f}s  "
                  f"{detail[:160]}")
        print(f"selftest {args.level}: {'passed' if ok else 'FAILED'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
