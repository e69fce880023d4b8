"""`fsdpkit image init|check`: a Dockerfile on a known-good base, and conflict analysis."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from fsdpkit.cli.output import Parser, dispatch, emit_json
from fsdpkit.errors import UserError


def cmd_init(args: argparse.Namespace) -> int:
    from fsdpkit.image.dockerfile import DOCKERIGNORE, render

    out = Path(args.out)
    reqs = None if args.no_requirements else args.requirements
    if reqs and not (out / reqs).is_file():
        raise UserError(f"--requirements: {out / reqs} not found (or pass --no-requirements)")
    files = {out / "Dockerfile": render(args.base, reqs, hyperpod_agent=args.hyperpod), out / ".dockerignore":
             DOCKERIGNORE}
    existing = [str(p) for p in files if p.exists()]
    if existing and not args.force:
        raise UserError(f"{', '.join(existing)} already exists; pass --force to overwrite")
    for path, text in files.items():
        path.write_text(text)
    if args.json:
        return emit_json({"written": [str(p) for p in files]})
    print(f"wrote {', '.join(str(p) for p in files)}; check it with: fsdpkit image check {out / 'Dockerfile'}")
    return 0


def cmd_check(args: argparse.Namespace) -> int:
    from fsdpkit.image.conflicts import check, fix

    dockerfile = Path(args.dockerfile)
    reqs = [Path(r) for r in args.requirements or []]
    for p in [dockerfile, *reqs]:
        if not p.is_file():
            raise UserError(f"{p}: file not found")
    changed = fix(dockerfile, reqs) if args.fix else []
    found = check(dockerfile, reqs)
    if args.json:
        emit_json({"conflicts": [c.to_dict() for c in found], "fixed_files": changed})
        return 1 if found else 0
    for c in found:
        print(f"{c.kind}: {c.file}:{c.line}: {c.detail}\n  fix: {c.fix}")
    if changed:
        print(f"--fix rewrote: {', '.join(changed)}")
    print("no conflicts" if not found else f"{len(found)} conflict(s)")
    return 1 if found else 0


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="fsdpkit image", description="Container images for training.")
    sub = parser.add_subparsers(dest="cmd", required=True, metavar="VERB", parser_class=Parser)
    p = sub.add_parser("init", help="write a Dockerfile and .dockerignore on a known-good base")
    p.add_argument("--base", default="dlc-2.6", help="dlc-2.6 (default), dlc-2.5, pytorch-2.6")
    p.add_argument("--requirements", default="requirements.txt")
    p.add_argument("--no-requirements", action="store_true")
    p.add_argument("--hyperpod", action="store_true", help="add hyperpod-elastic-agent (HyperPodPyTorchJob)")
    p.add_argument("--out", default=".")
    p.add_argument("--force", action="store_true")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_init)
    p = sub.add_parser("check", help="PyTorch / CUDA / EFA conflicts in a Dockerfile and requirements")
    p.add_argument("dockerfile", nargs="?", default="Dockerfile")
    p.add_argument("-r", "--requirements", action="append", help="a requirements file (repeatable)")
    p.add_argument("--fix", action="store_true", help="rewrite the files so that no conflict is left")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_check)
    return parser


def main(argv: list[str] | None = None) -> int:
    return dispatch(build_parser(), list(sys.argv[1:] if argv is None else argv))
