"""fsdpkit itself, for a user's image: a wheel of the fsdpkit that runs, built from its checkout, or,
for an installed wheel, packed again from its installed files. Either way the image gets the same
fsdpkit that wrote its Dockerfile, installed as a package (never the repository copied in), whether
or not any package index has that version."""

from __future__ import annotations

import base64
import hashlib
import json
import shutil
import subprocess
import sys
import tempfile
import zipfile
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


# What pip writes about an installation, not part of the package: left out of a wheel packed again.
_INSTALL_RECORDS = ("INSTALLER", "REQUESTED", "direct_url.json", "RECORD")


def pack_installed(out: Path) -> Path:
    """A wheel of the installed fsdpkit made from its own installed files, as its RECORD lists them
    (package, metadata, entry points; scripts and byte code are pip's to make again), in `out`."""
    dist = metadata.distribution("fsdpkit")
    info = f"fsdpkit-{dist.version}.dist-info"
    files = [f for f in dist.files or [] if not f.parts[0].startswith("..") and f.suffix != ".pyc"
             and not (f.parts[0] == info and f.name in _INSTALL_RECORDS)]
    if not any(f.parts[0] == "fsdpkit" for f in files) or not any(f.parts[0] == info and f.name == "WHEEL"
                                                                  for f in files):
        raise UserError("--fsdpkit wheel: the installed fsdpkit lists no package files to pack (an unusual install); "
                        "install fsdpkit from its wheel, or use --fsdpkit release")
    out.mkdir(parents=True, exist_ok=True)
    for old in out.glob("fsdpkit-*.whl"):
        old.unlink()
    wheel = out / f"fsdpkit-{dist.version}-py3-none-any.whl"
    rows = []
    tmp = wheel.with_suffix(".whl.tmp")
    with zipfile.ZipFile(tmp, "w", zipfile.ZIP_DEFLATED) as z:
        for f in sorted(files, key=str):
            data = f.read_binary()
            z.writestr(str(f), data)
            digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
            rows.append(f"{f},sha256={digest},{len(data)}")
        z.writestr(f"{info}/RECORD", "\n".join([*rows, f"{info}/RECORD,,"]) + "\n")
    tmp.replace(wheel)
    return wheel


def for_image(how: str, project: Path, wheel_dir: str) -> tuple[str, str]:
    """(what pip installs in the image, how it was chosen): a wheel path relative to `project`, or a
    requirement. `how`: wheel (the default, auto, is the same) or release (the package index's)."""
    if how == "release":
        return f"fsdpkit=={__version__}", f"release {__version__} from the package index"
    src = checkout()
    if src is not None:
        wheel = build_wheel(src, project / wheel_dir)
        return f"{wheel_dir}/{wheel.name}", f"wheel built from {src}"
    wheel = pack_installed(project / wheel_dir)
    return f"{wheel_dir}/{wheel.name}", f"wheel of the installed fsdpkit {__version__}"
