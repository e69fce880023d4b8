"""The official `kubernetes` client, set up from the user's kubeconfig (or in-cluster config),
with API failures turned into one-line errors that say what to do."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import Any

from fsdpkit.errors import UserError


class ClusterError(UserError):
    """The cluster refused or could not be reached: not a bad flag, but still the user's to fix."""

    exit_code = 3


def _kubernetes():
    try:
        import kubernetes
    except ImportError:
        raise UserError("the Kubernetes client is not installed: pip install 'fsdpkit[cloud]'") from None
    return kubernetes


def connect(context: str | None = None, kubeconfig: str | None = None, eks_cluster: str | None = None,
            region: str | None = None) -> Any:
    """An ApiClient for the current (or named) kubeconfig context, an EKS cluster by name (no
    kubeconfig needed), or the pod's service account."""
    k8s = _kubernetes()
    if eks_cluster:
        from fsdpkit.aws.eks import api_client

        if not region:
            raise UserError("--eks-cluster needs --region (for example --region us-west-2)")
        return api_client(eks_cluster, region)
    path = kubeconfig or os.environ.get("KUBECONFIG") or os.path.expanduser("~/.kube/config")
    first = path.split(os.pathsep)[0]
    if not os.path.exists(first) and "KUBERNETES_SERVICE_HOST" in os.environ and not context:
        k8s.config.load_incluster_config()
        return k8s.client.ApiClient()
    if not os.path.exists(first):
        raise ClusterError(f"no kubeconfig at {first}: set KUBECONFIG, or create one with "
                           "`aws eks update-kubeconfig --name CLUSTER --region REGION`")
    try:
        return k8s.config.new_client_from_config(config_file=first, context=context)
    except k8s.config.ConfigException as e:
        raise ClusterError(f"kubeconfig {first}: {str(e).splitlines()[0]}"
                           + (" (see `kubectl config get-contexts`)" if context else "")) from None


def api_message(e: Any) -> str:
    """The API server's own message from an ApiException body, else its reason."""
    import json

    try:
        return json.loads(e.body).get("message") or e.reason
    except (TypeError, ValueError, AttributeError):
        return str(getattr(e, "reason", e))


@contextlib.contextmanager
def api_errors(what: str, host: str | None = None) -> Iterator[None]:
    """Turn client failures into ClusterErrors naming the operation; 404s pass through to callers."""
    k8s = _kubernetes()
    import urllib3

    try:
        yield
    except k8s.client.ApiException as e:
        if e.status == 404:
            raise
        if e.status in (401, 403):
            raise ClusterError(f"{what}: the cluster refused ({e.status} {e.reason}): {api_message(e)}; check "
                               "your kubeconfig credentials and RBAC permissions") from None
        raise ClusterError(f"{what}: {e.status} {api_message(e)}") from None
    except urllib3.exceptions.HTTPError as e:
        where = f" at {host}" if host else ""
        raise ClusterError(f"{what}: cannot reach the Kubernetes API{where} ({type(e).__name__}); check the "
                           "kubeconfig context and your network or VPN") from None


def is_not_found(e: BaseException) -> bool:
    return getattr(e, "status", None) == 404
