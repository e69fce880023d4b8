"""Which admission refused a create, and the rule it cited, read from the API server's message.

RBAC is not the only 403 a shared cluster answers: the admission plugins that run on every create
(a dry run too) refuse with 403 Forbidden or 400 as well, each in its own words, and the fix is in
the spec, not in the user's permissions. The patterns are those plugins' own messages:

- Pod Security admission (k8s.io/pod-security-admission): `violates PodSecurity "restricted:latest":
  allowPrivilegeEscalation != false (container "x" must set ...), ...`;
- Priority (plugin/pkg/admission/priority): `no PriorityClass with name high was found`;
- ResourceQuota: `exceeded quota: team-a, requested: ..., used: ..., limited: ...`, and
  `failed quota: team-a: must specify limits.memory` when a quota counts what the pod leaves out;
- LimitRanger: `maximum memory usage per Container is 64Gi, but limit is 1Ti`, and the 422 of a
  request above the default limit LimitRanger gave a container that set none: `...resources.requests:
  Invalid value: "96": must be less than or equal to cpu limit of 4`;
- a validating or mutating webhook (Kyverno, Gatekeeper, Kueue's own):
  `admission webhook "NAME" denied the request: ...`."""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class Refusal:
    admission: str   # which admission refused, as a person names it
    rule: str        # the rule it cited, in its own words
    fix: str         # what to change

    def line(self) -> str:
        return f"refused by {self.admission}: {self.rule}; {self.fix}"


def _pod_security(m: re.Match[str]) -> Refusal:
    level = m["level"].split(":")[0]
    fix = ("set `security: restricted` in the spec (an image that runs as a user other than root), or ask the "
           "cluster's admin for a namespace at the baseline level" if level == "restricted" else
           "remove what the rule names from the spec (hostPath volumes, privileged containers, host namespaces)")
    return Refusal(f'Pod Security admission (the namespace enforces "{m["level"]}")', m["rule"], fix)


def _priority(m: re.Match[str]) -> Refusal:
    return Refusal("the Priority admission plugin", f"priorityClassName {m['name']}: no such PriorityClass",
                   "pick one of `kubectl get priorityclasses`, or drop priority_class; with a queue, priority_class "
                   "names a Kueue WorkloadPriorityClass")


def _limits_fix(rule: str) -> str:
    """A quota that counts limits the pods leave out: memory's is the spec's to give; a CPU limit
    fsdpkit never sets (it would throttle the data loader and NCCL's threads)."""
    fixes = []
    if "limits.memory" in rule:
        fixes.append("set the spec's memory: (the pods' memory request and limit)")
    if "limits.cpu" in rule:
        fixes.append("ask the cluster's admin for a LimitRange default CPU limit in the namespace, or to drop the "
                     "quota on limits.cpu (fsdpkit sets no CPU limit: it would throttle training)")
    return "; ".join(fixes) or "give the limits it names"


_PATTERNS: list[tuple[re.Pattern[str], Callable[[re.Match[str]], Refusal]]] = [
    (re.compile(r'violates PodSecurity "(?P<level>[^"]+)": (?P<rule>.+)'), _pod_security),
    (re.compile(r"no PriorityClass with name (?P<name>\S+) was found"), _priority),
    # A quota on limits.cpu or limits.memory refuses a pod that gives none: the fix is to give them.
    (re.compile(r"(?P<rule>failed quota: .+must specify .+)"),
     lambda m: Refusal("ResourceQuota admission", m["rule"], _limits_fix(m["rule"]))),
    (re.compile(r"(?P<rule>(?:exceeded|failed) quota: .+)"),
     lambda m: Refusal("ResourceQuota admission", m["rule"],
                       "lower the spec's resources or nodes, or ask for more quota (`kubectl describe quota`)")),
    (re.compile(r"(?P<rule>(?:maximum|minimum) \S+ usage per (?:Container|Pod) is .+)"),
     lambda m: Refusal("LimitRange admission", m["rule"],
                       "fit the spec's cpu and memory to the namespace's LimitRange (`kubectl describe limitrange`)")),
    # LimitRanger gave a container without a limit the namespace's default one, which its request is
    # above: validation answers 422 about the request (ValidateResourceRequirements).
    (re.compile(r'(?P<rule>resources\.requests: Invalid value: "[^"]*": must be less than or equal to (?P<what>\S+) '
                r"limit(?: of \S+)?)"),
     lambda m: Refusal("LimitRange admission (its default limit)", m["rule"],
                       f"the namespace's LimitRange gives containers without a {m['what']} limit a default one below "
                       f"this request: set the spec's {m['what']} (requests and limits) within it, or ask for a larger "
                       "default (`kubectl describe limitrange`)")),
    (re.compile(r'admission webhook "(?P<name>[^"]+)" denied the request: (?P<rule>.+)'),
     lambda m: Refusal(f'the admission webhook "{m["name"]}"', m["rule"],
                       "change what the webhook names, or ask the cluster's admin about its policy")),
]


def refusal(message: str) -> Refusal | None:
    """The admission refusal in an API server message, or None (RBAC, validation, anything else)."""
    for pattern, build in _PATTERNS:
        if m := pattern.search(message):
            return build(m)
    return None
