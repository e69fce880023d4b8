"""Data-loader throughput and checkpoint save/load speed, sync vs async.

    python -m benchmarks.data_and_checkpoint            # full size, appends to benchmarks/RESULTS.md
    python -m benchmarks.data_and_checkpoint --smoke    # seconds; what CI runs

Data: tokens/s one rank's loader delivers (embedded bytes; local jsonl with a BPE tokenizer;
pre-tokenised shards), next to the tokens/s the `debug` model trains at on the same machine.
Checkpoint: seconds and GB/s to save model + AdamW state and to load it, and for async saves how
long training is blocked versus how long the write takes in the background.
"""

from __future__ import annotations

import itertools
import json
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.common import append_rows, arguments, environment, write_json
from fsdpkit.report.runs import load_run
from fsdpkit.train.checkpoint import checkpointer
from fsdpkit.train.config import parse_args
from fsdpkit.train.data import BatchStream, ByteTokenizer, EmbeddedCorpus, HFTokenizer, get_source, train_bpe
from fsdpkit.train.data.prepare import prepare
from fsdpkit.train.model.transformer import Transformer
from fsdpkit.train.optim import build_optimizer
from fsdpkit.train.runtime.dist import Runtime


def loader_tokens_per_s(source, tokenizer, seq_len: int, batch: int, batches: int) -> float:
    stream = iter(BatchStream(source, tokenizer, seq_len, batch, seed=0))
    next(stream)  # the first batch pays for opening files
    start = time.perf_counter()
    for _ in itertools.islice(stream, batches):
        pass
    return batches * batch * seq_len / (time.perf_counter() - start)


def data_bench(tmp: Path, smoke: bool) -> dict:
    seq, batch, batches = (128, 4, 10) if smoke else (512, 16, 200)
    docs = [d.decode("utf-8", "replace") for d in itertools.islice(EmbeddedCorpus("train", 0).documents(0),
                                                                    40 if smoke else 600)]
    jsonl = tmp / "corpus.jsonl"
    jsonl.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    bpe = HFTokenizer(str(train_bpe(iter(docs), 512 if smoke else 4096, tmp / "bpe")))
    shards = tmp / "shards"
    prepare({"train": get_source(str(jsonl), "train", 0)}, bpe, shards)
    rows = {
        "embedded+bytes": loader_tokens_per_s(EmbeddedCorpus("train", 0), ByteTokenizer(), seq, batch, batches),
        "jsonl+bpe": loader_tokens_per_s(get_source(str(jsonl), "train", 0), bpe, seq, batch, batches),
        "token-shards": loader_tokens_per_s(get_source(str(shards), "train", 0), None, seq, batch, batches),
    }
    return {"seq_len": seq, "batch": batch, "batches": batches, "tokens_per_s": rows}


def training_tokens_per_s(tmp: Path, smoke: bool) -> float:
    from fsdpkit.train.trainer import train

    steps = 4 if smoke else 8
    flags = ["--preset", "tiny" if smoke else "debug", "--seq-len", "128" if smoke else "512",
             "--max-steps", str(steps), "--logging-freq", str(steps // 2), "--validation-freq", "0",
             "--validation-batches", "1", "--tensorboard", "0", "--progress", "off", "--run-dir", str(tmp / "run")]
    cfg = parse_args(flags)
    train(cfg)
    return load_run(tmp / "run").train[-1]["tokens_per_s"]  # after warm-up


def checkpoint_bench(tmp: Path, smoke: bool) -> dict:
    cfg = parse_args(["--preset", "debug"] + (["--dim", "64", "--n-layers", "2"] if smoke
                                                  else ["--dim", "768", "--n-layers", "12"]))
    rt = Runtime(0, 1, 0, 1, torch.device("cpu"))
    model = Transformer(cfg.shape, rope_len=64)
    model.init_weights(seed=0)
    opt = build_optimizer(model, cfg.optim)
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    opt.step()  # AdamW state exists, as in a real checkpoint
    meta = {"samples": 0, "model": {}, "preset": "bench"}
    out: dict = {"params": sum(p.numel() for p in model.parameters())}
    for mode in ("sync", "async"):
        ck = checkpointer.Checkpointer(tmp / f"ckpt-{mode}", rt, async_mode=mode == "async")
        start = time.perf_counter()
        path = ck.save(1, model, opt, meta)
        blocked = time.perf_counter() - start
        ck.wait()
        total = time.perf_counter() - start
        size = sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
        out[mode] = {"blocked_s": blocked, "total_s": total, "bytes": size, "gb_per_s": size / total / 1e9}
    info = checkpointer.resolve(str(tmp / "ckpt-sync"))
    start = time.perf_counter()
    state = {"model": model.state_dict()}
    import torch.distributed.checkpoint as dcp

    dcp.load(state, checkpoint_id=str(info.path))
    load_s = time.perf_counter() - start
    out["load"] = {"seconds": load_s, "gb_per_s": out["sync"]["bytes"] / load_s / 1e9}
    return out


def main(argv: list[str] | None = None) -> int:
    parser = arguments(__doc__, "data_checkpoint.json", "tiny sizes, seconds (CI)")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        result = {"env": environment(), "smoke": args.smoke, "data": data_bench(tmp, args.smoke),
                  "training_tokens_per_s": training_tokens_per_s(tmp, args.smoke),
                  "checkpoint": checkpoint_bench(tmp, args.smoke)}
    write_json(args.out, result)
    env, data, ck = result["env"], result["data"]["tokens_per_s"], result["checkpoint"]
    print(json.dumps(result, indent=2))
    if not args.no_results_md:
        append_rows("Data loader (tokens/s, one rank)", ["date", "device", "embedded+bytes", "jsonl+bpe",
                    "token-shards", "training (debug, seq 512)", "commit"],
                    [[env["date"], env["device"], *(f"{data[k]:,.0f}" for k in data),
                      f"{result['training_tokens_per_s']:,.0f}", env["commit"]]])
        append_rows("Checkpoint (model + AdamW, one process)", ["date", "device", "params", "size MB",
                    "sync save s", "async blocked s", "async total s", "save GB/s", "load s", "load GB/s", "commit"],
                    [[env["date"], env["device"], f"{ck['params'] / 1e6:.1f}M", f"{ck['sync']['bytes'] / 1e6:.0f}",
                      f"{ck['sync']['total_s']:.2f}", f"{ck['async']['blocked_s']:.2f}",
                      f"{ck['async']['total_s']:.2f}", f"{ck['sync']['gb_per_s']:.2f}", f"{ck['load']['seconds']:.2f}",
                      f"{ck['load']['gb_per_s']:.2f}", env["commit"]]])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
