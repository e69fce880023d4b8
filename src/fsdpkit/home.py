"""Where fsdpkit keeps state on the user's machine: FSDPKIT_HOME, default ~/.fsdpkit (local jobs,
deploy progress, the digests of pushed images)."""

from __future__ import annotations

import os
from pathlib import Path


def home() -> Path:
    return Path(os.environ.get("FSDPKIT_HOME") or Path.home() / ".fsdpkit")
