"""Validating manifests against the real schemas: CRDs from ../shared/schemas with the API
server's strict field validation, built-in kinds with kubernetes-validate."""

from __future__ import annotations

import copy

import pytest
import yaml

from conftest import ROOT

SCHEMAS = ROOT.parent / "shared" / "schemas"


IMAGE = "123456789012.dkr.ecr.us-west-2.amazonaws.com/fsdpkit:1"


def _strict(schema):
    """The API server's strict field validation: an unknown field is an error, not silently pruned."""
    if isinstance(schema, dict):
        if schema.get("type") == "object" and "properties" in schema and "additionalProperties" not in schema \
                and not schema.get("x-kubernetes-preserve-unknown-fields"):
            schema["additionalProperties"] = False
        for v in schema.values():
            _strict(v)
    elif isinstance(schema, list):
        for v in schema:
            _strict(v)
    return schema


def crd_validator(filename):
    import jsonschema

    if not (SCHEMAS / filename).is_file():
        pytest.skip(f"{SCHEMAS} is absent (a fresh clone outside the project's workspace); CI has it")
    crd = yaml.safe_load((SCHEMAS / filename).read_text())
    version = next(v for v in crd["spec"]["versions"] if v.get("storage", v.get("served")))
    return jsonschema.Draft4Validator(_strict(copy.deepcopy(version["schema"]["openAPIV3Schema"])))


def validate_builtin(obj):
    import kubernetes_validate

    kubernetes_validate.validate(obj, "1.33.0", strict=True)  # raises ValidationError


def pod_of(template, name="p"):
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, **template.get("metadata", {})},
            "spec": template["spec"]}


def _module_of(distribution: str, relative: str, name: str):
    """One module file of an installed distribution, loaded by itself: AWS's HyperPod packages
    pull in their whole SDK (and pinned old torch, pytest, ruff) from their __init__ files, while
    the modules read here need only pydantic or the standard library."""
    import importlib.metadata
    import importlib.util

    try:
        path = importlib.metadata.distribution(distribution).locate_file(relative)
    except importlib.metadata.PackageNotFoundError:
        pytest.skip(f"{distribution} is not installed (make venv installs it)")
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def validate_hyperpod_job(job):
    """A HyperPodPyTorchJob against the HyperPod CLI's own API models (sagemaker-hyperpod), whose
    nested models refuse unknown fields; the top level must use only fields it knows."""
    models = _module_of("sagemaker-hyperpod", "sagemaker/hyperpod/training/config/"
                        "hyperpod_pytorch_job_unified_config.py", "hyperpod_job_models")
    model = models._HyperPodPytorchJob
    assert set(job["spec"]) <= set(model.model_fields), set(job["spec"]) - set(model.model_fields)
    model.model_validate(job["spec"], by_name=True)  # raises pydantic's ValidationError


def hyperpod_log_evaluator():
    """The HyperPod elastic agent's own rule evaluator (what runs on every node)."""
    return _module_of("hyperpod-elastic-agent", "hyperpod_elastic_agent/logagent/log_agent.py",
                      "hyperpod_log_agent").LogEvaluator
