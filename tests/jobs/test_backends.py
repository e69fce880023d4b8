"""The backend contract: every backend answers the same verbs with the same parameters, and render
gives one typed result the CLI prints without asking which backend made it."""

from __future__ import annotations

import inspect
import json
import shlex

import pytest
import yaml

from fsdpkit.jobs.backends import Backend, Watchable, get_backend
from fsdpkit.jobs.resolved import load_job
from fsdpkit.jobs.spec import BACKENDS, CLUSTER_BACKENDS

from conftest import run_cli

VERBS = [name for name, _ in inspect.getmembers(Backend, inspect.isfunction) if not name.startswith("_")]


@pytest.mark.parametrize("name", BACKENDS)
def test_every_backend_keeps_the_contract(name):
    backend = get_backend(name)
    assert backend.name == name
    for verb in VERBS:
        want = [p for p in inspect.signature(getattr(Backend, verb)).parameters if p != "self"]
        got = list(inspect.signature(getattr(backend, verb)).parameters)
        assert got[:len(want)] == want, (name, verb, got)
    assert isinstance(backend, Watchable) == (name in CLUSTER_BACKENDS)


@pytest.mark.parametrize(("backend", "key"), [("local", "command"), ("slurm", "script"), ("trainjob", "manifests"),
                                              ("pytorchjob", "manifests"), ("hyperpod", "manifests")])
def test_render_is_one_typed_result_printed_the_same_way(backend, key, tmp_path):
    overrides = [("name", "contract"), ("backend", backend), ("train", {"max_steps": 5})]
    if backend in CLUSTER_BACKENDS:
        overrides += [("image", "ghcr.io/x/fsdpkit:1"), ("instance_type", "p5.48xlarge")]
    rendered = get_backend(backend).render(load_job(None, overrides))
    # A Kubernetes render also says which Pod Security level its pods meet, and a TrainJob's the Trainer it needs.
    extra = (["pod_security"] if key == "manifests" else []) + (["needs"] if backend == "trainjob" else [])
    assert rendered.kind == key and list(rendered.as_json()) == [key, *extra]
    args = ["job", "render"] + [arg for k, v in overrides for arg in ("--set", f"{k}={json.dumps(v)}")]
    r = run_cli(*args, "--json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["data"][key] == rendered.as_json()[key]
    text = run_cli(*args).stdout
    assert text == rendered.text()
    if key == "manifests":
        assert list(yaml.safe_load_all(text)) == rendered.manifests


@pytest.mark.parametrize(("backend", "keys"), [("local", ["name", "dry_run", "command", "dir"]),
                                               ("slurm", ["name", "dry_run", "script", "text"])])
def test_a_dry_run_is_one_typed_result_and_says_what_would_start_as_it_would_run(backend, keys, tmp_path,
                                                                                 monkeypatch):
    """submit returns a Submitted: its JSON holds the backend's own keys only, and the line a person
    reads names what would start: the local command line as a shell takes it, the Slurm script."""
    monkeypatch.setenv("FSDPKIT_HOME", str(tmp_path / "home"))
    overrides = [("name", "contract"), ("backend", backend), ("train", {"max_steps": 5}),
                 ("slurm", {"script_dir": str(tmp_path / "scripts")})]
    result = get_backend(backend).submit(load_job(None, overrides), dry_run="client")
    assert list(result.to_dict()) == keys
    made = shlex.join(result.command) if result.command else str(tmp_path / "scripts" / "contract.sbatch")
    assert result.made() == [made]
    args = ["job", "submit", "--dry-run"] + [arg for k, v in overrides for arg in ("--set", f"{k}={json.dumps(v)}")]
    r = run_cli(*args, "--json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["data"] == json.loads(json.dumps(result.to_dict()))
    r = run_cli(*args)
    assert r.stdout.splitlines() == [f"dry run: would create {made}; -o yaml prints them"], r.stdout
    assert not (tmp_path / "home").exists() and not (tmp_path / "scripts").exists()
