"""The digests of the images `fsdpkit image push` pushed (FSDPKIT_HOME/images.json), so that a job
submitted with the same tag runs exactly that image: nodes pull a digest once and cannot be left
running an older push of a reused tag."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import cast

from fsdpkit.home import home, make_dir


def _path() -> Path:
    return home() / "images.json"


def _load() -> dict[str, str]:
    try:
        return cast("dict[str, str]", json.loads(_path().read_text()))
    except (OSError, ValueError):
        return {}


def record(image: str, digest: str) -> str:
    """Remember that `image` (REPOSITORY:TAG) was pushed as `digest`; returns REPOSITORY@DIGEST."""
    pinned = f"{image.rsplit(':', 1)[0] if ':' in image.rsplit('/', 1)[-1] else image}@{digest}"
    known = {**_load(), image: pinned}
    path = _path()
    make_dir(path.parent)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(known, indent=2, sort_keys=True) + "\n")
    os.replace(tmp, path)
    return pinned


def pinned(image: str | None) -> str | None:
    """REPOSITORY@DIGEST of the last push of `image`, if this machine pushed it."""
    return _load().get(image) if image and "@" not in image else None
