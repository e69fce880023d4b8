"""What fsdpkit's verbs may do on a shared cluster, where a team is given a Role in its namespace and
nothing cluster-wide: the permissions each verb needs (one table), the minimal Role and RoleBinding
that grant them (`fsdpkit cluster rbac`, for the cluster's admin), and the preflight that asks the
API server, before anything is created, whether this user holds them (SelfSubjectAccessReview: it
goes through every authorizer the cluster runs, EKS access entries included, where a
SelfSubjectRulesReview would miss the webhook's)."""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from fsdpkit.cluster import kueue, trainer
from fsdpkit.cluster.client import ClusterError, api_errors, is_forbidden, is_not_found

# The job kind of the verb's backend (TrainJob, PyTorchJob, HyperPodPyTorchJob), filled in per backend.
JOB = "JOB"


@dataclass(frozen=True, order=True)
class Permission:
    verb: str
    group: str       # "" for the core API
    resource: str    # a resource, or resource/subresource (pods/log)
    optional: bool = False   # without it the verb still works and names what it could not read

    def __str__(self) -> str:
        base, _, sub = self.resource.partition("/")
        qualified = f"{base}.{self.group}" if self.group else base
        return f"{self.verb} {qualified}" + (f"/{sub}" if sub else "")

    def of(self, group: str, plural: str) -> Permission:
        """This permission with the job kind placeholder filled in."""
        if self.resource != JOB:
            return self
        return Permission(self.verb, group, plural, self.optional)


def _p(verbs: str, resource: str, group: str = "", optional: bool = False) -> list[Permission]:
    return [Permission(v, group, resource, optional) for v in verbs.split(",")]


# Each verb's needs. A support object (the HF token Secret, the PVC fsdpkit creates) is read to find
# what exists, created, and deleted again if a later create fails (the rollback); `job delete`
# finds the job's Secret (and PVC) by label. Reading a pod's log or running the sampling script in
# it is optional where a verb still answers without it.
# A job with DRA claims also has its claim template (and a TrainJob its own runtime) made and removed
# with it; a job without them needs neither permission.
_DEVICES = "resourceclaimtemplates", "resource.k8s.io"
_RUNTIME = "trainingruntimes", trainer.GROUP
_QUOTAS = _p("list", "resourcequotas", optional=True)
_EVENTS = _p("list", "events", optional=True)
# A job on a queue: its LocalQueue must exist (read before anything is made; unread: said).
_QUEUE = _p("get", "localqueues", kueue.GROUP, optional=True)
VERB_NEEDS: dict[str, list[Permission]] = {
    # On a Kueue queue, its verdict is read from the job's Workload (said as unread without it).
    # Every submit first sends each pod the operator will make as a Pod with dryRun=All (admission
    # speaks to pods), and holds the job's pods in all to the namespace's ResourceQuotas (unread: said).
    "job submit": [*_p("get,create", JOB), *_p("get,create,delete", "secrets"),
                   *_p("get,create,delete", "persistentvolumeclaims"), *_p("get,create,delete", *_DEVICES),
                   *_p("get,create,delete", *_RUNTIME), *_p("create", "pods"), *_QUOTAS, *_QUEUE,
                   *_p("list", "workloads", kueue.GROUP, optional=True)],
    "job submit --replace": [*_p("get,create,delete", JOB), *_p("get,list,create,delete", "secrets"),
                             *_p("get,create,delete", "persistentvolumeclaims"), *_p("get,create,delete", *_DEVICES),
                             *_p("get,create,delete", *_RUNTIME), *_p("create", "pods"), *_QUOTAS, *_QUEUE],
    "job submit --dry-run=server": [*_p("get,create", JOB), *_p("get,create", "secrets"),
                                    *_p("get,create", "persistentvolumeclaims"), *_p("get,create", *_DEVICES),
                                    *_p("get,create", *_RUNTIME), *_p("create", "pods"), *_QUOTAS, *_QUEUE],
    # A job with no running pods says why from its events (unread: said).
    "job status": [*_p("get", JOB), *_p("list", "pods"), *_p("get", "pods/log", optional=True), *_EVENTS],
    "job wait": [*_p("get", JOB), *_EVENTS],
    # A Failed job within its resubmission budget is made again: delete, then create.
    "job wait (resubmit)": _p("get,create,delete", JOB),
    "job logs": [*_p("get", JOB), *_p("list", "pods"), *_p("get", "pods/log")],
    # Websocket exec is authorized as get and, since Kubernetes 1.30, as create as well.
    "job watch": [*_p("get", JOB), *_p("list", "pods"), *_p("get", "pods/log"),
                  *_p("get,create", "pods/exec", optional=True), *_EVENTS],
    "job list": _p("list", JOB),
    "job delete": [*_p("get,delete", JOB), *_p("list,delete", "secrets"), *_p("delete", *_DEVICES),
                   *_p("delete", *_RUNTIME)],
    "job delete --delete-storage": [*_p("get,delete", JOB), *_p("list,delete", "secrets"),
                                    *_p("list,delete", "persistentvolumeclaims"), *_p("delete", *_DEVICES),
                                    *_p("delete", *_RUNTIME)],
    "deploy": [*_p("get,create", JOB), *_p("get,create,delete", "secrets"),
               *_p("get,create,delete", "persistentvolumeclaims"), *_p("get,create,delete", *_DEVICES),
               *_p("get,create,delete", *_RUNTIME), *_p("create", "pods"), *_QUOTAS, *_QUEUE],
}


