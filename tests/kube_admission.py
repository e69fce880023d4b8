"""The admission a Pod create meets in kube-apiserver, for KubeMock: the Priority plugin (mutating,
so first) and Pod Security admission (validating), each refusing as the real one does, dry runs
included (admission runs before storage, whatever dryRun says).

- Priority (plugin/pkg/admission/priority/admission.go): a priorityClassName that names no
  PriorityClass is `admission.NewForbidden(a, "no PriorityClass with name %v was found")`.
- Pod Security (k8s.io/pod-security-admission): the namespace's enforce level; each check that
  fails is `REASON (DETAIL)`, the checks in the order of their IDs, joined by ", " after
  `violates PodSecurity "LEVEL:latest": `, in a 403 Forbidden for the pod. The checks here are the
  ones a training pod can fail: baseline's privileged, host namespaces, hostPath volumes and added
  capabilities, and restricted's privilege escalation, capabilities, runAsNonRoot, runAsUser=0,
  seccomp and volume types. Their wording is policy/check_*.go's."""

from __future__ import annotations

from dataclasses import dataclass, field

BUILTIN_PRIORITY_CLASSES = {"system-node-critical", "system-cluster-critical"}
# check_capabilities_baseline.go: what a baseline container may add.
BASELINE_CAPABILITIES = {"AUDIT_WRITE", "CHOWN", "DAC_OVERRIDE", "FOWNER", "FSETID", "KILL", "MKNOD",
                         "NET_BIND_SERVICE", "SETFCAP", "SETGID", "SETPCAP", "SETUID", "SYS_CHROOT"}
# check_restrictedVolumes.go: the only volume types the restricted level allows.
RESTRICTED_VOLUMES = {"configMap", "csi", "downwardAPI", "emptyDir", "ephemeral", "persistentVolumeClaim",
                      "projected", "secret"}
_VOLUME_TYPES = ("hostPath", "nfs", "iscsi", "rbd", "cephfs", "glusterfs", "flexVolume", "awsElasticBlockStore",
                 "gcePersistentDisk", "configMap", "csi", "downwardAPI", "emptyDir", "ephemeral",
                 "persistentVolumeClaim", "projected", "secret")


def _containers(pod: dict) -> list[dict]:
    spec = pod.get("spec") or {}
    return [*(spec.get("initContainers") or []), *(spec.get("containers") or [])]


def _named(what: str, names: list[str]) -> str:
    """`container "a"` / `containers "a", "b"`, as the checks' withBadContainer helper writes them."""
    quoted = ", ".join(f'"{n}"' for n in names)
    return f"{what} {quoted}" if len(names) == 1 else f"{what}s {quoted}"


def _baseline(pod: dict) -> list[tuple[str, str]]:
    spec = pod.get("spec") or {}
    out = []
    added = {c["name"]: [cap for cap in ((c.get("securityContext") or {}).get("capabilities") or {}).get("add") or []
                         if cap not in BASELINE_CAPABILITIES] for c in _containers(pod)}
    if bad := [n for n, caps in added.items() if caps]:
        caps = ", ".join('"' + cap + '"' for cap in sorted({cap for n in bad for cap in added[n]}))
        out.append(("capabilities_baseline", f"non-default capabilities ({_named('container', bad)} must not "
                                             f"include {caps} in securityContext.capabilities.add)"))
    hosts = [f"{k}=true" for k in ("hostNetwork", "hostPID", "hostIPC") if spec.get(k)]
    if hosts:
        out.append(("hostNamespaces", f"host namespaces ({', '.join(hosts)})"))
    if paths := [v["name"] for v in spec.get("volumes") or [] if "hostPath" in v]:
        out.append(("hostPathVolumes", f"hostPath volumes ({_named('volume', paths)})"))
    if priv := [c["name"] for c in _containers(pod) if (c.get("securityContext") or {}).get("privileged")]:
        out.append(("privileged", f"privileged ({_named('container', priv)} must not set "
                                  "securityContext.privileged=true)"))
    return out


def _restricted(pod: dict) -> list[tuple[str, str]]:
    spec = pod.get("spec") or {}
    psc = spec.get("securityContext") or {}
    out = []
    ctx = {c["name"]: c.get("securityContext") or {} for c in _containers(pod)}
    if bad := [n for n, s in ctx.items() if s.get("allowPrivilegeEscalation") is not False]:
        out.append(("allowPrivilegeEscalation", f"allowPrivilegeEscalation != false ({_named('container', bad)} must "
                                                "set securityContext.allowPrivilegeEscalation=false)"))
    if bad := [n for n, s in ctx.items() if "ALL" not in ((s.get("capabilities") or {}).get("drop") or [])]:
        out.append(("capabilities_restricted", f"unrestricted capabilities ({_named('container', bad)} must set "
                                               'securityContext.capabilities.drop=["ALL"])'))
    types = {v["name"]: next((t for t in _VOLUME_TYPES if t in v), "") for v in spec.get("volumes") or []}
    if bad := [n for n, t in types.items() if t not in RESTRICTED_VOLUMES]:
        out.append(("restrictedVolumes", f"restricted volume types ({_named('volume', bad)} uses restricted volume "
                                         f'type "{types[bad[0]]}")'))
    non_root = [n for n, s in ctx.items() if s.get("runAsNonRoot", psc.get("runAsNonRoot")) is not True]
    if non_root:
        out.append(("runAsNonRoot", f"runAsNonRoot != true (pod or {_named('container', non_root)} must set "
                                    "securityContext.runAsNonRoot=true)"))
    if psc.get("runAsUser") == 0 or any(s.get("runAsUser") == 0 for s in ctx.values()):
        out.append(("runAsUser", "runAsUser=0 (pod must not set runAsUser=0)"))
    seccomp = [n for n, s in ctx.items()
               if ((s.get("seccompProfile") or psc.get("seccompProfile") or {}).get("type")) not in
               ("RuntimeDefault", "Localhost")]
    if seccomp:
        out.append(("seccompProfile_restricted", f"seccompProfile (pod or {_named('container', seccomp)} must set "
                                                 'securityContext.seccompProfile.type to "RuntimeDefault" or '
                                                 '"Localhost")'))
    return out


