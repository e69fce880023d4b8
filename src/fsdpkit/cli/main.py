"""`fsdpkit` entry point: dispatches to one module per verb."""

from __future__ import annotations

import argparse
import sys

from fsdpkit import __version__

VERBS = {
    "train": "train a model (embedded default with no flags; --nproc N for N processes)",
    "presets": "list the model presets with their parameter counts",
    "ckpt": "list and inspect checkpoints (ckpt list DIR, ckpt show CKPT)",
}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(prog="fsdpkit", description="FSDP2 training from laptop to cluster.")
    parser.add_argument("--version", action="version", version=f"fsdpkit {__version__}")
    sub = parser.add_subparsers(dest="verb", metavar="COMMAND")
    for verb, help_text in VERBS.items():
        sub.add_parser(verb, help=help_text, add_help=False)
    if not argv or argv[0] not in VERBS:
        parser.parse_args(argv or ["--help"])
        return 2
    verb, rest = argv[0], argv[1:]
    if verb == "train":
        from fsdpkit.train.launch import main as train_main

        return train_main(rest, prog="fsdpkit train")
    if verb == "ckpt":
        from fsdpkit.cli import ckpt

        return ckpt.main(rest)
    from fsdpkit.cli import presets

    return presets.main(rest)
