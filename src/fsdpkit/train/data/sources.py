"""Where documents come from: the embedded corpus, local files, the Hugging Face hub, token shards.

A source yields the documents of one split in a seeded order per epoch (`documents(epoch)`), or,
for pre-tokenised shards, gives random access to fixed-size blocks (`num_blocks`, `block`), so
that a rank reads only its own blocks.
"""

from __future__ import annotations

import functools
import gzip
import io
import json
import logging
import os
import sysconfig
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from fsdpkit.errors import NotFound, UserError
from fsdpkit.readers import reading
from fsdpkit.train.data.chat import Conversation, conversation_of
from fsdpkit.train.data.preference import PREFERENCE_RECORD, SAME_ANSWERS, Preference, preference_of, teaches
from fsdpkit.train.token_meta import TOKENS_FORMAT

log = logging.getLogger(__name__)


class DocumentSource(Protocol):
    """A split of a dataset as a sequence of documents (texts, or conversations for chat data), in
    a seeded order per epoch."""

    name: str

    def documents(self, epoch: int) -> Iterator[str | bytes | Conversation | Preference]: ...


# What a record of each data format must hold, as a bad one is told.
RECORD_FORMS = {
    "text": "no string field {field!r}",
    "chat": "no `messages` (roles with string contents or an answer's tool calls, one answer at least) and no "
            "prompt/completion pair",
    "preference": PREFERENCE_RECORD,
}
Document = str | Conversation | Preference


def record_of(record: object, where: str, data_format: str, text_field: str) -> Document | None:
    """A record's document as the data format reads it, None if it holds none."""
    if data_format == "chat":
        return conversation_of(record, where)
    if data_format == "preference":
        pair = preference_of(record, where)
        return pair if pair is not None and teaches(pair) else None
    text = record.get(text_field) if isinstance(record, dict) else None
    return text if isinstance(text, str) else None


def _held_out(key: str, one_in: int) -> bool:
    return zlib.crc32(key.encode()) % one_in == 0


def _shuffled(items: list[Any], seed: int, epoch: int) -> list[Any]:
    order = list(items)
    np.random.default_rng([seed, epoch]).shuffle(order)
    return order


@functools.cache
def _python_files(root: Path) -> tuple[str, ...]:
    """The `.py` files under `root`, relative and sorted; installed packages (site-packages,
    dist-packages) are not walked at all: they are not the corpus, and a large environment made the
    walk the slowest part of a short run's start-up. Listed once per process (train, validation and
    the preflight all ask)."""
    found = []
    for here, dirs, names in os.walk(root):
        dirs[:] = [d for d in dirs if d not in ("site-packages", "dist-packages", "__pycache__")]
        found += [os.path.relpath(os.path.join(here, n), root) for n in names if n.endswith(".py")]
    return tuple(sorted(Path(f).as_posix() for f in found))


class EmbeddedCorpus:
    """The Python standard library's `.py` files; one in 50 (by path hash) is held out for validation."""

    name = "embedded"

    def __init__(self, split: str, seed: int, root: Path | None = None):
        self.root = Path(root or sysconfig.get_paths()["stdlib"])
        self.split, self.seed = split, seed
        files = _python_files(self.root)
        held_out = [f for f in files if _held_out(f, 50)]
        self.files = held_out if split != "train" else sorted(set(files) - set(held_out))
        if not self.files:
            raise UserError(f"dataset: the embedded corpus found no Python source files under {self.root}")

    def documents(self, epoch: int) -> Iterator[bytes]:
        order = _shuffled(self.files, self.seed, epoch) if self.split == "train" else self.files
        for rel in order:
            try:
                yield (self.root / rel).read_bytes()
            except OSError:
                continue  # a file removed or unreadable since listing: skip, never stop training


SUFFIXES = (".jsonl", ".json", ".parquet", ".txt")
COMPRESSED = (".gz", ".zst", ".zstd")


def _format(path: Path) -> tuple[str, str | None] | None:
    """(format, compression) of a data file by its name, or None if it is not one."""
    suffixes = [s.lower() for s in path.suffixes]
    compression = suffixes.pop() if suffixes and suffixes[-1] in COMPRESSED else None
    if suffixes and suffixes[-1] in SUFFIXES and not (compression and suffixes[-1] == ".parquet"):
        return suffixes[-1], compression
    return None