def pod_security_violations(pod: dict, level: str) -> list[str]:
    """Every check of `level` the pod fails, in the order of the checks' IDs."""
    if level == "privileged":
        return []
    found = _baseline(pod) + (_restricted(pod) if level == "restricted" else [])
    return [text for _, text in sorted(found, key=lambda f: f[0].lower())]


def forbidden(name: str, message: str) -> dict:
    return {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
            "message": f'pods "{name}" is forbidden: {message}', "reason": "Forbidden",
            "details": {"name": name, "kind": "pods"}, "code": 403}


def invalid(name: str, field_path: str, value: str, detail: str) -> dict:
    """The 422 a pod that fails validation gets (apierrors.NewInvalid with one field error)."""
    message = f'Pod "{name}" is invalid: {field_path}: Invalid value: "{value}": {detail}'
    return {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure", "message": message,
            "reason": "Invalid", "details": {"name": name, "kind": "Pod"}, "code": 422}


def _quantity(value) -> float:
    units = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "m": 1e-3}
    text = str(value)
    for unit, scale in units.items():
        if text.endswith(unit):
            return float(text[: -len(unit)]) * scale
    return float(text)


@dataclass
class PodAdmission:
    """The cluster's PriorityClasses (besides the built-in two), each namespace's Pod Security
    enforce label, its ResourceQuotas ({name: {resource: hard}}, what they count used: {name:
    {resource: used}}) and its LimitRange's default container limits ({resource: limit})."""

    priority_classes: set[str] = field(default_factory=set)
    enforce: dict[str, str] = field(default_factory=dict)
    quotas: dict[str, dict[str, dict[str, str]]] = field(default_factory=dict)
    used: dict[str, dict[str, dict[str, str]]] = field(default_factory=dict)
    default_limits: dict[str, dict[str, str]] = field(default_factory=dict)

    def refuse(self, namespace: str, pod: dict) -> dict | None:
        """The Status the API server answers this Pod create with, or None to admit it: mutating
        admission first (Priority, LimitRanger's defaults), then validation, then the validating
        plugins (Pod Security, ResourceQuota)."""
        name = (pod.get("metadata") or {}).get("name", "")
        wanted = (pod.get("spec") or {}).get("priorityClassName")
        if wanted and wanted not in self.priority_classes | BUILTIN_PRIORITY_CLASSES:
            return forbidden(name, f"no PriorityClass with name {wanted} was found")
        # LimitRanger sets its default limit where a container gives none; validation then refuses
        # a request above that limit (pkg/apis/core/validation: ValidateResourceRequirements).
        for i, c in enumerate(_containers(pod)):
            res = c.get("resources") or {}
            for resource, limit in self.default_limits.get(namespace, {}).items():
                request = (res.get("requests") or {}).get(resource)
                if resource not in (res.get("limits") or {}) and request is not None and \
                        _quantity(request) > _quantity(limit):
                    return invalid(name, f"spec.containers[{i}].resources.requests", str(request),
                                   f"must be less than or equal to {resource} limit of {limit}")
        level = self.enforce.get(namespace, "privileged")
        if violations := pod_security_violations(pod, level):
            return forbidden(name, f'violates PodSecurity "{level}:latest": {", ".join(violations)}')
        return self._quota(namespace, name, pod)

    def _quota(self, namespace: str, name: str, pod: dict) -> dict | None:
        """plugin/pkg/admission/resourcequota: a quota on limits.X refuses a pod that gives none
        ("must specify"); one the pod would take past its hard limit, "exceeded quota"."""
        for quota, hard in self.quotas.get(namespace, {}).items():
            used = self.used.get(namespace, {}).get(quota, {})
            missing = [r for r in hard if r.startswith("limits.") and any(
                r.removeprefix("limits.") not in ((c.get("resources") or {}).get("limits") or {})
                for c in _containers(pod))]
            if missing:
                names = ",".join(c.get("name", "") for c in _containers(pod))
                return forbidden(name, f"failed quota: {quota}: must specify " + "; ".join(
                    f"{r} for: {names}" for r in sorted(missing)))
            over = []
            for resource, limit in hard.items():
                field_name, _, what = resource.partition(".") if "." in resource else ("requests", ".", resource)
                asked = sum(_quantity(((c.get("resources") or {}).get(field_name) or {}).get(what, 0))
                            for c in _containers(pod))
                if asked and asked + _quantity(used.get(resource, 0)) > _quantity(limit):
                    over.append((resource, asked, used.get(resource, "0"), limit))
            if over:
                requested = ",".join(f"{r}={int(a)}" for r, a, _, _ in over)
                return forbidden(name, f"exceeded quota: {quota}, requested: {requested}, used: "
                                       + ",".join(f"{r}={u}" for r, _, u, _ in over) + ", limited: "
                                       + ",".join(f"{r}={h}" for r, _, _, h in over))
        return None
