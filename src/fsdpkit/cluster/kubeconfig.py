"""Which kubeconfig a verb reads and the namespace it acts in when none is given, as kubectl
decides both: the context's `namespace:` (the named context, else the current one), in a pod the
service account's namespace, else `default`. A team's user on a shared cluster has a Role in their
namespace only; a verb that went to `default` instead would be refused on every call.

Read with YAML alone (no Kubernetes client): `job render` resolves the namespace in an install
that has no cluster extras."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from fsdpkit import yamlfile
from fsdpkit.readers import reading

DEFAULT = "default"
# Where the kubelet mounts a pod's service account; its namespace is the pod's (kubectl reads it too).
SERVICE_ACCOUNT_NAMESPACE = Path("/var/run/secrets/kubernetes.io/serviceaccount/namespace")


def kubeconfig_path(kubeconfig: str | None = None) -> str:
    """--kubeconfig, else $KUBECONFIG's first file, else ~/.kube/config: the file the client loads."""
    path = kubeconfig or os.environ.get("KUBECONFIG") or os.path.expanduser("~/.kube/config")
    return path.split(os.pathsep)[0]


def in_cluster(kubeconfig: str | None = None, context: str | None = None) -> bool:
    """In a pod with no kubeconfig: the client uses the pod's service account."""
    return not os.path.exists(kubeconfig_path(kubeconfig)) and "KUBERNETES_SERVICE_HOST" in os.environ \
        and not context


def context_namespace(context: str | None = None, kubeconfig: str | None = None) -> str | None:
    """The namespace the kubeconfig's context (`context`, else its current-context) names; in a pod
    without a kubeconfig, the service account's; None where neither says one. A context named that
    the file does not have is left to the client, which refuses it in one line."""
    path = kubeconfig_path(kubeconfig)
    if in_cluster(kubeconfig, context):
        try:
            return SERVICE_ACCOUNT_NAMESPACE.read_text().strip() or None
        except OSError:
            return None
    if not os.path.exists(path):
        return None
    with reading(path, "kubeconfig"):
        doc: Any = yamlfile.load(Path(path).read_text()) or {}
        name = context or doc.get("current-context")
        for entry in doc.get("contexts") or []:
            if isinstance(entry, dict) and entry.get("name") == name:
                namespace = (entry.get("context") or {}).get("namespace")
                return str(namespace) if namespace else None
    return None


def namespace(given: str | None, context: str | None = None, kubeconfig: str | None = None) -> str:
    """The namespace a verb acts in: `given` (-n, or a spec's namespace:), else the context's, else default."""
    return given or context_namespace(context, kubeconfig) or DEFAULT