def _optional(module: str, path: Path) -> Any:
    """A module of the `data` extra, or a clear error naming what to install."""
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError:
        raise UserError(f"dataset: reading {path.name} needs {module.split('.')[0]}: "
                        "pip install 'fsdpkit[data]'") from None


def _open_text(path: Path, compression: str | None) -> io.TextIOBase:
    if compression == ".gz":
        return gzip.open(path, "rt", encoding="utf-8", errors="replace")
    if compression in (".zst", ".zstd"):
        zstandard = _optional("zstandard", path)

        stream = zstandard.ZstdDecompressor().stream_reader(path.open("rb"))
        return io.TextIOWrapper(stream, encoding="utf-8", errors="replace")
    return path.open("r", encoding="utf-8", errors="replace")


class LocalFiles:
    """Local jsonl / json / parquet / txt files (gzip or zstd compressed too), a file or a folder.

    A folder with a subfolder named like the split (`train/`, `validation/`) uses it; otherwise one
    document in 100 (by file and position) is held out as the validation split. A record that is
    not JSON or lacks the text field is skipped and counted (`on_bad_record=skip`) or stops the run
    with its file and line (`fail`). With `data_format="chat"` a record is a conversation
    (fsdpkit.train.data.chat) instead of a text; with "preference", a preference pair
    (fsdpkit.train.data.preference).
    """

    def __init__(self, path: str, split: str, seed: int, text_field: str = "text",
                 on_bad_record: str = "skip", verbose: bool = True, data_format: str = "text"):
        root = Path(path).expanduser()
        if not root.exists():
            raise NotFound(f"dataset: {path} not found")
        self.name, self.seed, self.split, self.text_field = str(path), seed, split, text_field
        self.on_bad_record, self.verbose, self.data_format = on_bad_record, verbose, data_format
        self.hold_out = True
        if root.is_dir():
            if (root / split).is_dir():
                root, self.hold_out = root / split, False
            self.files = sorted(p for p in root.rglob("*") if p.is_file() and _format(p))
            self.base = root
        else:
            if not _format(root):
                raise UserError(f"dataset: {path} is not a .jsonl/.json/.parquet/.txt file (or .gz/.zst of one)")
            self.files, self.base = [root], root.parent
        if not self.files:   # named as looked in: the split's own folder where there is one
            raise UserError(f"dataset: no .jsonl/.json/.parquet/.txt files (or .gz/.zst of them) in {root}")
        if data_format != "text" and (plain := [f for f in self.files if (_format(f) or ("",))[0] == ".txt"]):
            raise UserError(f"dataset: {plain[0]} is plain text; {data_format} data is jsonl/json/parquet records "
                            f"({RECORD_FORMS[data_format].removeprefix('no ')})")
        self._bad_seen: set[str] = set()
        self._same_seen: set[str] = set()   # of them, preference pairs whose answers are the same
        # With a held-out split both splits read every line: the training split alone counts a bad
        # one, so a record is counted once however many splits and passes read it.
        self._counts_bad = not self.hold_out or split == "train"

    @property
    def bad_records(self) -> int:
        """Distinct records skipped as bad so far (each counted once, however often it is re-read)."""
        return len(self._bad_seen)

    @property
    def same_answers(self) -> int:
        """Of the bad records, the preference pairs left out for answers that are the same."""
        return len(self._same_seen)

    def documents(self, epoch: int) -> Iterator[Document]:
        order = _shuffled(self.files, self.seed, epoch) if self.split == "train" else self.files
        for f in order:
            rel = f.relative_to(self.base).as_posix()
            for i, text in enumerate(self._read(f)):
                if self.hold_out and _held_out(f"{rel}:{i}", 100) == (self.split == "train"):
                    continue
                yield text

    def _bad(self, where: str, why: str) -> None:
        if self.on_bad_record == "fail":
            raise UserError(f"dataset: {where}: {why} (use --on-bad-record skip to skip such records)")
        if not self._counts_bad or where in self._bad_seen:
            return
        self._bad_seen.add(where)
        n = len(self._bad_seen)
        if self.verbose and (n & (n - 1)) == 0:  # 1, 2, 4, 8, ... so logs stay short
            log.warning(f"dataset: skipped {n} bad record(s); latest {where}: {why}")

    def _text_of(self, record: object, where: str) -> Document | None:
        """The record's document (text, conversation or preference as the format says); None
        (counted) for a bad one."""
        item = record_of(record, where, self.data_format, self.text_field)
        if item is None:
            pair = preference_of(record, where) if self.data_format == "preference" else None
            if pair is not None:   # a pair, but one that teaches nothing
                if self._counts_bad:
                    self._same_seen.add(where)
                self._bad(where, SAME_ANSWERS)
            else:
                self._bad(where, RECORD_FORMS[self.data_format].format(field=self.text_field))
        return item

    def _read(self, f: Path) -> Iterator[Document]:
        found = _format(f)
        assert found is not None  # the files were listed by their format
        fmt, compression = found
        with reading(f, "dataset"):  # a damaged .gz/.zst/.parquet is one line naming the file
            if fmt == ".parquet":
                yield from self._parquet(f)
                return
            with _open_text(f, compression) as fh:
                if fmt == ".txt":
                    yield fh.read()
                elif fmt == ".jsonl":
                    yield from self._jsonl(f, fh)
                else:
                    yield from self._json(f, fh)

    def _parquet(self, f: Path) -> Iterator[Document]:
        pq = _optional("pyarrow.parquet", f)
        pf = pq.ParquetFile(f)
        if self.data_format != "text":  # whole rows: messages, prompt and completion, a preference
            for b, batch in enumerate(pf.iter_batches(batch_size=1024)):
                for n, row in enumerate(batch.to_pylist()):
                    if (conv := self._text_of(row, f"{f}[{b * 1024 + n}]")) is not None:
                        yield conv
            return
        if self.text_field not in pf.schema_arrow.names:
            raise UserError(f"dataset: {f} has no column {self.text_field!r} (columns: "
                            f"{', '.join(pf.schema_arrow.names)}); set --text-field")
        for batch in pf.iter_batches(columns=[self.text_field], batch_size=1024):
            yield from (t for t in batch.column(0).to_pylist() if isinstance(t, str))

    def _jsonl(self, f: Path, fh: Iterator[str]) -> Iterator[Document]:
        for n, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                self._bad(f"{f}:{n}", "not JSON")
                continue
            text = self._text_of(record, f"{f}:{n}")
            if text is not None:
                yield text

    def _json(self, f: Path, fh: Any) -> Iterator[Document]:
        """A list of records, or {"data": [...]}."""
        try:
            doc = json.load(fh)
        except json.JSONDecodeError as e:
            raise UserError(f"dataset: {f} is not valid JSON: {e}") from None
        records = doc.get("data") if isinstance(doc, dict) else doc
        if not isinstance(records, list):
            raise UserError(f"dataset: {f} must hold a list of records (or {{'data': [...]}})")
        for n, record in enumerate(records):
            text = self._text_of(record, f"{f}[{n}]")
            if text is not None:
                yield text


