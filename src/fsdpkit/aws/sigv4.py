"""HTTP requests signed with SigV4 from the standard credential chain (environment, profile, SSO,
instance or pod role), for AWS APIs that are plain HTTP rather than a boto3 client: Amazon Managed
Service for Prometheus takes PromQL this way."""

from __future__ import annotations

import re
from typing import Any
from urllib.parse import parse_qsl, quote, urlsplit, urlunsplit

import requests

from fsdpkit.aws.session import AwsError, pick_region

# https://aps-workspaces.REGION.amazonaws.com/workspaces/ws-...: a workspace of Amazon Managed Prometheus.
AMP_HOST = re.compile(r"^aps-workspaces\.([a-z0-9-]+)\.amazonaws\.com$")
# Headers SigV4 adds; nothing else of botocore's request is carried over.
_SIGNED = ("authorization", "x-amz-date", "x-amz-security-token")


def amp_region(url: str) -> str | None:
    """The region of an Amazon Managed Prometheus workspace URL; None for any other endpoint."""
    m = AMP_HOST.match(urlsplit(url).hostname or "")
    return m.group(1) if m else None


def _aws_query(url: str) -> str:
    """The URL with its query encoded as SigV4 canonicalises it (%20 for spaces, not requests' +),
    so the signature covers exactly the bytes sent."""
    parts = urlsplit(url)
    pairs = parse_qsl(parts.query, keep_blank_values=True)
    query = "&".join(f"{quote(k, safe='-_.~')}={quote(v, safe='-_.~')}" for k, v in pairs)
    return urlunsplit((parts.scheme, parts.netloc, parts.path, query, parts.fragment))


class SigV4(requests.auth.AuthBase):
    """requests' auth hook: signs each request for `service` in `region` with fresh credentials
    (a refreshing role session stays valid over a long query)."""

    def __init__(self, credentials: Any, service: str, region: str):
        self.credentials, self.service, self.region = credentials, service, region

    def __call__(self, r: requests.PreparedRequest) -> requests.PreparedRequest:
        from botocore.auth import SigV4Auth
        from botocore.awsrequest import AWSRequest

        r.url = _aws_query(r.url or "")
        signed = AWSRequest(method=r.method, url=r.url, data=r.body or b"")
        SigV4Auth(self.credentials.get_frozen_credentials(), self.service, self.region).add_auth(signed)
        r.headers.update({k: v for k, v in signed.headers.items() if k.lower() in _SIGNED})
        return r


def sigv4_auth(service: str, region: str | None = None, profile: str | None = None) -> SigV4:
    """SigV4 for `service` from the standard credential chain; one line saying how to log in when
    there are no credentials."""
    try:
        import boto3
    except ImportError:
        raise AwsError("signing for AWS needs boto3: pip install 'fsdpkit[cloud]'", code="bad_input") from None
    session = boto3.Session(profile_name=profile, region_name=region)
    credentials = session.get_credentials()
    if credentials is None:
        raise AwsError("no AWS credentials to sign the query with: run `aws configure` or `aws sso login`, or set "
                       "AWS_PROFILE / AWS_ACCESS_KEY_ID", code="no_credentials")
    return SigV4(credentials, service, pick_region(region, session.region_name))
