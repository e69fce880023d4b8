"""Training throughput: fsdpkit's trainer against the reference baseline, in one run, same machine.

    python -m benchmarks.train_throughput              # full size; appends to benchmarks/RESULTS.md
    python -m benchmarks.train_throughput --smoke      # seconds; what CI runs
    python -m benchmarks.train_throughput --only compare,ablation

Every measurement is a fresh process (under torchrun for more than one rank, and for the
baseline, which the reference always launches with torchrun), so imports, allocator state and
compile caches never leak from one case into the next. Every case trains on the embedded text with
the bytes tokenizer at the preset's own vocabulary (the head costs what it costs), so a benchmark
never reaches the network; `--dry-run` sets up every case (configuration, data, first batch)
without training, which is how the suite checks that. Each reports the median step time after
warm-up, tokens/s, MFU and peak memory:

- compare: fsdpkit vs the baseline (benchmarks/reference_baseline.py) for the same preset, batch,
  sequence and precision, 1 process and 2 FSDP ranks; the ratio is fsdpkit / baseline tokens/s.
  Beside them, the compiled peer: transformers under torch.compile in one process, with fp32
  weights under autocast and with bf16 weights.
- curve: how fsdpkit's step time grows with sequence length and with model size.
- ablation: each performance switch of the trainer on and off, and what it gains.
- gpu (only with a CUDA device): llama3_2_1b at sequence 2048 and 8192 in bf16 with and without
  compile and activation checkpointing, and llama3_1_8b with fewer layers.

On a CPU the MFU denominator is this machine's GEMM rate measured in the same run (all cores, the
run's precision); on a GPU it is the data-sheet peak. Peak memory is the CUDA allocator's peak, or
on a CPU the resident set's high-water mark minus the resident set before the model was built.
The precision is bf16 on GPUs and on CPUs whose bf16 matmuls are measured faster than their fp32
ones (an AVX512-BF16 flag is no promise of that), fp32 elsewhere, for fsdpkit and the baseline alike.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from benchmarks.common import append_rows, arguments, environment, write_json

SECTIONS = ("compare", "curve", "ablation", "gpu")


def case(section: str, impl: str, preset: str, seq: int, batch: int, world: int, dtype: str,
         flags: tuple[str, ...] = (), label: str = "", steps: int = 8, warmup: int = 2, fsdp: bool = False,
         weights: str = "", compile: bool = True) -> dict:
    """One measurement. fsdpkit with one process runs unsharded, as `fsdpkit train` does; `fsdp`
    runs it under torchrun as one FSDP2 rank instead, the way the baseline always runs. The
    transformers peer (impl "transformers") has `weights` "fp32" (autocast) or "bf16", and runs
    under torch.compile unless `compile` is off."""
    return {"section": section, "impl": impl, "preset": preset, "seq": seq, "batch": batch, "world": world,
            "dtype": dtype, "flags": list(flags), "label": label or impl, "steps": steps, "warmup": warmup,
            "fsdp": fsdp, "weights": weights, "compile": compile}


def peer(section: str, preset: str, seq: int, batch: int, weights: str, steps: int = 8, warmup: int = 2,
         flags: tuple[str, ...] = (), compiled: bool = True) -> dict:
    """The transformers peer; `compiled=False` (the smoke's) runs it eagerly, without compile's cold start."""
    label = {"fp32": "fp32 weights+autocast", "bf16": "bf16 weights"}[weights]
    label = f"transformers+compile {label}" if compiled else f"transformers eager {label}"
    return case(section, "transformers", preset, seq, batch, 1, "bf16", flags, label, steps, warmup,
                weights=weights, compile=compiled)


# A benchmark measures training, not the hub: local text and the bytes tokenizer, the model's
# vocabulary unchanged (a case's own flags come after, and win).
OFFLINE_DATA = ("--dataset", "embedded", "--tokenizer", "bytes")


COMPILE = ("--compile", "1")
EAGER = ("--compile", "0")
WIDE = ("--dim", "512", "--n-heads", "16", "--n-kv-heads", "8", "--ffn-dim", "1376")


def plan(smoke: bool, device: str, dtype: str, only: set[str]) -> list[dict]:
    cases: list[dict] = []
    if device == "cuda":
        if "gpu" in only:
            cases = gpu_plan(torch.cuda.device_count())
        return cases
    if smoke:  # each path once: torchrun with FSDP for both trainers, and fsdpkit alone
        tiny = {"steps": 2, "warmup": 1}
        if "compare" in only:
            cases += [case("compare", impl, "tiny", 64, 2, 2, dtype, **tiny) for impl in ("fsdpkit", "baseline")]
            # Beside the curve's one process; eager: a cold torch.compile is the benchmark's cost, not the smoke's.
            cases.append(peer("compare", "tiny", 32, 2, "fp32", compiled=False, **tiny))
        if "curve" in only:
            cases.append(case("curve", "fsdpkit", "tiny", 32, 2, 1, dtype, label="seq 32", **tiny))
        return cases
    if "compare" in only:
        for w in (1, 2):
            cases += [case("compare", "fsdpkit", "debug", 512, 16, w, dtype),
                      case("compare", "fsdpkit", "debug", 512, 16, w, dtype, COMPILE, "fsdpkit+compile"),
                      case("compare", "baseline", "debug", 512, 16, w, dtype)]
    if "curve" in only:
        cases += [case("curve", "fsdpkit", "debug", s, 8192 // s, 1, dtype, label=f"seq {s}", steps=4)
                  for s in (128, 256, 1024)]
        cases += [case("curve", "fsdpkit", "tiny", 512, 16, 1, dtype, label="tiny", steps=4),
                  case("curve", "fsdpkit", "debug", 512, 16, 1, dtype, WIDE, "debug 2x wider", steps=4),
                  case("curve", "fsdpkit", "debug", 512, 16, 1, dtype, ("--n-layers", "8"), "debug 2x deeper",
                       steps=4)]
    if "ablation" in only:
        cases += [case("ablation", "fsdpkit", "debug", 512, 16, 1, dtype, flags, label, steps=5)
                  for flags, label in ABLATIONS]
    return cases


def gpu_plan(n_gpus: int) -> list[dict]:
    """One GPU: llama3_2_1b in bf16 at 2048 and 8192 tokens, compile and activation checkpointing on
    and off, against the baseline; llama3_1_8b with 4 layers (the full model's AdamW state alone
    is 128 GB). With several GPUs, also FSDP over all of them. The most wanted figures come first,
    so a lease that runs out still has them."""
    ac = ("--activation-checkpointing", "full")

    def one(impl: str, seq: int, batch: int, flags: tuple[str, ...] = (), label: str = "", fsdp: bool = False) -> dict:
        return case("gpu", impl, "llama3_2_1b", seq, batch, 1, "bf16", flags, label or impl, 10, 3, fsdp)

    # No flags is the defaults (compile on CUDA); "eager" is the same run without compile.
    cases = [one("fsdpkit", 2048, 4, (), "defaults"), one("fsdpkit", 2048, 4, EAGER, "eager"),
             one("fsdpkit", 2048, 4, COMPILE, "compile"), one("baseline", 2048, 4),
             peer("gpu", "llama3_2_1b", 2048, 4, "fp32", 10, 3), peer("gpu", "llama3_2_1b", 2048, 4, "bf16", 10, 3),
             one("fsdpkit", 2048, 4, COMPILE, "compile as 1 FSDP rank", fsdp=True),
             one("fsdpkit", 2048, 8, COMPILE, "compile"), one("baseline", 2048, 8),
             one("fsdpkit", 2048, 4, (*COMPILE, "--loss-chunk-tokens", "523"), "compile chunked loss"),
             one("fsdpkit", 2048, 4, ac, "ac"), one("fsdpkit", 2048, 4, (*COMPILE, *ac), "compile+ac"),
             one("fsdpkit", 8192, 1, EAGER, "eager"), one("fsdpkit", 8192, 1, COMPILE, "compile"),
             one("baseline", 8192, 1),
             peer("gpu", "llama3_2_1b", 8192, 1, "fp32", 10, 3), peer("gpu", "llama3_2_1b", 8192, 1, "bf16", 10, 3),
             one("fsdpkit", 8192, 1, (*COMPILE, *ac), "compile+ac")]
    cases.append(case("gpu", "fsdpkit", "llama3_1_8b", 2048, 2, 1, "bf16",
                      ("--n-layers", "4", *COMPILE, *ac), "8b 4 layers", 10, 3))
    cases += family_plan()
    if n_gpus > 1:
        cases += [case("gpu", impl, "llama3_2_1b", 2048, 4, n_gpus, "bf16", (), impl, 10, 3)
                  for impl in ("fsdpkit", "baseline")]
    return cases


def family_plan() -> list[dict]:
    """Every family the presets name, at the lengths where their masks and experts cost most, on one
    GPU with fsdpkit's defaults (compile on): Llama at 8192 packed with document masking against the
    same without; Mistral's shape (4 layers) with its 4096-token window, full causal, and window plus
    document masking, and transformers' Mistral beside it; Mixtral's shape with 2 of its layers
    against transformers' Mixtral; float8 against bf16 on Llama 3.1 8B's shape (4 layers)."""
    rows = [case("gpu", "fsdpkit", "llama3_2_1b", 8192, 1, 1, "bf16", ("--document-masking", "1"), "doc-masked", 10, 3)]
    mistral = ("--n-layers", "4")
    for flags, label in (((*mistral, "--sliding-window", "4096"), "window 4096"),
                         ((*mistral, "--sliding-window", "0"), "full causal"),
                         ((*mistral, "--sliding-window", "4096", "--document-masking", "1"), "window+doc")):
        rows.append(case("gpu", "fsdpkit", "mathstral_7b", 8192, 1, 1, "bf16", flags, label, 10, 3))
    rows.append(case("gpu", "baseline", "mathstral_7b", 8192, 1, 1, "bf16", (*mistral, "--sliding-window", "4096"),
                     "window 4096", 10, 3))
    for impl in ("fsdpkit", "baseline"):
        rows.append(case("gpu", impl, "mixtral_8x7b", 2048, 2, 1, "bf16", ("--n-layers", "2"), "2 layers", 10, 3))
    eight = ("--n-layers", "4", "--activation-checkpointing", "full")
    rows += [case("gpu", "fsdpkit", "llama3_1_8b", 2048, 2, 1, "bf16", eight, "8b 4 layers bf16", 10, 3),
             case("gpu", "fsdpkit", "llama3_1_8b", 2048, 2, 1, "bf16", (*eight, "--float8", "1"),
                  "8b 4 layers float8", 10, 3)]
    # float8's target shape (issue 34: >= 1.20x bf16 at 8192 x 1), each scaling, the head in float8 too.
    long = ("--n-layers", "4", "--activation-checkpointing", "selective")
    rows.append(case("gpu", "fsdpkit", "llama3_1_8b", 8192, 1, 1, "bf16", long, "8b 4 layers bf16", 10, 3))
    for extra, label in ((("--float8-recipe", "tensorwise"), "float8 tensorwise"),
                         (("--float8-recipe", "rowwise"), "float8 rowwise"),
                         (("--float8-recipe", "tensorwise", "--float8-head", "1"), "float8 tensorwise+head")):
        rows.append(case("gpu", "fsdpkit", "llama3_1_8b", 8192, 1, 1, "bf16", (*long, "--float8", "1", *extra),
                         f"8b 4 layers {label}", 10, 3))
    return rows


# Each switch against fsdpkit's defaults (debug, seq 512, batch 16, one process).
ABLATIONS: list[tuple[tuple[str, ...], str]] = [
    ((), "defaults"),
    (("--fused-optimizer", "0"), "foreach AdamW (fused off)"),
    (("--compile", "1"), "torch.compile per block"),
    (("--activation-checkpointing", "full"), "activation checkpointing: full"),
    (("--activation-checkpointing", "selective"), "activation checkpointing: every 2nd block"),
    (("--vocab-size", "32000"), "vocab 32000 chunked loss (default)"),
    (("--vocab-size", "32000", "--loss-chunk-tokens", "0"), "vocab 32000 full fp32 logits"),
]


# --- one case, in its own process(es) --------------------------------------------------------------
class CaseFailed(RuntimeError):
    """One case's process failed or hung; the run goes on with the other cases."""


def run_case(c: dict, tmp: Path, device: str, timeout: float | None = None) -> dict:
    out = Path(tempfile.mkdtemp(prefix="case-", dir=tmp))
    env = dict(os.environ)
    if device == "cpu":
        # Each rank gets its share of the cores, for both trainers alike (torchrun would give 1).
        env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // c["world"]))
    worker = ["-m", "benchmarks.train_throughput", "--worker", json.dumps(c), "--worker-out", str(out),
              "--device", device]
    if c["world"] > 1 or c["impl"] == "baseline" or c.get("fsdp"):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={c['world']}",
               *worker]
    else:  # fsdpkit with one process runs as `fsdpkit train` does: no torchrun, no sharding
        cmd = [sys.executable, *worker]
    try:
        r = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=Path(__file__).parent.parent,
                           timeout=timeout)
        err = r.stderr
    except subprocess.TimeoutExpired as e:
        r, err = None, f"timed out after {timeout} s\n{(e.stderr or b'')[-4000:]!r}"
    ranks = [json.loads(p.read_text()) for p in sorted(out.glob("rank*.json"))]
    if r is None or r.returncode != 0 or len(ranks) != c["world"]:
        raise CaseFailed(f"case {c['label']} ({c['impl']}, world {c['world']}) failed:\n{err[-4000:]}")
    row = {**c, "peak_memory_bytes": max(x["peak_memory_bytes"] for x in ranks), "step_times": ranks[0]["step_times"]}
    return timed(row, ranks[0]["step_times"][c["warmup"]:])


