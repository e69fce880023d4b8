"""Admission refusals named from the API server's message: each plugin's own wording (the ones a
training job meets on a shared cluster), through the client error translation every create uses."""

from __future__ import annotations

import json

import pytest

from fsdpkit.cluster.admission import refusal
from fsdpkit.cluster.client import translate

from conftest import require

# What kube-apiserver answers (the Status message after `pods "x" is forbidden: `), as each plugin
# words it: pod-security-admission, priority, resourcequota, limitranger, a webhook (Kyverno).
REFUSALS = [
    ('pods "j-master-0" is forbidden: violates PodSecurity "restricted:latest": runAsNonRoot != true (pod or '
     'container "pytorch" must set securityContext.runAsNonRoot=true)', 403,
     'refused by Pod Security admission (the namespace enforces "restricted:latest"): runAsNonRoot != true (pod or '
     'container "pytorch" must set securityContext.runAsNonRoot=true); set `security: restricted` in the spec (an '
     "image that runs as a user other than root), or ask the cluster's admin for a namespace at the baseline level"),
    ('pods "j-master-0" is forbidden: violates PodSecurity "baseline:v1.33": hostPath volumes (volume "data")', 403,
     'refused by Pod Security admission (the namespace enforces "baseline:v1.33"): hostPath volumes (volume "data"); '
     "remove what the rule names from the spec (hostPath volumes, privileged containers, host namespaces)"),
    ('pods "j-master-0" is forbidden: no PriorityClass with name high was found', 403,
     "refused by the Priority admission plugin: priorityClassName high: no such PriorityClass; pick one of `kubectl "
     "get priorityclasses`, or drop priority_class; with a queue, priority_class names a Kueue "
     "WorkloadPriorityClass"),
    ('pods "j-master-0" is forbidden: exceeded quota: team-a, requested: requests.nvidia.com/gpu=8, used: '
     'requests.nvidia.com/gpu=8, limited: requests.nvidia.com/gpu=8', 403,
     "refused by ResourceQuota admission: exceeded quota: team-a, requested: requests.nvidia.com/gpu=8, used: "
     "requests.nvidia.com/gpu=8, limited: requests.nvidia.com/gpu=8; lower the spec's resources or nodes, or ask for "
     "more quota (`kubectl describe quota`)"),
    # A quota on limits the pods leave out: the fix is the limit, not less of anything.
    ('pods "j-master-0" is forbidden: failed quota: team-a: must specify limits.cpu for: pytorch; limits.memory '
     "for: pytorch", 403,
     "refused by ResourceQuota admission: failed quota: team-a: must specify limits.cpu for: pytorch; limits.memory "
     "for: pytorch; set the spec's memory: (the pods' memory request and limit); ask the cluster's admin for a "
     "LimitRange default CPU limit in the namespace, or to drop the quota on limits.cpu (fsdpkit sets no CPU limit: "
     "it would throttle training)"),
    ('pods "j-master-0" is forbidden: maximum memory usage per Container is 512Gi, but limit is 1Ti', 403,
     "refused by LimitRange admission: maximum memory usage per Container is 512Gi, but limit is 1Ti; fit the "
     "spec's cpu and memory to the namespace's LimitRange (`kubectl describe limitrange`)"),
    # LimitRanger's default limit below the pod's request: validation's 422, named as the LimitRange's.
    ('Pod "j-master-0" is invalid: spec.containers[0].resources.requests: Invalid value: "96": must be less than '
     "or equal to cpu limit of 4", 422,
     'refused by LimitRange admission (its default limit): resources.requests: Invalid value: "96": must be less '
     "than or equal to cpu limit of 4; the namespace's LimitRange gives containers without a cpu limit a default "
     "one below this request: set the spec's cpu (requests and limits) within it, or ask for a larger default "
     "(`kubectl describe limitrange`)"),
    ('admission webhook "validate.kyverno.svc-fail" denied the request: resource Pod/default/j-master-0 was blocked '
     "due to the following policies require-team-label", 400,
     'refused by the admission webhook "validate.kyverno.svc-fail": resource Pod/default/j-master-0 was blocked due '
     "to the following policies require-team-label; change what the webhook names, or ask the cluster's admin "
     "about its policy"),
]


@pytest.mark.parametrize(("message", "status", "line"), REFUSALS, ids=["psa-restricted", "psa-baseline", "priority",
                                                                       "quota", "quota-unset", "limitrange",
                                                                       "limitrange-default", "webhook"])
def test_an_admission_refusal_is_one_line_naming_the_admission_and_its_rule(message, status, line):
    assert refusal(message).line() == line
    k8s = require("kubernetes")
    e = k8s.client.ApiException(status=status, reason="Forbidden" if status == 403 else "Bad Request")
    e.body = json.dumps({"kind": "Status", "apiVersion": "v1", "status": "Failure", "message": message,
                         "reason": "Forbidden" if status == 403 else "BadRequest", "code": status})
    err = translate(e, "creating Pod/j-master-0")
    assert (str(err), err.code, err.exit_code) == (f"creating Pod/j-master-0: {line}", "refused", 3)


def test_rbac_s_refusal_is_not_an_admission_s():
    """RBAC's 403 names a verb and a resource: a missing permission, not a rule of the spec."""
    message = ('pods is forbidden: User "system:serviceaccount:team-a:ci" cannot create resource "pods" in API '
               'group "" in the namespace "team-a"')
    assert refusal(message) is None
    k8s = require("kubernetes")
    e = k8s.client.ApiException(status=403, reason="Forbidden")
    e.body = json.dumps({"kind": "Status", "message": message, "code": 403})
    assert translate(e, "creating Pod/j").code == "access_denied"
