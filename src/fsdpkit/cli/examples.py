"""`fsdpkit examples list|show`: the example job specs, and a project's requirements file, that ship
inside the package."""

from __future__ import annotations

import argparse
from pathlib import Path

from fsdpkit.cli.output import Parser, dispatch, emit_json, write_new
from fsdpkit.effects import Effect, declare


def list_(args: argparse.Namespace) -> int:
    from fsdpkit.jobs.starter import examples

    found = examples()
    if args.json:
        return emit_json([{"name": n, "description": d} for n, d in found.items()])
    for name, description in found.items():
        print(f"{name:16} {description}")
    print("\nfsdpkit examples show NAME --out job.yaml   writes one to edit; fsdpkit job init writes a blank one")
    return 0


def show(args: argparse.Namespace) -> int:
    from fsdpkit.jobs.starter import example

    text = example(args.name)
    if args.out:
        write_new(Path(args.out), text, args.force)
    if args.json:
        return emit_json({"name": args.name.removesuffix(".yaml"), "text": text, "path": args.out})
    print(f"wrote {args.out}" if args.out else text, end="\n" if args.out else "")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="fsdpkit examples", description="Example job specs (local, EKS, HyperPod, Trainer v2, "
                    "KubeRay, Slurm) and a project's requirements file, shipped with fsdpkit.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    p = sub.add_parser("list", help="the examples: job specs and a requirements file")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=list_)
    declare(p, Effect.NONE)
    p = sub.add_parser("show", help="print an example, or write it with --out")
    p.add_argument("name", help="an example's name (see `fsdpkit examples list`)")
    p.add_argument("--out", help="write it to this file")
    p.add_argument("--force", action="store_true", help="overwrite an existing file")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=show)
    declare(p, Effect.NONE, out=Effect.WRITES, force=Effect.OVERWRITES)
    return parser


def main(argv: list[str]) -> int:
    return dispatch(build_parser(), argv)