class HubDataset:
    """A Hugging Face `datasets` dataset, streamed (`--dataset allenai/c4 --dataset-config-name en`).

    Loading is deferred to the first epoch so that checking a configuration does not download.
    HF_TOKEN is passed for gated datasets; it is never logged.
    """

    def __init__(self, name: str, config: str | None, split: str, text_field: str, data_format: str = "text"):
        self.name, self.config, self.split, self.text_field = name, config, split, text_field
        self.data_format = data_format
        if os.environ.get("HF_HUB_OFFLINE") == "1" and not Path(name).exists():
            raise UserError(f"dataset: {name!r} is on the Hugging Face hub but HF_HUB_OFFLINE=1; "
                            "download it first or point --dataset at local files")
        try:
            import datasets  # noqa: F401
        except ImportError:
            raise UserError("dataset: hub datasets need the `datasets` package: pip install 'fsdpkit[data]'") from None

    def documents(self, epoch: int) -> Iterator[Document]:
        import datasets

        try:
            ds = datasets.load_dataset(self.name, self.config, split=self.split, streaming=True,
                                       token=os.environ.get("HF_TOKEN"))
        except Exception as e:  # not found, gated, offline, bad split: all a message for the user
            raise UserError(f"dataset: cannot stream {self.name!r} split {self.split!r}: "
                            f"{str(e).splitlines()[0]}") from None
        if hasattr(ds, "set_epoch"):
            ds.set_epoch(epoch)
        for n, row in enumerate(ds):
            item = record_of(row, f"{self.name} row {n}", self.data_format, self.text_field)
            if item is not None:
                yield item




