"""What the Kubernetes job backend's halves share: the connection, the job kinds it manages, and
finding, deleting and waiting out a job by name."""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar, cast

from fsdpkit.cluster import rbac, trainer
from fsdpkit.cluster.client import (
    ClusterError,
    api_errors,
    api_message,
    api_resources,
    connect,
    is_forbidden,
    is_not_found,
)
from fsdpkit.errors import NotFound, TimedOut
from fsdpkit.jobs.backends.base import Target
from fsdpkit.jobs.manifests import CONTAINER, JOB_LABEL, KF_JOB_NAME, KF_REPLICA_INDEX, KF_REPLICA_TYPE
from fsdpkit.polling import wait_saying

log = logging.getLogger(__name__)
T = TypeVar("T")


def _kubeflow_replica(labels: dict[str, str]) -> str | None:
    rtype, index = labels.get(KF_REPLICA_TYPE), labels.get(KF_REPLICA_INDEX)
    return f"{rtype.lower()}-{index}" if rtype and index is not None else None


def _trainjob_replica(labels: dict[str, str]) -> str | None:
    index = labels.get(trainer.COMPLETION_INDEX)
    return f"{trainer.NODE}-{index}" if index is not None else None


@dataclass(frozen=True)
class JobKind:
    """A job kind this backend manages: where its API lives, how its pods are found and named, and
    what installs its operator."""

    kind: str
    group: str
    version: str
    plural: str
    pod_label: str                                   # the pod label whose value is the job's name
    replica: Callable[[dict[str, str]], str | None]  # a pod's labels -> "master-0", "node-1", ...
    rank0: tuple[str, ...]                           # the replicas that hold rank 0
    container: str                                   # the training container's name
    backend: str                                     # the backend it is read back as
    operator: str

    def find(self) -> tuple[str, str, str]:
        return self.group, self.version, self.plural

    def first_rank0(self, by_replica: Mapping[str, T]) -> T | None:
        """Of pods by replica name (raw dicts or client objects), the one that holds rank 0."""
        return next((by_replica[r] for r in self.rank0 if r in by_replica), None)


KINDS = {k.kind: k for k in (
    JobKind("TrainJob", trainer.GROUP, trainer.VERSION, "trainjobs", trainer.JOBSET_NAME, _trainjob_replica,
            (f"{trainer.NODE}-0",), trainer.NODE, "trainjob",
            "Kubeflow Trainer v2 (fsdpkit cluster addons install --only trainer)"),
    JobKind("PyTorchJob", "kubeflow.org", "v1", "pytorchjobs", KF_JOB_NAME, _kubeflow_replica,
            ("master-0", "worker-0"), CONTAINER, "pytorchjob",
            "the Kubeflow training operator v1 (fsdpkit cluster addons install --only training-operator)"),
    # HyperPod's operator names pods NAME-pod-N; fsdpkit's own job label finds them.
    JobKind("HyperPodPyTorchJob", "sagemaker.amazonaws.com", "v1", "hyperpodpytorchjobs", JOB_LABEL,
            _kubeflow_replica, ("master-0", "worker-0"), CONTAINER, "hyperpod", "the HyperPod training operator (an "
            "EKS add-on of the HyperPod cluster: amazon-sagemaker-hyperpod-training-operator)"),
)}


# The objects fsdpkit makes beside a job, by kind: (API group, version, resource). The core API's
# through CoreV1Api; the others (a DRA claim template, a TrainJob's own runtime) as custom objects.
SUPPORT = {"Secret": ("", "v1", "secrets"), "PersistentVolumeClaim": ("", "v1", "persistentvolumeclaims"),
           "ResourceClaimTemplate": ("resource.k8s.io", "v1", "resourceclaimtemplates"),
           "TrainingRuntime": (trainer.GROUP, trainer.VERSION, "trainingruntimes")}