def needs(verb: str, group: str, plural: str) -> list[Permission]:
    """What `verb` needs with this backend's job kind: a TrainJob's own runtime only for TrainJobs."""
    return [p.of(group, plural) for p in VERB_NEEDS[verb]
            if p.resource != _RUNTIME[0] or (group, plural) == (trainer.GROUP, "trainjobs")]


def role_rules(kinds: Iterable[tuple[str, str]]) -> list[dict[str, Any]]:
    """The union of every verb's needs for these job kinds ((group, plural) each) as Role rules: one
    rule per API group and resource, its verbs sorted, in a stable order."""
    merged: dict[tuple[str, str], set[str]] = {}
    for group, plural in kinds:
        for verb in VERB_NEEDS:
            for p in needs(verb, group, plural):
                merged.setdefault((p.group, p.resource), set()).add(p.verb)
    return [{"apiGroups": [g], "resources": [r], "verbs": sorted(v)} for (g, r), v in sorted(merged.items())]


def role_manifests(namespace: str, name: str, kinds: Iterable[tuple[str, str]], user: str | None = None,
                   service_account: str | None = None, group: str | None = None) -> list[dict[str, Any]]:
    """The Role (and, given a subject, its RoleBinding) a team needs to run fsdpkit's job verbs in
    `namespace` on these job kinds. A service account is NAME (in `namespace`) or NAMESPACE:NAME."""
    labels = {"app.kubernetes.io/managed-by": "fsdpkit"}
    role = {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role",
            "metadata": {"name": name, "namespace": namespace, "labels": labels},
            "rules": role_rules(kinds)}
    subjects: list[dict[str, str]] = []
    if user:
        subjects.append({"kind": "User", "name": user, "apiGroup": "rbac.authorization.k8s.io"})
    if group:
        subjects.append({"kind": "Group", "name": group, "apiGroup": "rbac.authorization.k8s.io"})
    if service_account:
        sa_namespace, _, sa = service_account.rpartition(":")
        subjects.append({"kind": "ServiceAccount", "name": sa, "namespace": sa_namespace or namespace})
    if not subjects:
        return [role]
    binding = {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding",
               "metadata": {"name": name, "namespace": namespace, "labels": labels},
               "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": name},
               "subjects": subjects}
    return [role, binding]


def missing(api_client: Any, namespace: str, permissions: Iterable[Permission]) -> list[Permission] | None:
    """The permissions this user lacks in `namespace`, each asked of the API server with a
    SelfSubjectAccessReview; None when the server cannot be asked (no such API, or reviews refused)."""
    from kubernetes import client

    api = client.AuthorizationV1Api(api_client)
    lacking = []
    for p in dict.fromkeys(permissions):
        base, _, sub = p.resource.partition("/")
        review = {"apiVersion": "authorization.k8s.io/v1", "kind": "SelfSubjectAccessReview",
                  "spec": {"resourceAttributes": {"namespace": namespace, "verb": p.verb, "group": p.group,
                                                  "resource": base, **({"subresource": sub} if sub else {})}}}
        try:
            with api_errors(f"asking whether this user may {p}", api_client.configuration.host, keep=is_forbidden):
                answer = api.create_self_subject_access_review(review, _preload_content=False)
        except Exception as e:
            if is_not_found(e) or is_forbidden(e):
                return None
            raise
        if not (json.loads(answer.data or b"{}").get("status") or {}).get("allowed"):
            lacking.append(p)
    return lacking


def require(api_client: Any, namespace: str, permissions: Iterable[Permission], what: str, backend: str) -> None:
    """Before `what` creates or deletes anything: every required permission is held, else one line
    naming each missing verb and resource and the namespace, and the Role that grants them."""
    wanted = [p for p in permissions if not p.optional]
    lacking = missing(api_client, namespace, wanted)
    if lacking:
        raise ClusterError(f"{what}: this user may not {', '.join(map(str, lacking))} in namespace {namespace}; "
                           f"ask the cluster's admin to bind the Role `fsdpkit cluster rbac --namespace {namespace} "
                           f"--backend {backend}` renders", code="access_denied")
