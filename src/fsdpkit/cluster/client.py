"""The official `kubernetes` client, set up from the user's kubeconfig (or in-cluster config),
with API failures turned into one-line errors that say what to do."""

from __future__ import annotations

import contextlib
import os
import warnings
from collections.abc import Callable, Iterator, Mapping
from typing import Any, cast

from fsdpkit.aws import session as aws_session
from fsdpkit.aws.eks import api_client
from fsdpkit.cluster.admission import refusal
from fsdpkit.cluster.kubeconfig import in_cluster, kubeconfig_path
from fsdpkit.errors import UserError
from fsdpkit.readers import reading


class ClusterError(UserError):
    """The cluster refused or could not be reached: not a bad flag, but still the user's to fix
    (exit code 3); `code` names the kind for --json."""

    exit_code = 3

    code = "failed"


def _kubernetes() -> Any:
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
        if not region:
            raise UserError("--eks-cluster needs --region (for example --region us-west-2)")
        aws = aws_session.connect(region)  # credentials checked here, in one line, before any cluster call
        return api_client(eks_cluster, region, aws.session, aws.endpoint_url)
    first = kubeconfig_path(kubeconfig)
    if in_cluster(kubeconfig, context):
        k8s.config.load_incluster_config()
        return k8s.client.ApiClient()
    if not os.path.exists(first):
        raise ClusterError(f"no kubeconfig at {first}: set KUBECONFIG, or create one with "
                           "`aws eks update-kubeconfig --name CLUSTER --region REGION`", code="no_credentials")
    with reading(first, "kubeconfig"):  # a garbled file is one line, as a bad context is
        try:
            api = k8s.config.new_client_from_config(config_file=first, context=context)
        except k8s.config.ConfigException as e:
            raise ClusterError(f"kubeconfig {first}: {str(e).splitlines()[0]}"
                               + (" (see `kubectl config get-contexts`)" if context else "")) from None
    if not api.configuration.verify_ssl:
        # The kubeconfig says insecure-skip-tls-verify: the user's choice, as kubectl takes it without
        # a word; urllib3 would otherwise warn on every request of the verb.
        import urllib3

        warnings.filterwarnings("ignore", category=urllib3.exceptions.InsecureRequestWarning)
    return api


def api_message(e: Any) -> str:
    """The API server's own message from an ApiException body, else its reason."""
    import json

    try:
        return cast("str", json.loads(e.body).get("message") or e.reason)
    except (TypeError, ValueError, AttributeError):
        return str(getattr(e, "reason", e))


def translate(e: BaseException, what: str, host: str | None = None, not_found: bool = True) -> ClusterError | None:
    """The one-line ClusterError for a Kubernetes client failure (None for anything else):
    refused by an admission (named, with its rule), refused by authorization (401/403), not found,
    other API errors, unreachable."""
    k8s = _kubernetes()
    import urllib3

    if isinstance(e, k8s.client.ApiException):
        if e.status == 404:
            if not not_found:
                return None  # the caller decides what a missing object means
            return ClusterError(f"{what}: not found ({api_message(e)}); check the name and the namespace",
                                code="not_found")
        if e.status in (400, 403, 422) and (refused := refusal(api_message(e))) is not None:
            return ClusterError(f"{what}: {refused.line()}", code="refused")
        if e.status in (401, 403):
            return ClusterError(f"{what}: the cluster refused ({e.status} {e.reason}): {api_message(e)}; check "
                                "your kubeconfig credentials and RBAC permissions", code="access_denied")
        if e.status == 429:
            return ClusterError(f"{what}: the API server kept throttling (429); try again in a minute",
                                code="unreachable")
        return ClusterError(f"{what}: {e.status} {api_message(e)}")
    if isinstance(e, urllib3.exceptions.HTTPError):
        where = f" at {host}" if host else ""
        return ClusterError(f"{what}: cannot reach the Kubernetes API{where} ({type(e).__name__}); check the "
                            "kubeconfig context and your network or VPN", code="unreachable")
    if isinstance(e, k8s.config.ConfigException):
        return ClusterError(f"{what}: kubeconfig: {str(e).splitlines()[0]}", code="bad_input")
    return None


@contextlib.contextmanager
def api_errors(what: str, host: str | None = None, keep: Callable[[BaseException], bool] | None = None
               ) -> Iterator[None]:
    """Run API calls with their failures translated (see `translate`); 404s pass through to callers,
    which decide what a missing object means, and so does whatever `keep` picks (a 403 on a kind of
    job this user may not read is not a failure of a verb that reads another)."""
    try:
        yield
    except Exception as e:
        if keep is not None and keep(e):
            raise
        if (err := translate(e, what, host, not_found=False)) is None:
            raise
        raise err from None


def api_resources(custom: Any, group: str, version: str, host: str | None = None, what: str | None = None
                  ) -> set[str] | None:
    """The resources (plurals) an API group version serves, from discovery, which every
    authenticated user may read (system:discovery); None where the server does not serve it.
    `custom` is a CustomObjectsApi."""
    import json

    try:
        with api_errors(what or f"discovering {group}/{version}", host):
            found = custom.get_api_resources(group, version, _preload_content=False)
    except Exception as e:
        if is_not_found(e):
            return None
        raise
    return {str(r.get("name")) for r in json.loads(found.data or b"{}").get("resources") or []}


def is_not_found(e: BaseException) -> bool:
    return getattr(e, "status", None) == 404


def is_conflict(e: BaseException) -> bool:
    """409: the name is taken (a create's admission passed before storage said so)."""
    return getattr(e, "status", None) == 409


def is_forbidden(e: BaseException) -> bool:
    """RBAC (or another authorizer) refused this request: 403, its Status naming the verb and resource."""
    return getattr(e, "status", None) == 403


def labels_match(labels: Mapping[str, str] | None, wanted: Mapping[str, str | None]) -> bool:
    """Every wanted label (a wanted value of None asks only that the key is there). Also checked
    on our side after a labelSelector query, so a server (or proxy) that ignores the selector
    cannot mix objects."""
    labels = labels or {}
    return all(k in labels if v is None else labels.get(k) == v for k, v in wanted.items())


def label_selector(wanted: dict[str, str]) -> str:
    return ",".join(f"{k}={v}" for k, v in wanted.items())
