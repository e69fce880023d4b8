"""The suite's own selection (tests/torch_pass.py): a test written without a marker that imports torch
or starts the training program is collected by CI's newest-torch pass (`pytest -m torch`); one that
does neither is not."""

from __future__ import annotations

import ast
import subprocess
import sys
import textwrap

import pytest

from fsdpkit.cli.main import VERBS

import torch_pass
from conftest import ROOT, copy_of_the_suite

# A module whose top-level import loads torch: every test in it.
TOP_LEVEL = """
import torch


def test_top_level_import():
    assert torch.ones(1)
"""

# No torch at its top level: each test on what it reaches.
CASES = '''
import subprocess
import sys

import pytest
import yaml

from conftest import cli_here, run_cli


def test_no_torch():
    assert yaml.safe_load("a: 1") == {"a": 1}


def test_renders_a_job_whose_spec_has_a_train_section(tmp_path):
    spec = {"name": "j", "backend": "pytorchjob", "train": {"preset": "tiny"}}
    (tmp_path / "j.yaml").write_text(yaml.safe_dump(spec))
    cli_here("job", "render", str(tmp_path / "j.yaml"))


def test_imports_the_config_which_loads_no_torch():
    from fsdpkit.train.config import parse_args
    assert parse_args


def test_imports_transformers_inside():
    import transformers
    assert transformers


def test_imports_a_training_module_that_loads_torch():
    from fsdpkit.train.data import get_source
    assert get_source


def test_trains_through_run_cli(tmp_path):
    run_cli("train", "--max_steps", "1", "--run_dir", str(tmp_path))


def test_exports_in_a_process(tmp_path):
    subprocess.run([sys.executable, "-m", "fsdpkit", "export", str(tmp_path), str(tmp_path / "hf")])


def _evaluate(path):
    return run_cli("eval", str(path))


def test_through_a_helper_of_the_module(tmp_path):
    _evaluate(tmp_path)


@pytest.fixture
def trained(tmp_path):
    run_cli("train", "--max_steps", "1", "--run_dir", str(tmp_path))
    return tmp_path


def test_through_a_fixture(trained):
    assert trained


@pytest.mark.parametrize("argv", [["train", "--max_steps", "1"], ["plan", "--preset", "tiny"]],
                         ids=["train", "plan"])
def test_per_case(argv):
    cli_here(*argv)


def test_submits_a_local_job(tmp_path):
    spec = {"name": "j", "backend": "local", "procs_per_node": 2}
    (tmp_path / "j.yaml").write_text(yaml.safe_dump(spec))
    run_cli("job", "submit", str(tmp_path / "j.yaml"))


def test_runs_a_benchmark():
    subprocess.run([sys.executable, "-m", "benchmarks.train_throughput", "--smoke"])


def test_runs_a_torch_worker_script():
    subprocess.run(["torchrun", "--nproc-per-node", "2", "tests/train/model/context_worker.py"])


def test_the_readme_s_command():
    subprocess.run(["bash", "-c", "make run RUN_ARGS='--max-steps 5'"])
'''

EXPECTED_TORCH = {
    "test_probe_top.py::test_top_level_import",
    "test_probe_cases.py::test_imports_transformers_inside",
    "test_probe_cases.py::test_imports_a_training_module_that_loads_torch",
    "test_probe_cases.py::test_trains_through_run_cli",
    "test_probe_cases.py::test_exports_in_a_process",
    "test_probe_cases.py::test_through_a_helper_of_the_module",
    "test_probe_cases.py::test_through_a_fixture",
    "test_probe_cases.py::test_per_case[train]",
    "test_probe_cases.py::test_submits_a_local_job",
    "test_probe_cases.py::test_runs_a_benchmark",
    "test_probe_cases.py::test_runs_a_torch_worker_script",
    "test_probe_cases.py::test_the_readme_s_command",
}
EXPECTED_OTHERS = {
    "test_probe_cases.py::test_no_torch",
    "test_probe_cases.py::test_renders_a_job_whose_spec_has_a_train_section",
    "test_probe_cases.py::test_imports_the_config_which_loads_no_torch",
    "test_probe_cases.py::test_per_case[plan]",
}


def collected(folder, marker: str, root=ROOT) -> set[str]:
    r = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", "-m", marker,
                        str(folder)], cwd=root, capture_output=True, text=True, timeout=120)
    assert r.returncode in (0, 5), r.stdout[-3000:] + r.stderr[-3000:]
    return {line.split("/")[-1] for line in r.stdout.splitlines() if "::" in line}


@pytest.fixture
def probe(tmp_path):
    """Test modules written as a newcomer would, with no marker, in a copy of the suite (its pytest
    settings, conftest.py and helpers apply): (the copy, the folder)."""
    copy_of_the_suite(tmp_path)
    folder = tmp_path / "tests" / "probe"
    folder.mkdir()
    (folder / "test_probe_top.py").write_text(textwrap.dedent(TOP_LEVEL))
    (folder / "test_probe_cases.py").write_text(textwrap.dedent(CASES))
    return tmp_path, folder


def test_the_newest_torch_pass_collects_what_imports_torch_or_trains_and_nothing_else(probe):
    root, folder = probe
    assert collected(folder, "torch", root) == EXPECTED_TORCH
    assert collected(folder, "not torch", root) == EXPECTED_OTHERS


def test_the_training_verbs_are_the_cli_s_verbs_whose_command_imports_torch():
    """TORCH_VERBS against the CLI's own table: a verb whose module imports, at any depth of its
    functions, a module that loads torch (the training program's modules, transformers, ...)."""
    def imports_torch(module: str) -> bool:
        path = torch_pass._fsdpkit_path(module)
        assert path is not None, module
        package = module.rpartition(".")[0]
        return any(torch_pass.module_loads_torch(name) for node in ast.walk(ast.parse(path.read_text()))
                   for name in torch_pass._imported(node, package))

    derived = {verb for verb, (target, _) in VERBS.items() if imports_torch(target.partition(":")[0])}
    assert derived == torch_pass.TORCH_VERBS


def test_a_cloud_module_s_tests_stay_out_of_the_newest_pass_and_a_training_module_s_are_in():
    """The split on the suite itself: the job spec's rules run once; the trainer's runs twice."""
    torch_ids = collected(ROOT / "tests" / "jobs" / "test_spec.py", "torch")
    assert torch_ids == set()
    assert collected(ROOT / "tests" / "train" / "test_optim.py", "not torch") == set()
