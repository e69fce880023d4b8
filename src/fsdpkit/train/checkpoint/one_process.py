"""DCP's calls made in one process on purpose: export, and the saves and loads of a run without a
process group. DCP warns that it assumes one process there; that is the intent, so the warning is
dropped around those calls only (not for the whole interpreter, where it could mean a mistake)."""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator

ASSUMED_ONE_PROCESS = "torch.distributed is disabled, unavailable or uninitialized"


@contextlib.contextmanager
def one_process() -> Iterator[None]:
    """DCP's warning that it runs in one process, dropped within this block."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=ASSUMED_ONE_PROCESS)
        yield
