"""`fsdpkit ckpt list DIR` and `fsdpkit ckpt show CKPT`: checkpoints on (shared) storage."""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path
from typing import Any, cast

from fsdpkit.cli.output import Parser, add_namespace, confirmed, dispatch, emit_json
from fsdpkit.effects import Effect, declare
from fsdpkit.errors import UserError
from fsdpkit.train.checkpoint.catalog import describe, prunable, read_meta, scan


def _gib(n: int) -> str:
    return f"{n / 2**30:.3f} GiB" if n >= 2**20 else f"{n / 1024:.1f} KiB"


def _remote(args: argparse.Namespace, verb: list[str]) -> Any:
    """Run the same verb in a helper pod that mounts the PVC; return its --json data."""
    from fsdpkit.cluster.client import connect
    from fsdpkit.cluster.pods import MOUNT, run_in_pod

    if not args.image:
        raise UserError("--pvc needs --image: an image with fsdpkit installed (your training image)")
    path = f"{MOUNT}/{args.directory.lstrip('/')}".rstrip("/")
    out = run_in_pod(connect(args.context, args.kubeconfig), args.namespace, args.pvc, args.image,
                     ["python", "-m", "fsdpkit", "ckpt", *verb, path, "--json"])
    start = out.find("{")
    try:
        envelope = json.loads(out[start:])
    except ValueError:
        raise UserError(f"the helper pod printed no JSON: {out.strip()[:200]}") from None
    if not envelope.get("ok"):
        raise UserError((envelope.get("error") or {}).get("message", "the helper pod failed"))
    return envelope["data"]


def _rows(args: argparse.Namespace) -> list[dict[str, Any]]:
    return _remote(args, ["list"]) if args.pvc else scan(Path(args.directory))


