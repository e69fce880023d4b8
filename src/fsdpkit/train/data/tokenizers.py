"""Tokenizers: the embedded byte-level one, and any Hugging Face tokenizer (local or hub)."""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from fsdpkit.errors import NotFound, Unreachable, UserError
from fsdpkit.readers import reading
from fsdpkit.train.data.hub import hub_endpoint, hub_reachable, quiet_hub

log = logging.getLogger(__name__)


class Tokenizer(Protocol):
    name: str
    vocab_size: int
    eos_id: int
    config: dict[str, Any]      # tokenizer_config.json: special token texts, the chat template
    directory: Path | None      # where its files are, for a local one

    def encode(self, text: str | bytes) -> np.ndarray: ...

    def decode(self, ids: list[int] | np.ndarray, special: bool = False) -> str:
        """The ids' text; `special`: with the special tokens written out, not left out."""
        ...


class ByteTokenizer:
    """UTF-8 bytes as tokens 0..255, plus BOS (256) and EOS (257): needs no vocabulary file."""

    name = "bytes"
    vocab_size = 258
    bos_id = 256
    eos_id = 257

    def __init__(self) -> None:
        self.config: dict[str, Any] = {}   # no tokenizer_config.json: no special token texts, no chat template
        self.directory: Path | None = None

    def encode(self, text: str | bytes) -> np.ndarray:
        raw = text.encode("utf-8") if isinstance(text, str) else text
        return np.frombuffer(raw, dtype=np.uint8).astype(np.uint16)

    def decode(self, ids: list[int] | np.ndarray, special: bool = False) -> str:
        out, raw = [], bytearray()
        for i in map(int, ids):
            if i < 256:
                raw.append(i)
            elif special:   # the bytes so far decoded together, then the token's name
                out += [raw.decode("utf-8", errors="replace"), "<bos>" if i == self.bos_id else "<eos>"]
                raw.clear()
        return "".join([*out, raw.decode("utf-8", errors="replace")])


# End-of-document tokens of the common model families, tried in order when the tokenizer's
# config does not name one.
EOS_CANDIDATES = ("<|end_of_text|>", "<|endoftext|>", "</s>", "<|eot_id|>", "<eos>")


class HFTokenizer:
    """A Hugging Face `tokenizers` tokenizer from a local directory/file or the hub."""

    def __init__(self, spec: str):
        from tokenizers import Tokenizer as RustTokenizer

        self.name = spec
        path = Path(spec)
        config: dict[str, Any] = {}
        self.directory: Path | None = path if path.is_dir() else None
        if path.is_dir():
            if not (path / "tokenizer.json").is_file():
                raise UserError(f"tokenizer: {path} has no tokenizer.json")
            with reading(path / "tokenizer.json", "tokenizer"):
                self.tok = RustTokenizer.from_file(str(path / "tokenizer.json"))
            if (path / "tokenizer_config.json").is_file():
                with reading(path / "tokenizer_config.json", "tokenizer"):
                    config = json.loads((path / "tokenizer_config.json").read_text())
        elif path.is_file():
            with reading(path, "tokenizer"):
                self.tok = RustTokenizer.from_file(str(path))
        elif spec.startswith((".", "/", "~")):
            raise NotFound(f"tokenizer: {spec} not found")
        else:
            if os.environ.get("HF_HUB_OFFLINE") == "1":
                raise UserError(f"tokenizer: {spec!r} is on the Hugging Face hub but HF_HUB_OFFLINE=1; "
                                "point --tokenizer at a local directory with tokenizer.json")
            # One look at the hub's host first: out of reach, the hub client would retry for half a
            # minute before falling back to its cache; the cache is read at once instead.
            from huggingface_hub import hf_hub_download  # the hub client, loaded when a hub name is given

            online = hub_reachable()
            try:
                with quiet_hub():
                    file = hf_hub_download(spec, "tokenizer.json", token=os.environ.get("HF_TOKEN"),
                                           local_files_only=not online)
            except Exception as e:  # network, auth and not-found errors all end the same way
                if not online:
                    raise Unreachable(f"tokenizer: {spec!r} is not in the Hugging Face cache here and the hub "
                                      f"({hub_endpoint()}) cannot be reached; point --tokenizer at a local directory "
                                      "with tokenizer.json, or run once where the hub can be reached") from None
                raise UserError(f"tokenizer: cannot load {spec!r} from the hub: {str(e).splitlines()[0]}") from None
            with reading(Path(file), "tokenizer"):
                self.tok = RustTokenizer.from_file(file)
            config = _hub_tokenizer_config(spec, online)
        self.config = config
        self.vocab_size = self.tok.get_vocab_size(with_added_tokens=True)
        eos = config.get("eos_token")
        if isinstance(eos, dict):
            eos = eos.get("content")
        candidates = [eos] if eos else list(EOS_CANDIDATES)
        ids: list[int] = [i for t in candidates if t and (i := self.tok.token_to_id(t)) is not None]
        if not ids:
            raise UserError(f"tokenizer: {spec!r} has no end-of-text token (looked for {', '.join(candidates)})")
        self.eos_id: int = ids[0]
        bos = config.get("bos_token")
        bos = bos.get("content") if isinstance(bos, dict) else bos
        self.bos_id = self.tok.token_to_id(bos) if bos else None
        self.dtype = np.uint16 if self.vocab_size <= 2**16 else np.uint32

    def encode(self, text: str | bytes) -> np.ndarray:
        if isinstance(text, bytes):
            text = text.decode("utf-8", errors="replace")
        return np.asarray(self.tok.encode(text, add_special_tokens=False).ids, dtype=self.dtype)

    def decode(self, ids: list[int] | np.ndarray, special: bool = False) -> str:
        return self.tok.decode([int(i) for i in ids], skip_special_tokens=not special)


def _hub_tokenizer_config(spec: str, online: bool) -> dict[str, Any]:
    """tokenizer_config.json of a hub tokenizer (its special tokens and chat template), from the
    hub client's cache when this machine has it; {} where the repository has none."""
    from huggingface_hub import hf_hub_download
    from huggingface_hub.errors import EntryNotFoundError

    try:
        with quiet_hub():
            file = hf_hub_download(spec, "tokenizer_config.json", token=os.environ.get("HF_TOKEN"),
                                   local_files_only=not online)
    except EntryNotFoundError:
        return {}
    except Exception as e:  # the tokenizer loaded (from the cache, say): go on without its config
        log.warning(f"tokenizer: {spec!r}'s tokenizer_config.json could not be read ({str(e).splitlines()[0]}); "
                    "its chat template and named end-of-text token are not known")
        return {}
    with reading(Path(file), "tokenizer"):
        loaded = json.loads(Path(file).read_text())
    return loaded if isinstance(loaded, dict) else {}


def get_tokenizer(name: str) -> Tokenizer:
    if name == "bytes":
        return ByteTokenizer()
    return HFTokenizer(name)


def train_bpe(texts: Iterable[str], vocab_size: int, out_dir: Path, eos: str = "<|endoftext|>") -> Path:
    """Train a byte-level BPE on an iterator of texts; writes tokenizer.json and tokenizer_config.json."""
    from tokenizers import Tokenizer as RustTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers

    tok = RustTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[eos],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer)
    out_dir.mkdir(parents=True, exist_ok=True)
    tok.save(str(out_dir / "tokenizer.json"))
    (out_dir / "tokenizer_config.json").write_text(json.dumps({"eos_token": eos}, indent=2) + "\n")
    return out_dir
