"""`fsdpkit ckpt list DIR` and `fsdpkit ckpt show CKPT`: checkpoints on (shared) storage."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from fsdpkit.cli.output import dispatch, emit_json
from fsdpkit.errors import UserError
from fsdpkit.train.checkpoint import META, describe, scan


def _gib(n: int) -> str:
    return f"{n / 2**30:.3f} GiB" if n >= 2**20 else f"{n / 1024:.1f} KiB"


def cmd_list(args: argparse.Namespace) -> int:
    rows = scan(Path(args.directory))
    if args.json:
        return emit_json(rows)
    if not rows:
        print(f"no checkpoints in {args.directory}")
        return 0
    print(f"{'name':<28}{'step':>8}  {'kind':<10}{'complete':<10}{'size':>12}  loss")
    for r in rows:
        loss = f"{r['loss']:.4f}" if r.get("loss") is not None else "-"
        print(f"{r['name']:<28}{r['step']:>8}  {r['kind']:<10}{'yes' if r['complete'] else 'NO':<10}"
              f"{_gib(r['bytes']):>12}  {loss}")
    return 0


def cmd_show(args: argparse.Namespace) -> int:
    path = Path(args.checkpoint)
    info = describe(path)
    if info is None:
        raise UserError(f"not a checkpoint: {path}")
    meta_file = path / META
    info["meta"] = json.loads(meta_file.read_text()) if meta_file.is_file() else None
    info["files"] = sorted(p.name for p in path.iterdir())
    if args.json:
        return emit_json(info)
    for key in ("name", "path", "kind", "step", "complete", "world_size", "samples", "loss", "preset"):
        if info.get(key) is not None:
            print(f"{key:<11}{info[key]}")
    print(f"{'size':<11}{_gib(info['bytes'])} in {len(info['files'])} files")
    if info["meta"] and "model" in info["meta"]:
        m = info["meta"]["model"]
        print(f"{'model':<11}dim {m['dim']}, {m['n_layers']} layers, {m['n_heads']} heads "
              f"({m['n_kv_heads']} kv), vocab {m['vocab_size']}")
    return 0


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="fsdpkit ckpt", description="List and inspect checkpoints.")
    sub = parser.add_subparsers(dest="action", required=True)
    p_list = sub.add_parser("list", help="checkpoints in a directory, oldest first")
    p_list.add_argument("directory")
    p_list.add_argument("--json", action="store_true", help="machine-readable output")
    p_list.set_defaults(func=cmd_list)
    p_show = sub.add_parser("show", help="one checkpoint: step, size, world size, config, loss")
    p_show.add_argument("checkpoint")
    p_show.add_argument("--json", action="store_true", help="machine-readable output")
    p_show.set_defaults(func=cmd_show)
    return dispatch(parser, argv)