def latest(rows: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The newest complete checkpoint, fsdpkit's or the reference's naming alike."""
    done = [r for r in rows if r["complete"]]
    return max(done, key=lambda r: r["step"]) if done else None


def cmd_latest(args: argparse.Namespace) -> int:
    best = latest(_rows(args))
    if best is None:
        raise UserError(f"no complete checkpoint in {args.directory}")
    if args.json:
        return emit_json(best)
    print(best["path"])
    return 0


def _prune(args: argparse.Namespace, dry_run: bool) -> list[dict[str, Any]]:
    """What pruning deletes (with `dry_run`, would delete), here or in a helper pod on the PVC."""
    if args.pvc:
        verb = ["prune", *(["--keep", str(args.keep)] if args.keep is not None else []),
                *(["--older-than-days", str(args.older_than_days)] if args.older_than_days is not None else []),
                "--dry-run" if dry_run else "--yes"]
        return cast("list[dict[str, Any]]", _remote(args, verb))
    directory = Path(args.directory)
    scan(directory)  # a missing directory is a one-line error, not "nothing to delete"
    gone = [d for c in prunable(directory, args.keep, args.older_than_days) if (d := describe(c.path))]
    for r in gone if not dry_run else ():
        shutil.rmtree(r["path"])
    return gone


def cmd_prune(args: argparse.Namespace) -> int:
    """Delete complete fsdpkit checkpoints beyond the newest --keep, or older than --older-than-days.
    The newest complete checkpoint is never deleted, nor anything that is not fsdpkit's; what would
    go is listed and confirmed first (--yes)."""
    if args.keep is None and args.older_than_days is None:
        raise UserError("prune: give --keep N and/or --older-than-days D")
    gone = _prune(args, dry_run=True)
    if not args.dry_run and gone:
        names = ", ".join(r["name"] for r in gone)
        if not confirmed(args, f"checkpoints {names}", f"delete {len(gone)} checkpoint(s): {names}?"):
            return 1
        gone = _prune(args, dry_run=False)
    if args.json:
        return emit_json(gone)
    for r in gone:
        print(f"{'would delete' if args.dry_run else 'deleted'} {r['name']}")
    if not gone:
        print("nothing to delete")
    return 0


def cmd_list(args: argparse.Namespace) -> int:
    rows = _rows(args)
    if args.json:
        return emit_json(rows)
    if not rows:
        print(f"no checkpoints in {args.directory}")
        return 0
    print(f"{'name':<28}{'step':>8}  {'kind':<10}{'complete':<10}{'size':>12}  loss")
    for r in rows:
        loss = f"{r['loss']:.4f}" if r.get("loss") is not None else "-"
        state = "damaged" if r.get("damaged") else "yes" if r["complete"] else "NO"
        print(f"{r['name']:<28}{r['step']:>8}  {r['kind']:<10}{state:<10}"
              f"{_gib(r['bytes']):>12}  {loss}")
    return 0


def cmd_show(args: argparse.Namespace) -> int:
    path = Path(args.checkpoint)
    info = describe(path)
    if info is None:
        raise UserError(f"not a checkpoint: {path}")
    if info.get("damaged"):   # nothing here can be trusted, nor resumed
        raise UserError(f"ckpt show: {path} is damaged and cannot be read ({info['problem']}); "
                        f"fsdpkit ckpt list {path.parent} shows the whole ones")
    info["meta"] = read_meta(path)[0] or None  # None: missing or unreadable (describe says which)
    info["files"] = sorted(p.name for p in path.iterdir())
    if args.json:
        return emit_json(info)
    for key in ("name", "path", "kind", "step", "complete", "damaged", "problem", "world_size", "samples", "loss",
                "preset"):
        if info.get(key) is not None:
            print(f"{key:<11}{info[key]}")
    print(f"{'size':<11}{_gib(info['bytes'])} in {len(info['files'])} files")
    if info["meta"] and "model" in info["meta"]:
        m = info["meta"]["model"]
        print(f"{'model':<11}dim {m['dim']}, {m['n_layers']} layers, {m['n_heads']} heads "
              f"({m['n_kv_heads']} kv), vocab {m['vocab_size']}")
    return 0


def _count(raw: str) -> int:
    """--keep: a whole number of checkpoints, not negative (`--keep -1` once deleted one)."""
    try:
        n = int(raw)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number of checkpoints, got {raw!r}") from None
    if n < 0:
        raise argparse.ArgumentTypeError(f"{n} is below 0; give how many of the newest to keep (0 or more)")
    return n


def _days(raw: str) -> float:
    try:
        d = float(raw)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of days, got {raw!r}") from None
    if not d >= 0:
        raise argparse.ArgumentTypeError(f"{raw} is not 0 or more days")
    return d


def _storage_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("directory", help="a directory here, or with --pvc a path inside that volume")
    p.add_argument("--pvc", help="run in a short-lived pod that mounts this PersistentVolumeClaim")
    p.add_argument("--image", help="with --pvc: an image with fsdpkit installed (your training image)")
    add_namespace(p, "with --pvc: the claim's", when="pvc")
    p.add_argument("--context")
    p.add_argument("--kubeconfig")
    p.add_argument("--json", action="store_true", help="machine-readable output")


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="fsdpkit ckpt", description="List, find and prune checkpoints, here or on a PVC.")
    sub = parser.add_subparsers(dest="action", required=True, parser_class=Parser)
    p_list = sub.add_parser("list", help="checkpoints in a directory, oldest first")
    _storage_args(p_list)
    p_list.set_defaults(func=cmd_list)
    declare(p_list, Effect.NONE, pvc=Effect.REMOTE)
    p = sub.add_parser("latest", help="the newest complete checkpoint (fsdpkit's or the reference's naming)")
    _storage_args(p)
    p.set_defaults(func=cmd_latest)
    declare(p, Effect.NONE, pvc=Effect.REMOTE)
    p = sub.add_parser("prune", help="delete older complete checkpoints (never the newest)")
    _storage_args(p)
    p.add_argument("--keep", type=_count, help="keep the newest N (0 or more; the newest complete one always stays)")
    p.add_argument("--older-than-days", type=_days, help="delete those older than D days")
    p.add_argument("--dry-run", action="store_true", help="list what would be deleted")
    p.add_argument("--yes", action="store_true", help="do not ask for confirmation")
    p.set_defaults(func=cmd_prune)
    declare(p, Effect.DELETES, pvc=Effect.REMOTE)
    p_show = sub.add_parser("show", help="one checkpoint: step, size, world size, config, loss")
    p_show.add_argument("checkpoint")
    p_show.add_argument("--json", action="store_true", help="machine-readable output")
    p_show.set_defaults(func=cmd_show)
    declare(p_show, Effect.NONE)
    return parser


def main(argv: list[str]) -> int:
    return dispatch(build_parser(), argv)
