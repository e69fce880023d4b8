"""Each training component is built from its own slice of the config (torchtitan's rule): only the
config itself and the orchestrators that hand the slices out see the whole TrainConfig."""

from __future__ import annotations

import ast

from conftest import ROOT

TRAIN = ROOT / "src" / "fsdpkit" / "train"
# The config, and the orchestrators that hand out its slices (the training loop, the launcher).
WHOLE = {"config.py", "trainer.py", "launch.py"}


def test_no_component_takes_the_whole_train_config():
    taking = []
    for path in sorted(TRAIN.rglob("*.py")):
        if path.name in WHOLE and path.parent == TRAIN:
            continue
        tree = ast.parse(path.read_text())
        names = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)} | {
            a.name for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) for a in n.names}
        annotations = {ast.unparse(n.annotation) for n in ast.walk(tree) if isinstance(n, ast.arg) and n.annotation}
        if "TrainConfig" in names or any("TrainConfig" in a for a in annotations):
            taking.append(str(path.relative_to(ROOT)))
    assert not taking, f"these take or import the whole TrainConfig; give them their section: {taking}"
    assert len(list(TRAIN.rglob("*.py"))) > 30   # the walk saw the package
