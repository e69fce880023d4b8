"""The API server's rules for a container's resources, checked before anything is sent: a job's CRD
schema types `resources` as a free map, so a pod template that the Pod API refuses passes the
CRD's own validation, the job is created, and then no pod starts (the operator's events say why,
if anyone looks). Each rule mirrors Kubernetes' `validateResourceRequirements` and
`ValidateResourceQuantityValue` (pkg/apis/core/validation/validation.go) and says what it cites:

- quantities are not negative;
- extended resources (`nvidia.com/gpu`, `vpc.amazonaws.com/efa`, any name with a domain other than
  kubernetes.io) are whole numbers ("must be an integer");
- a resource that cannot be overcommitted (extended resources, `hugepages-*`) has a limit whenever
  it has a request ("Limit must be set for non overcommitable resources"), and the two are equal
  ("must be equal to ... limit");
- a request is never above its limit ("must be less than or equal to ... limit");
- hugepages need a cpu or memory request or limit beside them ("HugePages require cpu or memory");
- a container's resource claims name claims of its pod, once each (validateResourceClaimNames:
  "must be the name of an entry in pod.spec.resourceClaims", "Duplicate value").

The API server defaults a missing request to its limit before it validates; so does `check`."""

from __future__ import annotations

import copy
from collections.abc import Sequence
from decimal import Decimal
from typing import Any

from fsdpkit.cluster.quantity import parse
from fsdpkit.cluster.trainer import NODE
from fsdpkit.errors import UserError

_NATIVE_DOMAINS = ("", "kubernetes.io")


def is_hugepages(name: str) -> bool:
    return name.startswith("hugepages-")


def is_extended(name: str) -> bool:
    """A resource named with a domain of its own (`nvidia.com/gpu`), not `requests.`-prefixed quota."""
    domain = name.split("/", 1)[0] if "/" in name else ""
    return domain not in _NATIVE_DOMAINS and not domain.endswith(".kubernetes.io") and \
        not name.startswith("requests.")


def overcommit_allowed(name: str) -> bool:
    """cpu, memory, ephemeral-storage: a request below the limit is allowed. Not for hugepages or
    extended resources."""
    return not is_extended(name) and not is_hugepages(name)


def container_errors(resources: dict[str, Any], where: str = "resources") -> list[str]:
    """Every rule the API server would break on one container's `resources`, each as
    `FIELD: what` (empty when it accepts them)."""
    limits = {k: parse(v) for k, v in (resources.get("limits") or {}).items()}
    requests = {**limits, **{k: parse(v) for k, v in (resources.get("requests") or {}).items()}}
    errors: list[str] = []
    for side, values in (("limits", limits), ("requests", requests)):
        for name, q in values.items():
            if q < 0:
                errors.append(f"{where}.{side}[{name}]: must be greater than or equal to 0")
            if is_extended(name) and q != q.to_integral_value():
                errors.append(f"{where}.{side}[{name}]: must be an integer (an extended resource is counted "
                              "in whole devices)")
    for name, q in requests.items():
        limit = limits.get(name)
        if limit is None:
            if not overcommit_allowed(name):
                errors.append(f"{where}.limits[{name}]: Limit must be set for non overcommitable resources")
        elif q != limit and not overcommit_allowed(name):
            errors.append(f"{where}.requests[{name}]: must be equal to {name} limit of {_fmt(limit)}")
        elif q > limit:
            errors.append(f"{where}.requests[{name}]: must be less than or equal to {name} limit of {_fmt(limit)}")
    names = set(requests) | set(limits)
    if any(is_hugepages(n) for n in names) and not names & {"cpu", "memory"}:
        errors.append(f"{where}: Forbidden: HugePages require cpu or memory")
    return errors


def claim_errors(resources: dict[str, Any], pod_claims: set[str], where: str) -> list[str]:
    """A container's `resources.claims` against the claims its pod declares."""
    errors, seen = [], set()
    for j, claim in enumerate(resources.get("claims") or []):
        name = claim.get("name")
        if name in seen:
            errors.append(f"{where}.claims[{j}].name: Duplicate value: {name!r}")
        elif name not in pod_claims:
            errors.append(f"{where}.claims[{j}].name: must be the name of an entry in pod.spec.resourceClaims "
                          f"({name!r} is not)")
        seen.add(name)
    return errors


def pod_errors(pod_spec: dict[str, Any], where: str = "spec") -> list[str]:
    """The rules over every container (init containers too) of a pod's spec."""
    errors: list[str] = []
    pod_claims = {c.get("name") for c in pod_spec.get("resourceClaims") or []}
    for kind in ("initContainers", "containers"):
        for i, c in enumerate(pod_spec.get(kind) or []):
            res, at = c.get("resources") or {}, f"{where}.{kind}[{i}].resources"
            errors += container_errors(res, at) + claim_errors(res, pod_claims, at)
    return errors


def check(template: dict[str, Any], what: str) -> None:
    """A pod template (`{metadata, spec}`) the API server would refuse is a one-line UserError
    naming the object and the first rule it breaks, raised before anything is created."""
    if errors := pod_errors(template.get("spec") or {}):
        more = f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""
        raise UserError(f"{what}: the API server would refuse its pods: {errors[0]}{more}")


