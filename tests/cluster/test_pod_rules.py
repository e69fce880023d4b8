"""Kubernetes' resource rules for a container (fsdpkit.cluster.pod_rules), one template breaking
each rule as the API server would refuse it, and a job whose pods would be refused stopped at
render in one line, before anything is sent."""

from __future__ import annotations

import pytest

from fsdpkit.cluster import pod_rules
from fsdpkit.errors import UserError

from job_specs import job_cli, write_spec


def template(requests=None, limits=None, init=False):
    resources = {k: v for k, v in (("requests", requests), ("limits", limits)) if v is not None}
    container = {"name": "c", "image": "x", "resources": resources}
    return {"spec": {"initContainers" if init else "containers": [container]}}


# (what breaks, requests, limits, the API server's words, where)
BROKEN = [
    ("negative", {"cpu": "-1"}, None, "must be greater than or equal to 0", "requests[cpu]"),
    ("fractional GPU", {"nvidia.com/gpu": "0.5"}, {"nvidia.com/gpu": "0.5"}, "must be an integer", "[nvidia.com/gpu]"),
    ("fractional EFA", None, {"vpc.amazonaws.com/efa": "1500m"}, "must be an integer", "[vpc.amazonaws.com/efa]"),
    ("GPU request without limit", {"nvidia.com/gpu": 8}, None,
     "Limit must be set for non overcommitable resources", "limits[nvidia.com/gpu]"),
    ("GPU request below limit", {"nvidia.com/gpu": 4}, {"nvidia.com/gpu": 8},
     "must be equal to nvidia.com/gpu limit of 8", "requests[nvidia.com/gpu]"),
    ("hugepages request below limit", {"hugepages-2Mi": "1Gi", "memory": "1Gi"},
     {"hugepages-2Mi": "2Gi", "memory": "1Gi"}, "must be equal to hugepages-2Mi limit of 2147483648",
     "requests[hugepages-2Mi]"),
    ("memory request above limit", {"memory": "2Gi"}, {"memory": "1Gi"},
     "must be less than or equal to memory limit of 1073741824", "requests[memory]"),
    ("hugepages alone", {"hugepages-2Mi": "5120Mi", "nvidia.com/gpu": 8, "vpc.amazonaws.com/efa": 32},
     {"hugepages-2Mi": "5120Mi", "nvidia.com/gpu": 8, "vpc.amazonaws.com/efa": 32},
     "Forbidden: HugePages require cpu or memory", "resources"),
]


@pytest.mark.parametrize(("requests", "limits", "words", "where"), [b[1:] for b in BROKEN], ids=[b[0] for b in BROKEN])
def test_each_rule_refuses_the_template_that_breaks_it(requests, limits, words, where):
    errors = pod_rules.pod_errors(template(requests, limits)["spec"])
    # The API server defaults a missing request to its limit, then both sides break the same rule.
    assert errors and all(words in e for e in errors) and where in errors[0], errors
    with pytest.raises(UserError, match=r"^PyTorchJob/j Worker: the API server would refuse its pods: "):
        pod_rules.check(template(requests, limits), "PyTorchJob/j Worker")
    assert pod_rules.pod_errors(template(requests, limits, init=True)["spec"]) == \
        [e.replace(".containers[", ".initContainers[") for e in errors]


@pytest.mark.parametrize(("requests", "limits"), [
    ({"cpu": "500m", "memory": "1Gi"}, {"memory": "2Gi"}),        # below the limit: cpu and memory may be
    (None, {"nvidia.com/gpu": 8, "hugepages-2Mi": "2Gi", "cpu": 4}),  # requests default to the limits
    ({"nvidia.com/gpu": "8", "vpc.amazonaws.com/efa": 32, "hugepages-2Mi": "5120Mi", "memory": "1638Gi"},
     {"nvidia.com/gpu": 8, "vpc.amazonaws.com/efa": "32", "hugepages-2Mi": "5Gi"}),  # quantities compare as numbers
    ({"cpu": "1.5", "example.kubernetes.io/thing": "0.5"}, None),   # kubernetes.io names are native
], ids=["cpu-memory-overcommit", "limits-only", "equal-quantities", "native-names"])
def test_what_the_api_server_accepts_passes(requests, limits):
    assert pod_rules.pod_errors(template(requests, limits)["spec"]) == []


def test_a_job_whose_pods_would_be_refused_stops_at_render_and_applies_nothing(kube, tmp_path):
    """A HyperPod job on EFA without an instance type: hugepages and no cpu or memory to size."""
    spec = write_spec(tmp_path, backend="hyperpod", instance_type=None, gpus_per_node=8, efa_per_node=4)
    for verb in ("render", "submit"):
        r = job_cli(kube, verb, str(spec))
        assert r.returncode == 2 and r.stderr == (
            "error: HyperPodPyTorchJob/llama-tiny pod: the API server would refuse its pods: spec.containers[0]."
            "resources: Forbidden: HugePages require cpu or memory\n"), r.stderr
    assert not [m for m, _p, _b in kube.requests() if m in ("POST", "PUT", "PATCH")]
    # Giving the memory it needs is what fixes it.
    assert job_cli(kube, "render", str(spec), "--set", "memory=64Gi").returncode == 0
