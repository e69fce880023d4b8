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


@dataclass
class PodAdmission:
    """The cluster's PriorityClasses (besides the built-in two) and each namespace's Pod Security
    enforce label."""

    priority_classes: set[str] = field(default_factory=set)
    enforce: dict[str, str] = field(default_factory=dict)

    def refuse(self, namespace: str, pod: dict) -> dict | None:
        """The 403 Status the API server answers this Pod create with, or None to admit it."""
        name = (pod.get("metadata") or {}).get("name", "")
        wanted = (pod.get("spec") or {}).get("priorityClassName")
        if wanted and wanted not in self.priority_classes | BUILTIN_PRIORITY_CLASSES:
            return forbidden(name, f"no PriorityClass with name {wanted} was found")
        level = self.enforce.get(namespace, "privileged")
        if violations := pod_security_violations(pod, level):
            return forbidden(name, f'violates PodSecurity "{level}:latest": {", ".join(violations)}')
        return None