def timed(row: dict, measured: list[float]) -> dict:
    """The row with its measured steps, their median step time and the tokens/s that gives."""
    row["measured"] = measured
    row["step_time_s"] = statistics.median(measured)
    row["tokens_per_s"] = row["batch"] * row["seq"] * row["world"] / row["step_time_s"]
    return row


def case_flags(c: dict, device: str, run_dir: Path) -> list[str]:
    """The trainer flags of a case (the peers read the same configuration)."""
    return ["--preset", c["preset"], "--seq-len", str(c["seq"]), "--train-batch-size", str(c["batch"]),
            "--max-steps", str(c["steps"] + c["warmup"]), "--mixed-precision", c["dtype"], "--device", device,
            "--logging-freq", "1", "--validation-freq", "0", "--validation-batches", "1", "--tensorboard", "0",
            "--progress", "off", "--run-dir", str(run_dir), *OFFLINE_DATA, *c["flags"]]


def set_up(c: dict, device: str, run_dir: Path) -> None:
    """Everything a case does before its first step that could reach the network: its
    configuration, its data and tokenizer and first batch, a peer's transformers config."""
    from benchmarks import reference_baseline
    from fsdpkit.train.config import parse_args
    from fsdpkit.train.runtime.dist import Runtime

    cfg = parse_args(case_flags(c, device, run_dir))
    next(reference_baseline.batches(cfg, Runtime(0, c["world"], 0, c["world"], torch.device("cpu"))))
    if c["impl"] != "fsdpkit":
        reference_baseline.hf_config(cfg)


