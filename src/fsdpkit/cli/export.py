"""`fsdpkit export SRC OUT [--to hf|peft]`: a checkpoint as Hugging Face safetensors, or a LoRA run's
adapters as a PEFT adapter."""

from __future__ import annotations

import argparse
from pathlib import Path

from fsdpkit.cli.output import Parser, dispatch, emit_json
from fsdpkit.effects import Effect, declare


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(
        prog="fsdpkit export", description="Write a checkpoint as consolidated Hugging Face safetensors (a LoRA "
        "run's adapters merged into its base), or a LoRA run's adapters as a PEFT adapter.")
    parser.add_argument("source", help="a checkpoint, a checkpoint directory (newest), or a run directory")
    parser.add_argument("out", help="new directory for config.json and model*.safetensors (peft: "
                        "adapter_config.json and adapter_model.safetensors)")
    parser.add_argument("--to", choices=["hf", "peft"], default="hf",
                        help="hf: the whole model; peft: a LoRA run's adapters alone, for peft.PeftModel")
    parser.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32", help="dtype of the written weights")
    parser.add_argument("--json", action="store_true", help="machine-readable output")
    parser.set_defaults(func=run)
    declare(parser, Effect.WRITES | Effect.LONG)
    return parser


def main(argv: list[str]) -> int:
    return dispatch(build_parser(), argv)


def run(args: argparse.Namespace) -> int:
    from fsdpkit.train.export import export_hf

    result = export_hf(Path(args.source), Path(args.out), args.dtype, args.to)
    if args.json:
        return emit_json(result)
    tok = (f"tokenizer {result['tokenizer']} ({', '.join(result['tokenizer_files'])})" if result["tokenizer_files"]
           else f"the embedded byte tokenizer (no files; eos id {result['eos_token_id']})"
           if "eos_token_id" in result else "no tokenizer")
    what = "LoRA adapters (PEFT)" if args.to == "peft" else "merged LoRA model" if result["lora"] else "model"
    print(f"exported step {result['step']} of {result['checkpoint']} to {result['out']}: {what}, "
          f"{len(result['files'])} safetensors file(s), {args.dtype}; {tok}")
    return 0
