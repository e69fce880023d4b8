"""What the Kubernetes job backend's halves share: the connection, the job kinds it manages, and
finding, deleting and waiting out a job by name."""

from __future__ import annotations

import logging
import time
from typing import Any

from fsdpkit.cluster.client import ClusterError, api_errors, connect, is_not_found
from fsdpkit.errors import UserError

log = logging.getLogger(__name__)

# (group, version, plural) of the job kinds this backend manages.
KINDS = {
    "PyTorchJob": ("kubeflow.org", "v1", "pytorchjobs"),
    "HyperPodPyTorchJob": ("sagemaker.amazonaws.com", "v1", "hyperpodpytorchjobs"),
}


def matches(labels: dict[str, str] | None, wanted: dict[str, str]) -> bool:
    """Label selection done on our side as well: the selector is sent to the API server, and the
    answer is checked again, so a server (or proxy) that ignores labelSelector cannot mix jobs."""
    labels = labels or {}
    return all(labels.get(k) == v for k, v in wanted.items())


def selector(wanted: dict[str, str]) -> str:
    return ",".join(f"{k}={v}" for k, v in wanted.items())


class KubeAPI:
    name = "pytorchjob"

    def __init__(self, context: str | None = None, kubeconfig: str | None = None):
        self.context, self.kubeconfig = context, kubeconfig
        self._client: Any = None

    @property
    def client(self) -> Any:
        if self._client is None:
            self._client = connect(self.context, self.kubeconfig)
        return self._client

    @property
    def host(self) -> str:
        return self.client.configuration.host

    # kubernetes is the optional `cloud` extra: loaded when a cluster is first used.
    def _core(self) -> Any:
        from kubernetes import client

        return client.CoreV1Api(self.client)

    def _custom(self) -> Any:
        from kubernetes import client

        return client.CustomObjectsApi(self.client)

    def get_job(self, name: str, namespace: str) -> tuple[str, dict[str, Any]] | None:
        for kind, (group, version, plural) in KINDS.items():
            try:
                with api_errors(f"reading job {name}", self.host):
                    return kind, self._custom().get_namespaced_custom_object(group, version, namespace, plural, name)
            except Exception as e:
                if not is_not_found(e):
                    raise
        return None

    def _require_job(self, name: str, namespace: str) -> tuple[str, dict[str, Any]]:
        found = self.get_job(name, namespace)
        if found is None:
            raise UserError(f"job {name!r} not found in namespace {namespace} (see `fsdpkit job list`)")
        return found

    def _delete_object(self, kind: str, name: str, namespace: str) -> None:
        core = self._core()
        with api_errors(f"deleting {kind}/{name}", self.host):
            if kind == "Secret":
                core.delete_namespaced_secret(name, namespace)
            elif kind == "PersistentVolumeClaim":
                core.delete_namespaced_persistent_volume_claim(name, namespace)
            else:
                group, version, plural = KINDS[kind]
                self._custom().delete_namespaced_custom_object(group, version, namespace, plural, name,
                                                               propagation_policy="Foreground")

    def _wait_gone(self, name: str, namespace: str, timeout: float = 120, poll: float = 1.0) -> None:
        deadline = time.monotonic() + timeout
        while self.get_job(name, namespace) is not None:
            if time.monotonic() > deadline:
                raise ClusterError(f"job {name!r} is still being deleted after {timeout:.0f} s; try again later")
            time.sleep(poll)