def worker(c: dict, out: Path, device: str) -> None:
    """Runs inside the case's process: train, then write this rank's step times and peak memory."""
    from fsdpkit.report.runs import load_run
    from fsdpkit.train.config import parse_args
    from fsdpkit.train.observe.metrics import peak_memory_bytes, reset_peak_memory, resident_bytes
    from fsdpkit.train.runtime import dist

    rank = int(os.environ.get("RANK", 0))
    dev = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if device == "cuda" else torch.device("cpu")
    cfg = parse_args(case_flags(c, device, out / "run"))
    # Everything either trainer imports is loaded before the memory baseline is taken, so the figure
    # is what training itself holds (the model, optimizer state, activations, buffers).
    from benchmarks import reference_baseline
    from fsdpkit.train.trainer import train

    if c["impl"] != "fsdpkit":
        rt = dist.setup(device)
    before = resident_bytes()
    reset_peak_memory(dev)
    if c["impl"] == "baseline":
        dtype = torch.bfloat16 if c["dtype"] == "bf16" else torch.float32
        try:
            times = reference_baseline.train_steps(cfg, rt, dtype, c["steps"] + c["warmup"])
        finally:
            dist.teardown()
    elif c["impl"] == "transformers":
        times = reference_baseline.train_steps_compiled(cfg, rt, c["weights"], c["steps"] + c["warmup"],
                                                        c["compile"])
    else:
        train(cfg)
        times = [r["step_time_s"] for r in load_run(out / "run").train] if rank == 0 else []
    peak = peak_memory_bytes(dev) - (before if device == "cpu" else 0)
    (out / f"rank{rank}.json").write_text(json.dumps({"step_times": times, "peak_memory_bytes": peak}))