class TokenShards:
    """Pre-tokenised shards written by `fsdpkit data prepare`: memory-mapped, random access by block."""

    def __init__(self, path: Path, split: str):
        with reading(path / "meta.json", "dataset"):
            meta = json.loads((path / "meta.json").read_text())
        if not isinstance(meta, dict) or meta.get("format") != TOKENS_FORMAT:
            raise UserError(f"dataset: {path}/meta.json is not a {TOKENS_FORMAT} token directory")
        self.name, self.meta = str(path), meta
        split_key = split if split in meta["splits"] else ("validation" if split != "train" else "train")
        if split_key == "train" and split_key not in meta["splits"]:
            raise UserError(f"dataset: {path} has no split {split!r} (has: {', '.join(meta['splits'])})")
        # A small corpus prepares no held-out split: validating on it finds no batch (the trainer
        # says "no validation"), which must not stop training.
        self.arrays = []
        for f in meta["splits"].get(split_key, []):
            with reading(path / f, "dataset"):
                array = np.memmap(path / f, dtype=meta["dtype"], mode="r")
            self.arrays.append(array)
        self.offsets = np.cumsum([0] + [len(a) for a in self.arrays])
        expected = (meta.get("tokens") or {}).get(split_key)
        if expected is not None and self.num_tokens != expected:
            raise UserError(f"dataset: {path}: the {split_key!r} shards hold {self.num_tokens:,} tokens, meta.json "
                            f"says {expected:,} (a shard is truncated or replaced); prepare the data again")

    @property
    def num_tokens(self) -> int:
        return int(self.offsets[-1])

    def num_blocks(self, n: int) -> int:
        return self.num_tokens // n

    def block(self, i: int, n: int) -> np.ndarray:
        """Tokens [i*n, (i+1)*n) of the concatenated shards (a block may span two shards)."""
        start, out, filled = i * n, np.empty(n, dtype=np.int64), 0
        s = int(np.searchsorted(self.offsets, start, side="right")) - 1
        while filled < n:
            a, pos = self.arrays[s], start + filled - int(self.offsets[s])
            take = min(n - filled, len(a) - pos)
            out[filled : filled + take] = a[pos : pos + take]
            filled += take
            s += 1
        return out


def is_local(dataset: str) -> bool:
    return dataset.startswith((".", "/", "~")) or Path(dataset).exists() or bool(_format(Path(dataset)))


def get_source(dataset: str, split: str, seed: int, text_field: str = "text", config: str | None = None,
               on_bad_record: str = "skip", verbose: bool = True,
               data_format: str = "text") -> DocumentSource | TokenShards:
    """`embedded`, a local path (files, folder, or token shards), or a hub dataset (`hf:` forces it).
    Chat data (`data_format="chat"`) is records of conversations, preference data records of preference
    pairs: local files or a hub dataset."""
    records = data_format != "text"
    if dataset == "embedded":
        if records:
            raise UserError(f"dataset: the embedded corpus is plain text; {data_format} fine-tuning needs records "
                            f"({RECORD_FORMS[data_format].removeprefix('no ')}): a local jsonl/json/parquet file, "
                            "or a hub dataset")
        return EmbeddedCorpus("train" if split == "train" else "validation", seed)
    if dataset.startswith("hf:"):
        return HubDataset(dataset[3:], config, split, text_field, data_format)
    if is_local(dataset):
        path = Path(dataset).expanduser()
        if (path / "meta.json").is_file():
            if records:
                raise UserError(f"dataset: {dataset} holds token shards, which keep no turns; {data_format} "
                                "fine-tuning reads the records themselves (jsonl/json/parquet)")
            return TokenShards(path, split)
        return LocalFiles(dataset, split, seed, text_field, on_bad_record, verbose, data_format)
    return HubDataset(dataset, config, split, text_field, data_format)
