"""`fsdpkit presets`: the model presets and their sizes."""

from __future__ import annotations

from fsdpkit.cli.output import Parser, dispatch, emit_json
from fsdpkit.train.model_config import count_params
from fsdpkit.train.presets import PRESETS


def rows() -> list[dict]:
    out = []
    for name, c in PRESETS.items():
        out.append({
            "name": name, "params": count_params(c), "active_params": count_params(c, active=True),
            "vocab_size": c.vocab_size, "dim": c.dim, "n_layers": c.n_layers, "n_heads": c.n_heads,
            "n_kv_heads": c.n_kv_heads, "ffn_dim": c.ffn_dim, "max_seq_len": c.max_seq_len,
            "rope_theta": c.rope_theta, "n_experts": c.n_experts, "family": c.family,
        })
    return out


def _human(n: int) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.2f}M"


def main(argv: list[str]) -> int:
    parser = Parser(prog="fsdpkit presets", description="List the model presets.")
    parser.add_argument("--json", action="store_true", help="machine-readable output")
    parser.set_defaults(func=show)
    return dispatch(parser, argv)


def show(args) -> int:
    data = rows()
    if args.json:
        return emit_json(data)
    print(f"{'preset':<14}{'params':>9}{'active':>9}{'layers':>7}{'dim':>6}{'heads':>6}{'kv':>4}"
          f"{'ffn':>7}{'vocab':>8}{'context':>9}")
    for r in data:
        print(f"{r['name']:<14}{_human(r['params']):>9}{_human(r['active_params']):>9}{r['n_layers']:>7}"
              f"{r['dim']:>6}{r['n_heads']:>6}{r['n_kv_heads']:>4}{r['ffn_dim']:>7}{r['vocab_size']:>8}"
              f"{r['max_seq_len']:>9}")
    return 0