# --- the run -----------------------------------------------------------------------------------------
def measured_peak(device: str, dtype: str, seconds: float = 1.0) -> tuple[float | None, str]:
    """The MFU denominator: a GPU's datasheet peak; a CPU's best of three GEMM runs of `seconds` each
    (the smoke's are short: its MFU is shown to be computed, not measured to a percent)."""
    from fsdpkit.train.observe.metrics import gpu_peak_flops, measure_cpu_peak_flops

    torch_dtype = torch.bfloat16 if dtype == "bf16" else torch.float32
    if device == "cuda":
        return gpu_peak_flops(torch.device("cuda"), torch_dtype), "datasheet"
    torch.set_num_threads(os.cpu_count() or 1)
    return max(measure_cpu_peak_flops(torch_dtype, seconds=seconds) for _ in range(3)), "measured GEMM, all cores"


def add_mfu(row: dict, peak: float | None) -> None:
    """MFU from the shape the case trained: its whole flag list read by the trainer's own parser, so
    a `--n-layers` or `--sliding-window` of the case counts as it did in the run."""
    from fsdpkit.train.config import parse_args
    from fsdpkit.train.model.flops import flops_per_token

    shape = parse_args(case_flags(row, row.get("device") or "cpu", Path("unused"))).shape
    row["flops_per_token"] = flops_per_token(shape, row["seq"])
    # Per device on a GPU; on a CPU the ranks share one machine, whose GEMM rate is the denominator.
    per = row["world"] if row.get("device") == "cuda" else 1
    row["mfu"] = row["flops_per_token"] * row["tokens_per_s"] / per / peak if peak else None


