"""Short-lived pods: create, wait until they end, read what they printed, always delete them.
Used for commands on a PVC (checkpoints on FSx / EFS) and for validation pods."""

from __future__ import annotations

import logging
import secrets
from typing import Any

from fsdpkit.cluster import pod_rules
from fsdpkit.cluster.client import ClusterError, api_errors, is_conflict, is_not_found
from fsdpkit.errors import TimedOut
from fsdpkit.polling import wait_saying

log = logging.getLogger(__name__)

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


def dry_run_pods(core: Any, obj: dict[str, Any], host: str | None = None,
                 beside: list[dict[str, Any]] | None = None) -> list[str]:
    """One Pod of each kind `obj`'s operator will make (pod_rules.pods), created with dryRun=All in
    its namespace: admission speaks to pods, which the job object alone never meets (Pod Security,
    PriorityClass, quotas, LimitRanges, webhooks on pods). Nothing is stored. A 409 means
    admission let it through (a pod of that name exists). Returns Pod/NAME of each; `core` is a
    CoreV1Api; `beside`: the objects sent with it (a TrainJob's own runtime)."""
    meta = obj["metadata"]
    accepted = []
    for where, pod in pod_rules.pods(obj, beside or []):
        name = pod["metadata"]["name"]
        try:
            with api_errors(f"server dry run of Pod/{name} (a pod of {obj['kind']} {meta['name']}: {where})", host,
                            keep=is_conflict):
                core.create_namespaced_pod(meta["namespace"], pod, field_validation="Strict", dry_run="All")
        except Exception as e:
            if not is_conflict(e):
                raise
        accepted.append(f"Pod/{name}")
    return accepted


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
        phases = _wait_ended(core, host, namespace, created, timeout, poll)
        out = {}
        for name in created:
            with api_errors(f"reading logs of {name}", host):
                printed = core.read_namespaced_pod_log(name, namespace, _preload_content=False).data
            out[name] = (phases[name], printed.decode(errors="replace"))
        return out
    finally:
        for name in created:
            try:
                with api_errors(f"deleting pod {name}", host):
                    core.delete_namespaced_pod(name, namespace)
            except Exception as e:
                if not is_not_found(e):
                    raise


def _wait_ended(core: Any, host: str, namespace: str, created: list[str], timeout: float, poll: float
                ) -> dict[str, str]:
    """Each pod's final phase, saying which are still running (on a change, and every 30 s)."""
    phases: dict[str, str | None] = {}

    def look() -> dict[str, str | None]:
        for name in created:
            if phases.get(name) not in ("Succeeded", "Failed"):
                with api_errors(f"reading pod {name}", host):
                    phases[name] = (core.read_namespaced_pod(name, namespace, _preload_content=False).json().get(
                        "status") or {}).get("phase")
        return dict(phases)

    def waiting(seen: dict[str, str | None]) -> list[str]:
        return [f"{n} {p or 'Pending'}" for n, p in seen.items() if p not in ("Succeeded", "Failed")]

    def what(seen: dict[str, str | None], waited: str) -> str | None:
        left = waiting(seen)
        return f"waiting for {len(left)} pod(s) to finish: {', '.join(left)} ({waited})" if left else None

    seen = wait_saying(look, lambda s: not waiting(s), timeout, poll, what, log.info)
    if left := waiting(seen):
        raise TimedOut(f"pods did not finish in {timeout:.0f} s: {', '.join(left)}; kubectl -n {namespace} "
                       "describe pod NAME (image pull, volume, or no room to schedule)")
    return {n: str(p) for n, p in seen.items()}


def run_in_pod(api_client: Any, namespace: str, claim: str, image: str, argv: list[str],
               timeout: float = 300, poll: float = 1.0) -> str:
    """One helper pod mounting `claim` at /ckpt: what it printed (a ClusterError if it failed)."""
    name = f"fsdpkit-helper-{secrets.token_hex(4)}"
    phase, out = run_pods(api_client, namespace, [helper_manifest(name, namespace, claim, image, argv)],
                          timeout, poll)[name]
    if phase == "Failed":
        raise ClusterError(f"helper pod {name} failed: {out.strip().splitlines()[-1] if out.strip() else ''}")
    return out
