"""`fsdpkit data prepare` and `fsdpkit tokenizer train`: offline data preparation."""

from __future__ import annotations

import argparse
import itertools
import logging
from pathlib import Path
from typing import Any

from fsdpkit.cli.output import Parser, dispatch, emit_json
from fsdpkit.effects import Effect, declare
from fsdpkit.envelope import said_once_accepted
from fsdpkit.errors import UserError
from fsdpkit.train.checkpoint import catalog

log = logging.getLogger(__name__)


def _source_args(p: Parser) -> None:
    p.add_argument("--dataset", required=True, help="local file/folder, or a hub dataset (hf:NAME)")
    p.add_training_option("--dataset-config-name", default=None, help="hub dataset configuration")
    p.add_training_option("--text-field", default="text", help="field or column holding the text")
    p.add_training_option("--on-bad-record", choices=["skip", "fail"], default="skip")
    p.add_argument("--json", action="store_true", help="machine-readable output")


def _sources(args: argparse.Namespace, splits: tuple[str, ...]) -> dict[str, Any]:
    from fsdpkit.train.data import get_source

    return {s: get_source(args.dataset, s, 0, args.text_field, args.dataset_config_name, args.on_bad_record)
            for s in splits}


def cmd_prepare(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from fsdpkit.train.data import get_tokenizer
    from fsdpkit.train.data.prepare import prepare

    tok = get_tokenizer(args.tokenizer)
    sources = _sources(args, ("train", "validation"))
    with tqdm(unit="tok", unit_scale=True, desc="tokenising", disable=args.json or None) as bar:
        meta = prepare(sources, tok, Path(args.out), progress=bar.update)
    if args.json:
        return emit_json({"out": args.out, **meta})
    per_split = ", ".join(f"{k}: {v:,}" for k, v in meta["tokens"].items())
    print(f"wrote {sum(meta['tokens'].values()):,} tokens ({per_split}) as {meta['dtype']} to {args.out}; "
          f"train with --dataset {args.out}")
    return 0


def cmd_train_tokenizer(args: argparse.Namespace) -> int:
    from fsdpkit.train.data import train_bpe

    # 256 byte tokens and the end-of-text token are always there; fewer leaves no room for merges.
    if not 258 <= args.vocab_size <= 2**20:
        raise UserError(f"vocab_size: {args.vocab_size} is out of range; a byte-level BPE needs 258..{2**20}")
    if args.max_documents < 0:
        raise UserError(f"max_documents: {args.max_documents} is out of range; it must be >= 0 (0: all)")
    if Path(args.out).is_dir() and catalog.scan(Path(args.out)):
        raise UserError(f"tokenizer train: {args.out} holds checkpoints; choose a new directory for the tokenizer")
    source = _sources(args, ("train",))["train"]
    docs = source.documents(0)
    if args.max_documents:
        docs = itertools.islice(docs, args.max_documents)
    with said_once_accepted():  # the skips are said once a document came, else the error alone
        first = next(docs, None)  # before anything is written: a dataset of bad records only trains nothing
        if first is None:
            bad = getattr(source, "bad_records", 0)
            raise UserError(f"tokenizer train: {args.dataset} gave no usable document"
                            + (f" ({bad} bad record(s) skipped)" if bad else "") + "; check --dataset and --text-field")
    docs = itertools.chain([first], docs)
    out = train_bpe((d if isinstance(d, str) else d.decode("utf-8", "replace") for d in docs),
                    args.vocab_size, Path(args.out))
    from fsdpkit.train.data import HFTokenizer

    tok = HFTokenizer(str(out))
    # BPE stops when the text has no pair left to merge: a small corpus learns fewer tokens than asked.
    short = (f"the text held merges for {tok.vocab_size:,} tokens, not the {args.vocab_size:,} asked (more text "
             f"learns more); train with --vocab-size {tok.vocab_size}") if tok.vocab_size < args.vocab_size else None
    if args.json:
        return emit_json({"out": str(out), "vocab_size": tok.vocab_size, "requested": args.vocab_size,
                          "eos_id": tok.eos_id, "warnings": [short] if short else []})
    if short:
        log.warning(short)
    print(f"trained a byte-level BPE of {tok.vocab_size} tokens into {out}; use --tokenizer {out}")
    return 0


# `data preview`'s options that are the trainer's own, passed to its configuration as given.
PREVIEW_DATA = ("dataset", "data_format", "tokenizer", "chat_template", "text_field", "dataset_config_name")


def cmd_preview(args: argparse.Namespace) -> int:
    from fsdpkit.train.config import parse_args
    from fsdpkit.train.data.pipeline import data_pipeline
    from fsdpkit.train.data.preview import CLOSE, OPEN, as_json, marked, preview

    if not 1 <= args.records <= 100:
        raise UserError(f"records: {args.records} is out of range; preview 1..100 records")
    flags = ["--config", args.config] if args.config else []
    for name in PREVIEW_DATA:
        if getattr(args, name) is not None:
            flags += [f"--{name.replace('_', '-')}", getattr(args, name)]
    if args.data_format == "preference":   # the one objective that reads it, so the configuration accepts it
        flags += ["--objective", "dpo"]
    d = parse_args(flags).data
    split = args.split or d.train_split
    pipe = data_pipeline(d, 0, split, verbose=False)
    records = preview(pipe, args.records)
    tok = pipe.tokenizer
    assert tok is not None   # preview refuses token shards
    if args.json:
        return emit_json({"dataset": d.dataset, "split": split, "data_format": d.data_format, "tokenizer": tok.name,
                          "records": as_json(records, tok)})
    print(f"{d.dataset} ({d.data_format}, split {split}, tokenizer {tok.name}): the tokens that train are between "
          f"{OPEN} and {CLOSE}")
    for r in records:
        for seq in r.sequences:
            print(f"\n{r.where}: {seq.name}, {len(seq.ids)} tokens, {sum(seq.trained)} trained")
            print("".join(f"  {line}\n" for line in marked(seq, tok).split("\n")), end="")
    return 0


def build_parser(prog: str = "fsdpkit data") -> argparse.ArgumentParser:
    parser = Parser(prog=prog, description="Prepare training data offline, and see what a record trains on.")
    sub = parser.add_subparsers(dest="action", required=True)
    if prog.endswith("data"):
        p = sub.add_parser("prepare", help="tokenise a dataset into memory-mapped token shards")
        _source_args(p)
        p.add_argument("--tokenizer", default="bytes", help="'bytes' or a Hugging Face tokenizer (dir or name)")
        p.add_argument("--out", required=True, help="new directory for the shards")
        p.set_defaults(func=cmd_prepare)
        declare(p, Effect.REMOTE | Effect.WRITES | Effect.LONG)   # a hub dataset is downloaded
        p = sub.add_parser("preview", help="the first records as training reads them, each token marked trained or not")
        p.add_argument("--config", help="a run's YAML (as `fsdpkit train --config`): its data settings")
        p.add_training_option("--dataset", default=None, help="as fsdpkit train's (default: the config's, or embedded)")
        p.add_training_option("--data-format", choices=["text", "chat", "preference"], default=None,
                              help="text, chat or preference (default: the config's, or text)")
        p.add_training_option("--tokenizer", default=None, help="as fsdpkit train's (default: the config's)")
        p.add_training_option("--chat-template", default=None, help="'chatml' or a Jinja file (default: the "
                              "tokenizer's own template, else chatml)")
        p.add_training_option("--text-field", default=None, help="field or column holding the text")
        p.add_training_option("--dataset-config-name", default=None, help="hub dataset configuration")
        p.add_argument("--split", default=None, help="the split to read (default: the training split)")
        p.add_argument("--records", type=int, default=1, help="how many records to show, from the first (1..100)")
        p.add_argument("--json", action="store_true", help="machine-readable output: each token's id, text and mask")
        p.set_defaults(func=cmd_preview)
        declare(p, Effect.REMOTE)   # a hub dataset or tokenizer is read
    else:
        p = sub.add_parser("train", help="train a byte-level BPE tokenizer on local text")
        _source_args(p)
        p.add_training_option("--vocab-size", type=int, default=8192, help="vocabulary size")
        p.add_training_option("--max-documents", type=int, default=0, help="use at most this many documents (0: all)")
        p.add_argument("--out", required=True, help="directory for tokenizer.json")
        p.set_defaults(func=cmd_train_tokenizer)
        declare(p, Effect.WRITES | Effect.LONG)
    return parser


def tokenizer_parser() -> argparse.ArgumentParser:
    return build_parser(prog="fsdpkit tokenizer")


def main(argv: list[str]) -> int:
    return dispatch(build_parser(), argv)


def tokenizer_main(argv: list[str]) -> int:
    return dispatch(tokenizer_parser(), argv)
