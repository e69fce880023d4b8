"""Where fsdpkit keeps state on the user's machine: FSDPKIT_HOME, default ~/.fsdpkit (local jobs,
deploy progress, the digests of pushed images)."""

from __future__ import annotations

import os
from pathlib import Path

from fsdpkit.errors import UserError


def home() -> Path:
    return Path(os.environ.get("FSDPKIT_HOME") or Path.home() / ".fsdpkit")


def jobs_home() -> Path:
    """Where local jobs keep their state and, without a shared path, their outputs."""
    return home() / "jobs"


def make_dir(path: Path) -> Path:
    """Create a directory under FSDPKIT_HOME; one that cannot be made is one line saying where."""
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise UserError(f"FSDPKIT_HOME: cannot create {path} ({e.strerror}); set FSDPKIT_HOME to a writable "
                        "directory") from None
    return path
