"""`fsdpkit eval MODEL --tasks T[,T...]`: score an exported model with lm-evaluation-harness."""

from __future__ import annotations

import argparse
from pathlib import Path

from fsdpkit.cli.output import Parser, dispatch, emit_json
from fsdpkit.effects import Effect, declare


def _limit(raw: str) -> float:
    """--limit: above 0; below 1 a fraction of each task, else that many documents (the harness's rule)."""
    try:
        value = float(raw)
    except ValueError:
        value = 0.0
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"expected documents per task above 0 (below 1: a fraction of each task), "
                                         f"got {raw!r}")
    return value


def _batch(raw: str) -> int:
    try:
        value = int(raw)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected sequences per forward, 1 or more, got {raw!r}")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(
        prog="fsdpkit eval", description="Score an exported model (fsdpkit export) on lm-evaluation-harness tasks; "
        "the scores go into the run's summary.json (the run the export came from, or --run-dir) and its report. "
        "Needs the eval extra: pip install 'fsdpkit[eval]'.")
    parser.add_argument("model", help="an exported Hugging Face directory (config.json, safetensors, tokenizer)")
    parser.add_argument("--tasks", required=True, help="comma-separated task names (the harness's, or files in "
                        "--include-path)")
    parser.add_argument("--include-path", help="a directory of task YAML files (local tasks run offline)")
    parser.add_argument("--limit", type=_limit, help="documents per task (below 1: a fraction); default all")
    parser.add_argument("--num-fewshot", type=int, help="few-shot examples (default: each task's own)")
    parser.add_argument("--batch-size", type=_batch, default=8, help="sequences per forward (default: 8)")
    parser.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto", help="where to run")
    parser.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32", help="weights' dtype when scoring")
    parser.add_argument("--run-dir", help="the run to record the scores in, each task's as it finishes (made if "
                        "missing; default: the one the export came from)")
    parser.add_argument("--json", action="store_true", help="machine-readable output")
    parser.set_defaults(func=run)
    declare(parser, Effect.WRITES | Effect.LONG)   # the scores go into the run's summary
    return parser


def main(argv: list[str]) -> int:
    return dispatch(build_parser(), argv)


def run(args: argparse.Namespace) -> int:
    from fsdpkit.train.evaluate import evaluate

    tasks = [t.strip() for t in args.tasks.split(",") if t.strip()]
    result = evaluate(Path(args.model), tasks, Path(args.include_path) if args.include_path else None, args.limit,
                      args.num_fewshot, args.batch_size, args.device, args.dtype,
                      Path(args.run_dir) if args.run_dir else None)
    if args.json:
        return emit_json(result)
    for task, metrics in result["tasks"].items():
        print(f"{task}: " + ", ".join(f"{k} {v:.4f}" for k, v in metrics.items()))
    print(f"recorded in {result['run_dir']}/summary.json" if result["run_dir"] else
          "not recorded in a run (pass --run-dir)")
    return 0
