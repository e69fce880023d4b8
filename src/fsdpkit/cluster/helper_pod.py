"""Run one short command in a pod that mounts a PVC (checkpoints on FSx / EFS), read what it
printed, and always delete the pod again."""

from __future__ import annotations

import secrets
import time
from typing import Any

from fsdpkit.cluster.client import ClusterError, api_errors, is_not_found

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


def run_in_pod(api_client: Any, namespace: str, claim: str, image: str, argv: list[str],
               timeout: float = 300, poll: float = 1.0) -> str:
    from kubernetes import client

    core = client.CoreV1Api(api_client)
    host = api_client.configuration.host
    name = f"fsdpkit-helper-{secrets.token_hex(4)}"
    with api_errors(f"creating helper pod {name}", host):
        core.create_namespaced_pod(namespace, helper_manifest(name, namespace, claim, image, argv))
    try:
        deadline = time.monotonic() + timeout
        while True:
            with api_errors(f"reading helper pod {name}", host):
                phase = (core.read_namespaced_pod(name, namespace, _preload_content=False).json().get("status")
                         or {}).get("phase")
            if phase in ("Succeeded", "Failed"):
                break
            if time.monotonic() > deadline:
                raise ClusterError(f"helper pod {name} did not finish in {timeout:.0f} s (phase {phase}); is PVC "
                                   f"{claim} bound and the image {image} pullable? kubectl -n {namespace} describe "
                                   f"pod {name}")
            time.sleep(poll)
        with api_errors(f"reading logs of {name}", host):
            out = core.read_namespaced_pod_log(name, namespace, _preload_content=False).data.decode(errors="replace")
        if phase == "Failed":
            raise ClusterError(f"helper pod {name} failed: {out.strip().splitlines()[-1] if out.strip() else ''}")
        return out
    finally:
        try:
            with api_errors(f"deleting helper pod {name}", host):
                core.delete_namespaced_pod(name, namespace)
        except Exception as e:
            if not is_not_found(e):
                raise