def case_key(r: dict) -> str:
    return json.dumps({k: r[k] for k in ("section", "impl", "label", "preset", "seq", "batch", "world", "flags")})


def merge_rounds(rows: list[dict]) -> list[dict]:
    """One row per case: the measured steps of every round pooled, their median taken again."""
    merged: dict[str, dict] = {}
    for r in rows:
        key = case_key(r)
        if key in merged:
            m = merged[key]
            m["peak_memory_bytes"] = max(m["peak_memory_bytes"], r["peak_memory_bytes"])
            timed(m, m["measured"] + r["measured"])
        else:
            merged[key] = {k: v for k, v in r.items() if k != "round"}  # the pooled row is no one round
    return list(merged.values())


def baseline_pairs(rows: list[dict]) -> list[tuple[dict, dict]]:
    """Each compared fsdpkit row with the baseline row of the same preset, sequence, batch, ranks, dtype."""
    key = lambda r: (r["preset"], r["seq"], r["batch"], r["world"], r["dtype"])  # noqa: E731
    base = {key(r): r for r in rows if r["impl"] == "baseline"}
    return [(r, b) for r in rows
            if r["impl"] == "fsdpkit" and r["section"] in ("compare", "gpu") and (b := base.get(key(r)))]


def per_round_speedups(raw: list[dict], merged: list[dict]) -> None:
    """Set each compared fsdpkit row's `speedup_per_round`: each round's run over its baseline's run
    of the same round (a round where either failed has no ratio).

    Rounds run interleaved, so a slow spell of a shared machine falls on both runs of a round; the
    spread of these ratios shows how far a single run can be trusted (on a noisy 2-core VM it was
    1.19-1.35x around a pooled 1.28x)."""
    tokens = {(case_key(r), r.get("round", 0)): r["tokens_per_s"] for r in raw}
    for f, b in baseline_pairs(merged):
        kf, kb = case_key(f), case_key(b)
        f["speedup_per_round"] = [t / tokens[kb, k] for (key, k), t in tokens.items()
                                  if key == kf and (kb, k) in tokens]


