"""`fsdpkit presets`: the model presets, their sizes and their training recipes."""

from __future__ import annotations

import argparse
from typing import Any

from fsdpkit.cli.output import Parser, dispatch, emit_json
from fsdpkit.effects import Effect, declare
from fsdpkit.train.config import build
from fsdpkit.train.model.config import count_params, params_text
from fsdpkit.train.model.presets import PRESETS, RECIPES
from fsdpkit.train.sections import LossConfig

# DPO's beta where a recipe leaves it to the option's own default.
BETA = LossConfig.model_fields["dpo_beta"].default


def recipe(name: str) -> dict[str, Any]:
    """What a run of this preset trains with when nothing else is given (the resolved config)."""
    cfg = build([{"preset": name}])
    o, d = cfg.optim, cfg.data
    return {"source": RECIPES[name].source, "lr": o.lr, "min_lr": o.min_lr, "lr_decay_style": o.lr_decay_style,
            "warmup_steps": o.warmup_steps, "weight_decay": o.weight_decay, "betas": [o.beta1, o.beta2],
            "eps": o.eps, "grad_clip": o.grad_clip, "tokenizer": d.tokenizer, "seq_len": d.seq_len,
            "train_batch_size": d.train_batch_size, "activation_checkpointing": cfg.parallel.activation_checkpointing,
            "validation_freq": cfg.log.validation_freq, "validation_batches": cfg.log.validation_batches,
            "validation_share": round(cfg.validation_share(), 4), "max_steps": o.max_steps,
            # Laid over the above for chat fine-tuning (--data-format chat), and LoRA's over both.
            "sft": {**RECIPES[name].sft, "source": RECIPES[name].sft_source or None},
            "lora": {**RECIPES[name].lora, "source": RECIPES[name].lora_source or None},
            "qlora": {**RECIPES[name].qlora, "source": RECIPES[name].qlora_source or None},
            "dpo": {**RECIPES[name].dpo, "source": RECIPES[name].dpo_source or None}}


def rows() -> list[dict[str, Any]]:
    out = []
    for name, c in PRESETS.items():
        out.append({
            "name": name, "params": count_params(c), "active_params": count_params(c, active=True),
            "vocab_size": c.vocab_size, "dim": c.dim, "n_layers": c.n_layers, "n_heads": c.n_heads,
            "n_kv_heads": c.n_kv_heads, "ffn_dim": c.ffn_dim, "max_seq_len": c.max_seq_len,
            "rope_theta": c.rope_theta, "n_experts": c.n_experts, "family": c.family, "recipe": recipe(name),
        })
    return out


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="fsdpkit presets", description="List the model presets and the training recipe each "
                    "carries (flags, YAML and job specs override any of it).")
    parser.add_argument("--json", action="store_true", help="machine-readable output")
    parser.set_defaults(func=show)
    declare(parser, Effect.NONE)
    return parser


def main(argv: list[str]) -> int:
    return dispatch(build_parser(), argv)


def show(args: argparse.Namespace) -> int:
    data = rows()
    if args.json:
        return emit_json(data)
    print(f"{'preset':<14}{'params':>9}{'active':>9}{'layers':>7}{'dim':>6}{'heads':>6}{'kv':>4}"
          f"{'ffn':>7}{'vocab':>8}{'context':>9}")
    for r in data:
        print(f"{r['name']:<14}{params_text(r['params']):>9}{params_text(r['active_params']):>9}{r['n_layers']:>7}"
              f"{r['dim']:>6}{r['n_heads']:>6}{r['n_kv_heads']:>4}{r['ffn_dim']:>7}{r['vocab_size']:>8}"
              f"{r['max_seq_len']:>9}")
    print(f"\n{'recipe':<14}{'lr':>8}{'floor':>9}{'warmup':>7}{'wd':>5}{'clip':>5}{'seq':>6}{'batch':>6}"
          f"{'val':>6}  tokenizer (source)")
    for r in data:
        c = r["recipe"]
        print(f"{r['name']:<14}{c['lr']:>8.2g}{c['min_lr']:>9.2g}{c['warmup_steps']:>7}{c['weight_decay']:>5}"
              f"{c['grad_clip']:>5}{c['seq_len']:>6}{c['train_batch_size']:>6}{c['validation_share']:>6.1%}  "
              f"{c['tokenizer']} ({c['source']})")
    print("\nwarm-up and validation shown for the default 300 steps; --max-steps scales them")
    print(f"\n{'chat SFT':<14}{'lr':>8}{'lora lr':>9}  (source)")
    for r in data:
        sft, lora = r["recipe"]["sft"], r["recipe"]["lora"]
        print(f"{r['name']:<14}{sft.get('lr', r['recipe']['lr']):>8.2g}{lora.get('lr', r['recipe']['lr']):>9.2g}  "
              f"({sft['source'] or 'the recipe above'})")
    print(f"\n{'QLoRA':<14}{'schedule':>9}{'clip':>6}  (source; over LoRA's, with --base-dtype nf4)")
    for r in data:
        q, c = r["recipe"]["qlora"], r["recipe"]
        style, clip = q.get("lr_decay_style", c["lr_decay_style"]), q.get("grad_clip", c["grad_clip"])
        print(f"{r['name']:<14}{style:>9}{clip:>6}  ({q['source'] or 'the recipe above'})")
    print(f"\n{'DPO':<14}{'lr':>8}{'beta':>9}  (source)")
    for r in data:
        dpo = r["recipe"]["dpo"]
        print(f"{r['name']:<14}{dpo.get('lr', r['recipe']['lr']):>8.2g}{dpo.get('dpo_beta', BETA):>9.2g}  "
              f"({dpo['source'] or 'the recipe above'})")
    return 0
