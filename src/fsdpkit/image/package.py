"""fsdpkit itself, for a user's image: a wheel built from the checkout this fsdpkit runs from, or,
for an installed release, that release from the package index. Either way the image gets the same
fsdpkit that wrote its Dockerfile, installed as a package (never the repository copied in)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
from importlib import metadata
from pathlib import Path
from urllib.parse import unquote, urlparse

from fsdpkit import __version__
from fsdpkit.errors import UserError


def checkout() -> Path | None:
    """The source directory of an editable or local-directory install of fsdpkit, else None."""
    try:
        direct = metadata.distribution("fsdpkit").read_text("direct_url.json")
    except metadata.PackageNotFoundError:
        return None
    url = json.loads(direct).get("url", "") if direct else ""
    path = Path(unquote(urlparse(url).path)) if url.startswith("file://") else None
    return path if path is not None and (path / "pyproject.toml").is_file() else None


# What setuptools reads to build fsdpkit. The wheel is built from a private copy of these: setuptools
# stages into the source tree's build/, which keeps modules deleted since an earlier build (they
# would land in the image) and which two builds at once would share.
_WHEEL_SOURCES = ("pyproject.toml", "README.md", "src")


def build_wheel(src: Path, out: Path) -> Path:
    """pip's wheel of the checkout `src` in `out` (older fsdpkit wheels there removed); its path."""
    out.mkdir(parents=True, exist_ok=True)
    for old in out.glob("fsdpkit-*.whl"):
        old.unlink()
    with tempfile.TemporaryDirectory(prefix="fsdpkit-wheel-") as tmp:
        for name in _WHEEL_SOURCES:
            if (src / name).is_dir():
                shutil.copytree(src / name, Path(tmp) / name,
                                ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
            elif (src / name).is_file():
                shutil.copy2(src / name, Path(tmp) / name)
        r = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(out), tmp],
                           capture_output=True, text=True)
    wheels = sorted(out.glob("fsdpkit-*.whl"))
    if r.returncode != 0 or not wheels:
        last = (r.stderr.strip().splitlines() or ["no wheel written"])[-1]
        raise UserError(f"--fsdpkit wheel: building a wheel of {src} failed ({last}); or use --fsdpkit release")
    return wheels[-1]


def for_image(how: str, project: Path, wheel_dir: str) -> tuple[str, str]:
    """(what pip installs in the image, how it was chosen): a wheel path relative to `project`, or a
    requirement. `how`: wheel, release, or auto (wheel when running from a checkout)."""
    src = checkout()
    if how == "wheel" or (how == "auto" and src is not None):
        if src is None:
            raise UserError("--fsdpkit wheel: this fsdpkit is an installed release, not a checkout; use "
                            "--fsdpkit release")
        wheel = build_wheel(src, project / wheel_dir)
        return f"{wheel_dir}/{wheel.name}", f"wheel built from {src}"
    return f"fsdpkit=={__version__}", f"release {__version__} from the package index"