def speedup_text(f: dict, b: dict) -> str:
    """'1.28x', with the range over rounds when there was more than one: '1.28x (rounds 1.19-1.35x)'."""
    text = f"{f['tokens_per_s'] / b['tokens_per_s']:.2f}x"
    rounds = f.get("speedup_per_round", [])
    return text + (f" (rounds {min(rounds):.2f}-{max(rounds):.2f}x)" if len(rounds) > 1 else "")


def peer_pairs(rows: list[dict]) -> list[tuple[dict, dict]]:
    """Each compiled transformers row with fsdpkit's one-process row of the same preset, sequence and
    batch: its defaults where measured, else the first such row."""
    pairs = []
    for p in (r for r in rows if r["impl"] == "transformers"):
        mine = [r for r in rows if r["impl"] == "fsdpkit" and r["world"] == 1 and not r.get("fsdp")
                and (r["preset"], r["seq"], r["batch"]) == (p["preset"], p["seq"], p["batch"])]
        mine.sort(key=lambda r: r["label"] not in ("defaults", "compile"))
        if mine:
            pairs.append((mine[0], p))
    return pairs


def peer_ratios(rows: list[dict]) -> list[dict]:
    return [{"fsdpkit": f["label"], "peer": p["label"], "preset": f["preset"], "seq": f["seq"], "batch": f["batch"],
             "speedup": f["tokens_per_s"] / p["tokens_per_s"],
             "memory_ratio": f["peak_memory_bytes"] / p["peak_memory_bytes"]} for f, p in peer_pairs(rows)]


def ratios(rows: list[dict]) -> list[dict]:
    """fsdpkit (each compared configuration) over the baseline of the same preset, size and ranks."""
    return [{"fsdpkit": f["label"], "preset": f["preset"], "seq": f["seq"], "batch": f["batch"], "world": f["world"],
             "dtype": f["dtype"], "speedup": f["tokens_per_s"] / b["tokens_per_s"],
             "speedup_per_round": f.get("speedup_per_round", []), "text": speedup_text(f, b),
             "memory_ratio": f["peak_memory_bytes"] / b["peak_memory_bytes"]} for f, b in baseline_pairs(rows)]


