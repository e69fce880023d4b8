"""fsdpkit's own wheel for a user's image: built from what the checkout holds now, whatever setuptools
left in its build/ before, and two builds at once each get a whole wheel."""

from __future__ import annotations

import shutil
import zipfile
from concurrent.futures import ThreadPoolExecutor

from fsdpkit.image.package import build_wheel

from conftest import ROOT


def test_the_wheel_holds_the_checkout_as_it_is_and_builds_twice_at_once(tmp_path):
    checkout = tmp_path / "checkout"
    checkout.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(ROOT / name, checkout / name)
    shutil.copytree(ROOT / "src", checkout / "src", ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    # An earlier build staged a module that has since been deleted from the source.
    stale = checkout / "build" / "lib" / "fsdpkit" / "removed_since.py"
    stale.parent.mkdir(parents=True)
    stale.write_text("raise SystemExit('stale')\n")

    with ThreadPoolExecutor(2) as pool:
        wheels = list(pool.map(lambda i: build_wheel(checkout, tmp_path / f"out{i}"), range(2)))
    for wheel in wheels:
        with zipfile.ZipFile(wheel) as z:
            assert z.testzip() is None
            names = set(z.namelist())
        assert "fsdpkit/cli/main.py" in names and "fsdpkit/train/trainer.py" in names
        assert "fsdpkit/removed_since.py" not in names
        assert not any("__pycache__" in n for n in names)
    # Nothing was written into the checkout.
    assert sorted(p.name for p in checkout.iterdir()) == ["README.md", "build", "pyproject.toml", "src"]
    assert not list((checkout / "src").glob("*.egg-info"))
