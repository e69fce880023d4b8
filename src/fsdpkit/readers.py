"""The one boundary every file fsdpkit reads passes: a decode or format error becomes one line
that names the file and what is wrong with it (exit 2), never a traceback.

Readers of user files (datasets, token shards, tokenizers, Hugging Face configs and weights,
checkpoint metadata, kubeconfigs) wrap their reading in `reading(path, what)`. Whatever a decoder
raises on damaged bytes (zlib, zstd, pyarrow, safetensors, tokenizers, json, yaml, a short read)
is the file's fault, not fsdpkit's; the error's type is kept in the message, so a bug in a reader
can still be told from a damaged file.
"""

from __future__ import annotations

import errno
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from fsdpkit.errors import UserError

_OS = {errno.EACCES: "permission denied", errno.EPERM: "permission denied", errno.EISDIR: "it is a directory",
       errno.ENOTDIR: "a part of the path is not a directory", errno.ENOENT: "it does not exist"}


def reason(e: BaseException) -> str:
    """What a reader said, in one line."""
    if isinstance(e, OSError) and e.errno in _OS:
        return _OS[e.errno]
    if isinstance(e, UnicodeDecodeError):
        return f"not text (not UTF-8 at byte {e.start})"
    text = str(e).strip().splitlines()[0] if str(e).strip() else ""
    return f"{type(e).__name__}: {text}" if text else type(e).__name__


@contextmanager
def reading(path: str | Path, what: str) -> Iterator[None]:
    """Turn any error raised while reading `path` into a one-line UserError: '<what>: cannot read
    <path>: <reason>'. A UserError raised inside (already a message for the user) passes as is;
    so does MemoryError, which is no fault of the file."""
    try:
        yield
    except (UserError, MemoryError):
        raise
    except Exception as e:  # any decoder's own error type: the file is damaged or not what it claims
        raise UserError(f"{what}: cannot read {path}: {reason(e)}; check the file, or point at another one") \
            from None