def main(argv: list[str] | None = None) -> int:
    parser = arguments(__doc__, "train_throughput.json", "tiny sizes, seconds (CI)")
    parser.add_argument("--only", default=",".join(SECTIONS), help=f"sections to run, of: {', '.join(SECTIONS)}")
    parser.add_argument("--dtype", choices=("auto", "bf16", "fp32"), default="auto",
                        help="precision for both trainers (auto: bf16 on GPUs and on CPUs where it is measured faster)")
    parser.add_argument("--rounds", type=int, default=2, help="times the compare cases run, interleaved")
    parser.add_argument("--select", help="only these cases, as IMPL:LABEL:SEQxBATCH, comma-separated")
    parser.add_argument("--case-timeout", type=float, default=None, help="seconds before a case is stopped")
    parser.add_argument("--from-json", type=Path, help="append the rows of an earlier run's JSON to RESULTS.md")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--worker-out", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    parser.add_argument("--dry-run", action="store_true",
                        help="set up every case (configuration, data, first batch) without training; "
                             "with --only gpu, the GPU cases also where there is no GPU")
    args = parser.parse_args(argv)
    device = ("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device
    if args.worker:
        worker(json.loads(args.worker), args.worker_out, device)
        return 0
    if args.from_json:  # e.g. a run made on a lent GPU, whose checkout is gone
        result = json.loads(args.from_json.read_text())
        for row in result["rows"]:  # this checkout's FLOP count, for a run whose own had a fault
            add_mfu(row, result["peak_flops"])
        write_results_md(result)
        return 0
    if args.dry_run:
        return dry_run(args, device)
    dtype = args.dtype
    seconds = 0.1 if args.smoke else 1.0
    if dtype == "auto" and device == "cpu":
        # bf16 only where this CPU multiplies it faster than fp32 (an AVX512-BF16 flag is no promise):
        # both trainers then run at the precision that is fast here, and its rate is the MFU peak.
        rates = {d: measured_peak(device, d, seconds) for d in ("bf16", "fp32")}
        dtype = "bf16" if rates["bf16"][0] > rates["fp32"][0] else "fp32"
        print(f"precision: {dtype} (bf16 matmuls at {rates['bf16'][0] / rates['fp32'][0]:.2f}x the fp32 rate "
              "on this CPU)", flush=True)
        peak, peak_source = rates[dtype]
    else:
        dtype = "bf16" if dtype == "auto" else dtype
        peak, peak_source = measured_peak(device, dtype, seconds)
    rows, failed = [], []
    cases = selected(parser, args, plan(args.smoke, device, dtype, set(args.only.split(","))))
    # Rounds interleave the compared cases, so a slow spell of a shared machine hits all of them.
    rounds = 1 if args.smoke else args.rounds
    cases = [{**c, "round": k} for k in range(rounds) for c in cases if k == 0 or c["section"] == "compare"]
    with tempfile.TemporaryDirectory() as d:
        for c in cases:
            print(f"[{c['section']}] {c['impl']:8} {c['label']:44} {c['preset']} seq {c['seq']} x {c['batch']} "
                  f"world {c['world']} {c['dtype']} ...", end="", flush=True)
            try:
                row = run_case(c, Path(d), device, args.case_timeout)
            except CaseFailed as e:
                # One broken or hung case must not lose the others' figures (a lent GPU is minutes).
                print(f" FAILED\n{e}", flush=True)
                failed.append({**c, "error": str(e)[-4000:]})
                continue
            row["device"] = device
            add_mfu(row, peak)
            mfu = f"{100 * row['mfu']:.1f}%" if row["mfu"] is not None else "n/a"
            print(f" {row['tokens_per_s']:,.0f} tok/s, {row['step_time_s'] * 1000:.0f} ms/step, MFU {mfu}, "
                  f"{row['peak_memory_bytes'] / 2**20:,.0f} MiB", flush=True)
            rows.append(row)
            # Written after every case: a run cut off (a lease running out) keeps what it measured.
            result = summarise(rows, failed, args.smoke, device, dtype, peak, peak_source)
            write_json(args.out, result)
    result = summarise(rows, failed, args.smoke, device, dtype, peak, peak_source)
    write_json(args.out, result)
    for r in result["ratios"]:
        print(f"{r['fsdpkit']} / baseline: {r['preset']} seq {r['seq']} world {r['world']} {r['dtype']}: "
              f"{r['text']} tokens/s, {r['memory_ratio']:.2f}x peak memory")
    for r in result["peer_ratios"]:
        print(f"{r['fsdpkit']} / {r['peer']}: {r['preset']} seq {r['seq']} x {r['batch']}: "
              f"{r['speedup']:.2f}x tokens/s, {r['memory_ratio']:.2f}x peak memory")
    if not args.no_results_md and not args.smoke:
        write_results_md(result)
    return 1 if failed else 0


def selected(parser: argparse.ArgumentParser, args: argparse.Namespace, cases: list[dict]) -> list[dict]:
    """The cases --select names, in the order given (on a lent GPU, the most wanted first)."""
    if not args.select:
        return cases
    by_key = {f"{c['impl']}:{c['label']}:{c['seq']}x{c['batch']}": c for c in cases}
    unknown = [k for k in args.select.split(",") if k not in by_key]
    if unknown:
        parser.error(f"--select: no such case {unknown[0]!r}; cases: {', '.join(by_key)}")
    return [by_key[k] for k in args.select.split(",")]


def dry_run(args: argparse.Namespace, device: str) -> int:
    """Set up each case in this process, as its worker would on `device` (the GPU plan's device
    for --only gpu)."""
    only = set(args.only.split(","))
    if only == {"gpu"}:
        device = "cuda"
    dtype = "bf16" if args.dtype == "auto" else args.dtype
    cases = selected(argparse.ArgumentParser(), args, plan(args.smoke, device, dtype, only))
    with tempfile.TemporaryDirectory() as d:
        for c in cases:
            set_up(c, device, Path(d) / "run")
            print(f"[{c['section']}] {c['impl']:12} {c['label']:44} {c['preset']} seq {c['seq']} x {c['batch']}: "
                  "set up", flush=True)
    print(f"{len(cases)} cases set up")
    return 0


def summarise(rows: list[dict], failed: list[dict], smoke: bool, device: str, dtype: str, peak: float | None,
              peak_source: str) -> dict:
    raw, rows = rows, merge_rounds(rows)
    per_round_speedups(raw, rows)
    for row in rows:
        add_mfu(row, peak)
    return {"env": environment(), "smoke": smoke, "device": device, "dtype": dtype, "peak_flops": peak,
            "peak_flops_source": peak_source, "rows": rows, "ratios": ratios(rows), "peer_ratios": peer_ratios(rows),
            "failed": failed}


def case_name(r: dict) -> str:
    """A row's case as the results table names it: fsdpkit's by its label, another's prefixed."""
    return r["label"] if r["impl"] == "fsdpkit" else f"{r['impl']}: {r['label']}"


def write_results_md(result: dict) -> None:
    env, rows = result["env"], result["rows"]
    peak = f"{result['peak_flops'] / 1e12:.3f}" if result["peak_flops"] else "n/a"

    def fmt(r: dict) -> list:
        mfu = f"{100 * r['mfu']:.1f}%" if r["mfu"] is not None else "n/a"
        return [f"{r['tokens_per_s']:,.0f}", f"{r['step_time_s'] * 1000:,.0f}", mfu,
                f"{r['peak_memory_bytes'] / 2**20:,.0f}"]

    head = ["date", "device", "torch", "peak TFLOP/s"]
    base_cols = [env["date"], env["device"], env["torch"], peak]
    pairs = baseline_pairs(rows)
    if pairs:
        append_rows("Training throughput: fsdpkit vs the reference baseline",
                    [*head, "preset", "seq x batch", "ranks", "dtype", "fsdpkit", "fsdpkit tok/s", "baseline tok/s",
                     "speedup", "fsdpkit MFU", "baseline MFU", "fsdpkit MiB", "baseline MiB", "commit"],
                    [[*base_cols, b["preset"], f"{b['seq']} x {b['batch']}", b["world"], b["dtype"], f["label"],
                                  fmt(f)[0], fmt(b)[0], speedup_text(f, b), fmt(f)[2],
                                  fmt(b)[2], fmt(f)[3], fmt(b)[3], env["commit"]] for f, b in pairs])
    peers = peer_pairs(rows)
    if peers:
        append_rows("Training throughput: fsdpkit vs transformers + torch.compile, one process",
                    [*head, "preset", "seq x batch", "dtype", "fsdpkit", "peer", "fsdpkit tok/s", "peer tok/s",
                     "speedup", "fsdpkit MiB", "peer MiB", "commit"],
                    [[*base_cols, f["preset"], f"{f['seq']} x {f['batch']}", f["dtype"], f["label"], p["label"],
                      fmt(f)[0], fmt(p)[0], f"{f['tokens_per_s'] / p['tokens_per_s']:.2f}x", fmt(f)[3], fmt(p)[3],
                      env["commit"]] for f, p in peers])
    # Every row without a partner beside it: fsdpkit's curve, switches and GPU-only cases, and a
    # baseline or peer measured in a later lease than the fsdpkit row it is read against (its case
    # named with its implementation, so it is not taken for fsdpkit's).
    paired = {id(r) for pair in (*pairs, *peers) for r in pair}
    other = [r for r in rows if id(r) not in paired]
    if other:
        append_rows("fsdpkit: cost curve, switches and GPU runs",
                    [*head, "section", "case", "preset", "seq x batch", "ranks", "dtype", "tok/s", "ms/step", "MFU",
                     "peak MiB", "commit"],
                    [[*base_cols, r["section"], case_name(r), r["preset"], f"{r['seq']} x {r['batch']}", r["world"],
                             r["dtype"], *fmt(r), env["commit"]] for r in other])


if __name__ == "__main__":
    raise SystemExit(main())
