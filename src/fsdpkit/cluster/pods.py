"""Short-lived pods: create, wait until they end, read what they printed, always delete them.
Used for commands on a PVC (checkpoints on FSx / EFS) and for validation pods."""

from __future__ import annotations

import secrets
import time
from typing import Any

from fsdpkit.cluster import pod_rules
from fsdpkit.cluster.client import ClusterError, api_errors, is_not_found
from fsdpkit.errors import TimedOut

MOUNT = "/ckpt"


def helper_manifest(name: str, namespace: str, claim: str, image: str, argv: list[str]) -> dict[str, Any]:
    return {
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": name, "namespace": namespace,
                     "labels": {"app.kubernetes.io/managed-by": "fsdpkit", "fsdpkit.dev/helper": "ckpt"}},
        "spec": {
            "restartPolicy": "Never",
            "containers": [{"name": "helper", "image": image, "command": argv,
                            "volumeMounts": [{"name": "data", "mountPath": MOUNT}],
                            "resources": {"requests": {"cpu": "100m", "memory": "256Mi"}}}],
            "volumes": [{"name": "data", "persistentVolumeClaim": {"claimName": claim}}],
        },
    }


def run_pods(api_client: Any, namespace: str, pods: list[dict[str, Any]], timeout: float = 300,
             poll: float = 1.0) -> dict[str, tuple[str, str]]:
    """Create `pods` (restartPolicy Never), wait until each has ended, return {name: (phase, log)}.
    Every pod created here is deleted again, whatever happens; none is sent that the API server
    would refuse."""
    from kubernetes import client

    pod_rules.check_objects(pods)
    core = client.CoreV1Api(api_client)
    host = api_client.configuration.host
    created: list[str] = []
    try:
        for pod in pods:
            name = pod["metadata"]["name"]
            with api_errors(f"creating pod {name}", host):
                core.create_namespaced_pod(namespace, pod, field_validation="Strict")
            created.append(name)
        deadline = time.monotonic() + timeout
        phases: dict[str, str] = {}
        while len(phases) < len(created):
            for name in created:
                if name in phases:
                    continue
                with api_errors(f"reading pod {name}", host):
                    phase = (core.read_namespaced_pod(name, namespace, _preload_content=False).json().get("status")
                             or {}).get("phase")
                if phase in ("Succeeded", "Failed"):
                    phases[name] = phase
            if len(phases) < len(created):
                if time.monotonic() > deadline:
                    waiting = ", ".join(n for n in created if n not in phases)
                    raise TimedOut(f"pods did not finish in {timeout:.0f} s: {waiting}; kubectl -n {namespace} "
                                       "describe pod NAME (image pull, volume, or no room to schedule)")
                time.sleep(poll)
        out = {}
        for name in created:
            with api_errors(f"reading logs of {name}", host):
                log = core.read_namespaced_pod_log(name, namespace, _preload_content=False).data
            out[name] = (phases[name], log.decode(errors="replace"))
        return out
    finally:
        for name in created:
            try:
                with api_errors(f"deleting pod {name}", host):
                    core.delete_namespaced_pod(name, namespace)
            except Exception as e:
                if not is_not_found(e):
                    raise


def run_in_pod(api_client: Any, namespace: str, claim: str, image: str, argv: list[str],
               timeout: float = 300, poll: float = 1.0) -> str:
    """One helper pod mounting `claim` at /ckpt: what it printed (a ClusterError if it failed)."""
    name = f"fsdpkit-helper-{secrets.token_hex(4)}"
    phase, out = run_pods(api_client, namespace, [helper_manifest(name, namespace, claim, image, argv)],
                          timeout, poll)[name]
    if phase == "Failed":
        raise ClusterError(f"helper pod {name} failed: {out.strip().splitlines()[-1] if out.strip() else ''}")
    return out
