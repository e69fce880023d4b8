"""`fsdpkit report RUN_DIR [RUN_DIR ...]`: loss, learning rate, throughput, MFU, memory and restarts
of one or more runs as PNGs and one self-contained HTML page (also for a run still being written)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from fsdpkit.cli.output import Parser, dispatch, emit_json
from fsdpkit.effects import Effect, declare
from fsdpkit.errors import UserError


def run(args: argparse.Namespace) -> int:
    from fsdpkit.report.page import write_report
    from fsdpkit.report.runs import load_runs

    runs = load_runs([Path(p) for p in args.run_dirs])
    out = Path(args.out) if args.out else Path(args.run_dirs[0]) / "report"
    cluster = None
    if args.cluster_metrics:
        try:
            cluster = json.loads(Path(args.cluster_metrics).read_text())
        except (OSError, ValueError) as e:
            raise UserError(f"--cluster-metrics {args.cluster_metrics}: cannot read it ({e}); write it with "
                            "`fsdpkit metrics JOB --prometheus URL --out FILE`") from None
    result = write_report(runs, out, cluster)
    if args.json:
        return emit_json(result)
    for s, run in zip(result["runs"], runs, strict=True):
        state = "finished" if s["finished"] else "running or stopped"
        loss = f"loss {s['first_loss']:.4f} -> {s['final_loss']:.4f}" if s["first_loss"] is not None else "no loss yet"
        restarts = f", restarted {len(run.restarts)} time(s) (at step {', '.join(map(str, run.restarts))})" \
            if run.restarts else ""
        print(f"{s['name']}: {s['steps']} steps ({state}), {loss}{restarts}")
    print(f"report: {result['html']} ({len(result['plots'])} plots)")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="fsdpkit report", description="Plot one or more runs (also one still being written): "
                    "loss, validation loss, learning rate, tokens/s, MFU, memory and restarts, as PNGs and one "
                    "self-contained HTML page.")
    parser.add_argument("run_dirs", nargs="+", metavar="RUN_DIR", help="run directories (with metrics.jsonl)")
    parser.add_argument("--out", help="where the HTML and PNGs go (default: FIRST_RUN_DIR/report)")
    parser.add_argument("--cluster-metrics", metavar="FILE", help="also plot each node's GPU utilisation next to "
                        "the trainer's tokens/s (the JSON that `fsdpkit metrics JOB --out FILE` writes)")
    parser.add_argument("--json", action="store_true", help="machine-readable output")
    parser.set_defaults(func=run)
    declare(parser, Effect.WRITES | Effect.LONG)
    return parser


def main(argv: list[str]) -> int:
    return dispatch(build_parser(), argv)