def templates(obj: dict[str, Any], beside: Sequence[dict[str, Any]] = ()) -> list[tuple[str, dict[str, Any]]]:
    """(where, pod template) of every pod an object makes: a Pod itself, each replica of a
    PyTorchJob, MPIJob or HyperPodPyTorchJob, a RayCluster's head and worker groups, and a TrainJob's
    node pod (on its own TrainingRuntime where that is among `beside`, the objects sent with it)."""
    spec = obj.get("spec") or {}
    kind = obj.get("kind")
    if kind == "Pod":
        return [("", {"spec": spec})]
    if kind in ("PyTorchJob", "MPIJob"):
        replicas = spec.get("pytorchReplicaSpecs" if kind == "PyTorchJob" else "mpiReplicaSpecs") or {}
        return [(name, r["template"]) for name, r in replicas.items()]
    if kind == "HyperPodPyTorchJob":
        return [(r.get("name", str(i)), r["template"]) for i, r in enumerate(spec.get("replicaSpecs") or [])]
    if kind == "RayCluster":
        head = [("head", spec["headGroupSpec"]["template"])] if "headGroupSpec" in spec else []
        return head + [(g.get("groupName", str(i)), g["template"]) for i, g in enumerate(spec.get("workerGroupSpecs")
                                                                                         or [])]
    if kind == "TrainJob":
        ref = spec.get("runtimeRef") or {}
        runtime = next((o for o in beside if o.get("kind") == ref.get("kind") == "TrainingRuntime"
                        and (o.get("metadata") or {}).get("name") == ref.get("name")), None)
        return [(NODE, _trainjob_pod(spec, runtime))]
    return []


def _runtime_pod(runtime: dict[str, Any] | None) -> dict[str, Any]:
    """The node pod's spec fields a TrainingRuntime sets beside its containers (device claims)."""
    for job in (((runtime or {}).get("spec") or {}).get("template") or {}).get("spec", {}).get("replicatedJobs") or []:
        if job.get("name") == NODE:
            pod = (((job.get("template") or {}).get("spec") or {}).get("template") or {}).get("spec") or {}
            return {k: copy.deepcopy(v) for k, v in pod.items() if k != "containers"}
    return {}


def _trainjob_pod(spec: dict[str, Any], runtime: dict[str, Any] | None = None) -> dict[str, Any]:
    """A TrainJob's node pod as Trainer v2 assembles it: the runtime patches' pod template (volumes,
    node selection, tolerations, the grace period, the container's mounts) with the `trainer`
    container (image, command, env, resources), over the pod fields of the job's own runtime where
    it has one. Otherwise the runtime's template adds nothing that admission reads in fsdpkit's
    runtime or upstream's torch-distributed."""
    template: dict[str, Any] = {"metadata": {}, "spec": {}}
    for patch in spec.get("runtimePatches") or []:
        replicated = (((patch.get("trainingRuntimeSpec") or {}).get("template") or {}).get("spec") or {}).get(
            "replicatedJobs") or []
        for job in replicated:
            if job.get("name") == NODE:
                template = copy.deepcopy(((job.get("template") or {}).get("spec") or {}).get("template") or template)
    trainer = spec.get("trainer") or {}
    patched: dict[str, Any] = next(
        (c for c in template.get("spec", {}).get("containers") or [] if c.get("name") == NODE), {})
    container = {**patched, "name": NODE, "image": trainer.get("image")}
    for field, source in (("command", "command"), ("args", "args"), ("env", "env"), ("resources", "resourcesPerNode")):
        if source in trainer:
            container[field] = trainer[source]
    template.setdefault("spec", {})["containers"] = [container]
    template["spec"] = {**_runtime_pod(runtime), **template["spec"]}
    return template


def pods(obj: dict[str, Any], beside: Sequence[dict[str, Any]] = ()) -> list[tuple[str, dict[str, Any]]]:
    """(where, Pod) for each kind of pod an object's operator creates, named as its first such pod
    (`JOB-master-0`), in the object's namespace: what a server dry run sends, so that the admission
    that will see the operator's pods (Pod Security, Priority, quotas, webhooks) answers now."""
    meta = obj.get("metadata") or {}
    out = []
    for where, template in templates(obj, beside):
        tmeta = template.get("metadata") or {}
        name = f"{meta.get('name')}-{where.lower()}-0" if where else meta.get("name")
        pod_meta = {"name": name, "namespace": meta.get("namespace"),
                    "labels": {**(meta.get("labels") or {}), **(tmeta.get("labels") or {})}}
        if tmeta.get("annotations"):
            pod_meta["annotations"] = tmeta["annotations"]
        out.append((where, {"apiVersion": "v1", "kind": "Pod", "metadata": pod_meta,
                            "spec": copy.deepcopy(template.get("spec") or {})}))
    return out


def check_objects(objs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """`check` on every pod template of every object; returns `objs` unchanged."""
    for obj in objs:
        name = f"{obj.get('kind')}/{(obj.get('metadata') or {}).get('name')}"
        for where, template in templates(obj, objs):
            check(template, f"{name} {where}".strip())
    return objs


def _fmt(q: Decimal) -> str:
    return f"{q.normalize():f}"
