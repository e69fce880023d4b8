"""docs/eks.md as one path: each step's commands find installed what an earlier step installs. The
page is walked in order; its `cluster addons install` lines are run as written with `--dry-run`
(the CLI's own list of what it would install), and each later command that needs an operator
(the NCCL check's MPIJob, a job spec's backend) is held to that list."""

from __future__ import annotations

import json

import yaml
from doc_commands import command_lines, tokens

from conftest import ROOT, run_cli

GUIDE = ROOT / "docs" / "eks.md"
# The operator each job backend's manifests are served by (`cluster addons install --only` names).
OPERATOR_OF = {"trainjob": "trainer", "pytorchjob": "training-operator", "ray": "kuberay"}


def test_each_step_of_the_eks_guide_finds_what_an_earlier_step_installed():
    installed: set[str] = set()
    needed = []
    for line in command_lines(GUIDE):
        argv = tokens(line)[1:]
        if argv[:3] == ["cluster", "addons", "install"]:
            r = run_cli(*argv, "--dry-run", "--json")
            assert r.returncode == 0, r.stderr
            installed |= {s["component"] for s in json.loads(r.stdout)["data"]["steps"]}
        elif argv[:3] == ["cluster", "validate", "nccl"]:
            needed.append(("mpi", line))
        elif argv[:1] == ["deploy"] or argv[:2] in (["job", "submit"], ["job", "render"]):
            spec = yaml.safe_load((ROOT / next(a for a in argv if a.endswith(".yaml"))).read_text())
            needed.append((OPERATOR_OF[spec["backend"]], line))
        else:
            continue
        missing = [(op, cmd) for op, cmd in needed if op not in installed]
        assert not missing, f"docs/eks.md runs {missing} before installing that operator"
    assert {op for op, _ in needed} == {"mpi", "training-operator"}  # the walk reached both steps
