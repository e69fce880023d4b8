"""Create-if-absent for the built-in kinds fsdpkit installs (add-ons, storage), through the typed
clients of the official `kubernetes` package. An object that exists is left as it is: running an
install twice changes nothing, and fsdpkit never overwrites what an administrator has tuned."""

from __future__ import annotations

import json
from typing import Any

from fsdpkit.cluster.client import ClusterError, api_errors, api_resources, is_not_found

# (apiVersion, kind) -> (client class, method suffix, namespaced)
KINDS: dict[tuple[str, str], tuple[str, str, bool]] = {
    ("v1", "Namespace"): ("CoreV1Api", "namespace", False),
    ("v1", "Service"): ("CoreV1Api", "namespaced_service", True),
    ("v1", "PersistentVolume"): ("CoreV1Api", "persistent_volume", False),
    ("v1", "PersistentVolumeClaim"): ("CoreV1Api", "namespaced_persistent_volume_claim", True),
    ("apps/v1", "DaemonSet"): ("AppsV1Api", "namespaced_daemon_set", True),
    ("apps/v1", "Deployment"): ("AppsV1Api", "namespaced_deployment", True),
    ("storage.k8s.io/v1", "StorageClass"): ("StorageV1Api", "storage_class", False),
}
# Custom objects fsdpkit installs: (apiVersion, kind) -> plural (cluster-scoped but for NAMESPACED).
CUSTOM: dict[tuple[str, str], str] = {
    ("trainer.kubeflow.org/v1alpha1", "ClusterTrainingRuntime"): "clustertrainingruntimes",
    ("karpenter.sh/v1", "NodePool"): "nodepools",
    ("karpenter.k8s.aws/v1", "EC2NodeClass"): "ec2nodeclasses",
    ("kueue.x-k8s.io/v1beta2", "ResourceFlavor"): "resourceflavors",
    ("kueue.x-k8s.io/v1beta2", "ClusterQueue"): "clusterqueues",
    ("kueue.x-k8s.io/v1beta2", "WorkloadPriorityClass"): "workloadpriorityclasses",
    ("kueue.x-k8s.io/v1beta2", "LocalQueue"): "localqueues",
}
NAMESPACED = {"LocalQueue"}


def require_api(api_client: Any, objs: list[dict[str, Any]], installs: str) -> None:
    """Every custom kind among `objs` is served (discovery), else one line naming what installs it,
    before anything is created."""
    from kubernetes import client

    custom = client.CustomObjectsApi(api_client)
    for api_version, kind in dict.fromkeys((o["apiVersion"], o["kind"]) for o in objs):
        if (api_version, kind) not in CUSTOM:
            continue
        group, version = api_version.split("/")
        served = api_resources(custom, group, version, api_client.configuration.host, f"finding the {kind} API")
        if CUSTOM[(api_version, kind)] not in (served or ()):
            raise ClusterError(f"{kind}: this cluster has no {api_version} API; {installs}", code="not_found")


def describe(obj: dict[str, Any]) -> str:
    meta = obj["metadata"]
    where = f"{meta['namespace']}/" if meta.get("namespace") else ""
    return f"{obj['kind']}/{where}{meta['name']}"


def _call(api_client: Any, obj: dict[str, Any], verb: str, *extra: Any, **kw: Any) -> Any:
    from kubernetes import client

    key = (obj["apiVersion"], obj["kind"])
    if key in CUSTOM:
        group, version = obj["apiVersion"].split("/")
        api = client.CustomObjectsApi(api_client)
        target = [] if verb == "create" else [obj["metadata"]["name"]]
        verb = "get" if verb == "read" else verb
        if obj["kind"] in NAMESPACED:
            return getattr(api, f"{verb}_namespaced_custom_object")(group, version, obj["metadata"]["namespace"],
                                                                    CUSTOM[key], *target, *extra, **kw)
        return getattr(api, f"{verb}_cluster_custom_object")(group, version, CUSTOM[key], *target, *extra, **kw)
    cls, suffix, namespaced = KINDS[key]
    api = getattr(client, cls)(api_client)
    meta = obj["metadata"]
    args: list[Any] = [] if verb == "create" else [meta["name"]]
    if namespaced:
        args.append(meta["namespace"])
    return getattr(api, f"{verb}_{suffix}")(*args, *extra, **kw)


def _found(what: str, call: Any) -> bool:
    """Run `call`; False when the object is not there (404), any other failure one line."""
    with api_errors(what):
        try:
            call()
            return True
        except Exception as e:
            if not is_not_found(e):
                raise
            return False


def ensure(api_client: Any, obj: dict[str, Any], update: bool = False) -> str:
    """"created" or "exists"; with `update`, an existing object whose spec is not ours is patched
    to it ("updated"; "unchanged" where every field we give already holds, the server's defaults
    beside them)."""
    found: list[Any] = []
    if _found(f"reading {describe(obj)}",
              lambda: found.append(_call(api_client, obj, "read", _preload_content=False))):
        if not update:
            return "exists"
        if _holds(json.loads(found[0].data or b"{}").get("spec"), obj.get("spec")):
            return "unchanged"
        with api_errors(f"updating {describe(obj)}"):   # a merge patch: each list we give replaces theirs
            _call(api_client, obj, "patch", {"spec": obj["spec"]})
        return "updated"
    with api_errors(f"creating {describe(obj)}"):
        _call(api_client, obj, "create", obj, field_validation="Strict")
    return "created"


def _holds(theirs: Any, ours: Any) -> bool:
    """Whether every field of `ours` has its value in `theirs` (which may hold more: defaults)."""
    if isinstance(ours, dict):
        return isinstance(theirs, dict) and all(_holds(theirs.get(k), v) for k, v in ours.items())
    if isinstance(ours, list):
        return isinstance(theirs, list) and len(theirs) == len(ours) and all(map(_holds, theirs, ours))
    return bool(theirs == ours)


def remove(api_client: Any, obj: dict[str, Any]) -> str:
    """"deleted" or "absent"."""
    return "deleted" if _found(f"deleting {describe(obj)}", lambda: _call(api_client, obj, "delete")) else "absent"
