"""EKS access without the aws CLI: the bearer token `aws eks get-token` makes (a presigned STS
GetCallerIdentity URL bound to the cluster name), and a Kubernetes client configuration from
DescribeCluster."""

from __future__ import annotations

import atexit
import base64
import contextlib
import datetime as dt
import os
import tempfile
from typing import Any

from fsdpkit.aws.session import AwsError, aws_errors
from fsdpkit.errors import UserError

TOKEN_PREFIX = "k8s-aws-v1."
CLUSTER_HEADER = "x-k8s-aws-id"
URL_EXPIRES_S = 60          # what aws-iam-authenticator accepts
TOKEN_LIFETIME = dt.timedelta(minutes=14)  # the CLI reports 14 minutes: refresh before 15


# The CA files this process wrote, by content: the client reads the CA from a file for as long as it
# connects, so each is written once per process (an MCP server connects many times) and removed when
# the process ends, as the kubernetes client's own kubeconfig loader does with its files.
_CA_FILES: dict[bytes, str] = {}


def _remove_ca_files() -> None:
    for path in _CA_FILES.values():
        with contextlib.suppress(OSError):
            os.unlink(path)
    _CA_FILES.clear()


def ca_file(pem: bytes) -> str:
    """A file holding the CA certificate `pem`, for this process's life."""
    if pem not in _CA_FILES:
        if not _CA_FILES:
            atexit.register(_remove_ca_files)
        with tempfile.NamedTemporaryFile(prefix="fsdpkit-eks-ca-", suffix=".crt", delete=False) as ca:
            ca.write(pem)
        _CA_FILES[pem] = ca.name
    return _CA_FILES[pem]


def _boto3() -> Any:
    try:
        import boto3
    except ImportError:
        raise UserError("boto3 is not installed: pip install 'fsdpkit[cloud]'") from None
    return boto3


def get_token(cluster: str, region: str, session: Any = None, endpoint_url: str | None = None) -> dict[str, str]:
    """{"token": "k8s-aws-v1.<base64url of the presigned URL, unpadded>", "expiration": ISO time}."""
    session = session or _boto3().Session(region_name=region)
    sts = session.client("sts", region_name=region, endpoint_url=endpoint_url)

    def add_header(request: Any, **_kw: Any) -> None:
        request.headers[CLUSTER_HEADER] = cluster

    # The header is signed into the URL, so the token is only good for this cluster.
    sts.meta.events.register("before-sign.sts.GetCallerIdentity", add_header)
    url = sts.generate_presigned_url("get_caller_identity", Params={}, ExpiresIn=URL_EXPIRES_S, HttpMethod="GET")
    token = TOKEN_PREFIX + base64.urlsafe_b64encode(url.encode()).decode().rstrip("=")
    expiration = (dt.datetime.now(dt.timezone.utc) + TOKEN_LIFETIME).strftime("%Y-%m-%dT%H:%M:%SZ")
    return {"token": token, "expiration": expiration}


def api_client(cluster: str, region: str, session: Any = None, endpoint_url: str | None = None) -> Any:
    """A kubernetes ApiClient for an EKS cluster: endpoint and CA from DescribeCluster, our token."""
    from kubernetes import client

    boto3 = _boto3()
    session = session or boto3.Session(region_name=region)
    eks = session.client("eks", region_name=region, endpoint_url=endpoint_url)
    try:
        with aws_errors(f"reading EKS cluster {cluster}", "eks"):
            info = eks.describe_cluster(name=cluster)["cluster"]
    except AwsError as e:
        if e.code != "not_found":
            raise
        raise UserError(f"--eks-cluster: no EKS cluster {cluster!r} in {region} (aws eks list-clusters "
                        f"--region {region})") from None
    cfg = client.Configuration()
    cfg.host = info["endpoint"]
    cfg.ssl_ca_cert = ca_file(base64.b64decode(info["certificateAuthority"]["data"]))
    cfg.api_key_prefix = {"authorization": "Bearer"}

    def refresh(conf: Any) -> None:  # presigning is local and cheap: a fresh token for every request
        conf.api_key = {"authorization": get_token(cluster, region, session, endpoint_url)["token"]}

    refresh(cfg)
    cfg.refresh_api_key_hook = refresh
    return client.ApiClient(cfg)
