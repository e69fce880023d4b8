"""The API server's authorization, as kube-apiserver does it for a user bound to a Role in one
namespace: the request's attributes (k8s.io/apiserver's RequestInfoFactory: verb from the method,
API group, resource, subresource, namespace, name), RBAC's rule match, the 403 Status it answers
(apierrors.NewForbidden with responsewriters' forbiddenMessage), and SelfSubjectAccessReview
answered from the same rules. Discovery is open to every authenticated user (system:discovery),
and so is creating a SelfSubjectAccessReview (system:basic-user)."""

from __future__ import annotations

from dataclasses import dataclass

# Websocket upgrades of these are also authorized as `create` (AuthorizePodWebsocketUpgradeCreatePermission,
# on by default since Kubernetes 1.30).
_CONNECT = ("exec", "attach", "portforward")


@dataclass(frozen=True)
class Attributes:
    verb: str
    group: str
    resource: str
    subresource: str
    namespace: str
    name: str
    path: str

    @property
    def is_resource(self) -> bool:
        return bool(self.resource)


def attributes(method: str, path: str, query: dict) -> Attributes:
    """RequestInfoFactory.NewRequestInfo, for the paths a client of the core and custom APIs sends."""
    parts = [p for p in path.split("/") if p]
    nonresource = Attributes(method.lower(), "", "", "", "", "", path)
    if not parts or parts[0] not in ("api", "apis"):
        return nonresource
    if parts[0] == "api":
        group, rest = "", parts[2:]
    else:
        if len(parts) < 3:
            return nonresource
        group, rest = parts[1], parts[3:]
    if not rest:
        return nonresource  # discovery of a group version
    namespace = ""
    if rest[0] == "namespaces" and len(rest) >= 2:
        namespace = rest[1]
        rest = rest[2:] if len(rest) > 2 else ["namespaces", rest[1]]
    resource = rest[0]
    name = rest[1] if len(rest) > 1 else ""
    sub = rest[2] if len(rest) > 2 else ""
    method = method.upper()
    if method == "GET":
        verb = "get" if name else ("watch" if str(query.get("watch", "")).lower() in ("1", "true") else "list")
    elif method == "DELETE":
        verb = "delete" if name else "deletecollection"
    else:
        verb = {"POST": "create", "PUT": "update", "PATCH": "patch"}.get(method, method.lower())
    return Attributes(verb, group, resource, sub, namespace, name, path)


def _matches(rule: dict, verb: str, group: str, resource: str, name: str) -> bool:
    def has(values, value):
        return "*" in values or value in values

    return (has(rule.get("verbs", []), verb) and has(rule.get("apiGroups", []), group)
            and has(rule.get("resources", []), resource)
            and (not rule.get("resourceNames") or name in rule["resourceNames"]))


def allowed(rules: list[dict], role_namespace: str, verb: str, group: str, resource: str, subresource: str,
            namespace: str, name: str = "") -> bool:
    """RBAC: a Role's rules hold only in its own namespace; `resource/subresource` is its own name."""
    if namespace != role_namespace:
        return False
    full = f"{resource}/{subresource}" if subresource else resource
    return any(_matches(rule, verb, group, full, name) for rule in rules)


def checks(a: Attributes) -> list[str]:
    """The verbs the request is authorized for, in order."""
    if a.verb == "get" and a.resource == "pods" and a.subresource in _CONNECT:
        return ["get", "create"]
    return [a.verb]


def forbidden_message(user: str, a: Attributes, verb: str) -> str:
    if not a.is_resource:
        return f'forbidden: User "{user}" cannot {verb} path "{a.path}"'
    resource = f"{a.resource}/{a.subresource}" if a.subresource else a.resource
    where = f'in the namespace "{a.namespace}"' if a.namespace else "at the cluster scope"
    why = f'User "{user}" cannot {verb} resource "{resource}" in API group "{a.group}" {where}'
    qualified = f"{a.resource}.{a.group}" if a.group else a.resource
    return f'{qualified} "{a.name}" is forbidden: {why}' if a.name else f"{qualified} is forbidden: {why}"


def forbidden_status(user: str, a: Attributes, verb: str) -> dict:
    """The Status body kube-apiserver answers a refused request with (metav1.Status, omitempty)."""
    details = {k: v for k, v in (("name", a.name), ("group", a.group), ("kind", a.resource)) if v}
    return {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
            "message": forbidden_message(user, a, verb), "reason": "Forbidden", "details": details, "code": 403}


def access_review(review: dict, user: str, rules: list[dict] | None, role_namespace: str) -> dict:
    """A SelfSubjectAccessReview answered: `rules` None is the cluster's admin (allowed)."""
    ra = (review.get("spec") or {}).get("resourceAttributes") or {}
    ok = rules is None or allowed(rules, role_namespace, ra.get("verb", ""), ra.get("group", ""),
                                  ra.get("resource", ""), ra.get("subresource", ""), ra.get("namespace", ""),
                                  ra.get("name", ""))
    status = {"allowed": ok}
    if ok and rules is not None:
        status["reason"] = f'RBAC: allowed by RoleBinding "fsdpkit/{role_namespace}" of Role "fsdpkit" to User "{user}"'
    return {"kind": "SelfSubjectAccessReview", "apiVersion": "authorization.k8s.io/v1",
            "metadata": {"creationTimestamp": None}, "spec": review.get("spec") or {}, "status": status}