class KubeAPI:
    def __init__(self, target: Target | None = None):
        self.target = target or Target()
        self.context, self.kubeconfig, self.namespace = self.target.context, self.target.kubeconfig, \
            self.target.namespace
        self._client: Any = None
        self._served: list[str] | None = None
        self.refused: dict[str, str] = {}

    @property
    def client(self) -> Any:
        if self._client is None:
            self._client = connect(self.context, self.kubeconfig)
        return self._client

    @property
    def host(self) -> str:
        return cast("str", self.client.configuration.host)

    # kubernetes is the optional `cloud` extra: loaded when a cluster is first used.
    def _core(self) -> Any:
        from kubernetes import client

        return client.CoreV1Api(self.client)

    def _apps(self) -> Any:
        from kubernetes import client

        return client.AppsV1Api(self.client)

    def _custom(self) -> Any:
        from kubernetes import client

        return client.CustomObjectsApi(self.client)

    def served(self) -> list[str]:
        """The job kinds this API server serves (their operators' CRDs installed), from discovery,
        which every authenticated user may read: a kind is looked for only where it exists."""
        if self._served is None:
            self._served = [kind for kind, k in KINDS.items()
                            if k.plural in (api_resources(self._custom(), k.group, k.version, self.host,
                                                          "finding which job kinds the cluster serves") or ())]
        return self._served

    def get_job(self, name: str, namespace: str) -> tuple[str, dict[str, Any]] | None:
        """The job of that name, of whichever kind the server serves. A kind this user may not read
        (403) is not the job's kind as far as it can tell: it is remembered in `refused`, and
        `_require_job` names it if nothing else is found."""
        self.refused = {}
        for kind in self.served():
            group, version, plural = KINDS[kind].find()
            try:
                with api_errors(f"reading job {name}", self.host, keep=is_forbidden):
                    return kind, self._custom().get_namespaced_custom_object(group, version, namespace, plural, name)
            except Exception as e:
                if is_forbidden(e):
                    self.refused[f"{plural}.{group}"] = api_message(e)
                elif not is_not_found(e):
                    raise
        return None

    def serves(self, kind: str, namespace: str) -> bool:
        """Whether the API server knows this job kind (its operator's CRD is installed)."""
        return kind in self.served()

    def _require_job(self, name: str, namespace: str) -> tuple[str, dict[str, Any]]:
        found = self.get_job(name, namespace)
        if found is None:
            if self.refused:
                raise ClusterError(f"job {name!r} is not among the jobs this user may read in namespace {namespace}; "
                                   f"refused: {'; '.join(self.refused.values())}; ask the cluster's admin for the "
                                   f"Role `fsdpkit cluster rbac --namespace {namespace}` renders", code="access_denied")
            raise NotFound(f"job {name!r} not found in namespace {namespace} (see `fsdpkit job list`)")
        return found

    def require_access(self, verb: str, kind: str, namespace: str, objs: list[dict[str, Any]] | None = None) -> None:
        """Before `verb` creates or deletes anything: this user holds what it needs here (the
        support objects' permissions only where `objs` has them), else one line naming each."""
        k = KINDS[kind]
        present = {o["kind"] for o in objs} if objs is not None else set(SUPPORT)
        skip = {SUPPORT[kind_][2] for kind_ in SUPPORT if kind_ not in present}
        wanted = [p for p in rbac.needs(verb, k.group, k.plural) if p.resource not in skip]
        rbac.require(self.client, namespace, wanted, verb, k.backend)

    def _delete_object(self, kind: str, name: str, namespace: str) -> None:
        core = self._core()
        with api_errors(f"deleting {kind}/{name}", self.host):
            if kind == "Secret":
                core.delete_namespaced_secret(name, namespace)
            elif kind == "PersistentVolumeClaim":
                core.delete_namespaced_persistent_volume_claim(name, namespace)
            elif kind in SUPPORT:
                group, version, plural = SUPPORT[kind]
                self._custom().delete_namespaced_custom_object(group, version, namespace, plural, name)
            else:
                group, version, plural = KINDS[kind].find()
                self._custom().delete_namespaced_custom_object(group, version, namespace, plural, name,
                                                               propagation_policy="Foreground")

    def _wait_gone(self, name: str, namespace: str, timeout: float = 120, poll: float = 1.0) -> None:
        if wait_saying(lambda: self.get_job(name, namespace), lambda job: job is None, timeout, poll,
                       lambda job, waited: None if job is None else
                       f"waiting for job {name} to be deleted ({waited}): its operator removes its pods first",
                       log.info) is not None:
            raise TimedOut(f"job {name!r} is still being deleted after {timeout:.0f} s; try again later")

