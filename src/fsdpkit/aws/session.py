"""One boto3 session for every AWS command: region and account come from the user's session (env,
profile, STS), never from constants; retries with backoff on throttling; AWS errors become one line
that names the missing permission."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from fsdpkit.errors import UserError


class AwsError(UserError):
    exit_code = 3


@dataclass
class Aws:
    session: Any
    region: str
    account: str
    endpoint_url: str | None = None  # tests: moto's server

    def client(self, service: str) -> Any:
        from botocore.config import Config

        # "standard" retries back off exponentially on throttling and transient errors.
        cfg = Config(retries={"mode": "standard", "max_attempts": int(os.environ.get("AWS_MAX_ATTEMPTS", 8))})
        return self.session.client(service, region_name=self.region, endpoint_url=self.endpoint_url, config=cfg)


def connect(region: str | None = None, profile: str | None = None, endpoint_url: str | None = None) -> Aws:
    try:
        import boto3
        import botocore.exceptions as bx
    except ImportError:
        raise UserError("boto3 is not installed: pip install 'fsdpkit[cloud]'") from None
    endpoint_url = endpoint_url or os.environ.get("FSDPKIT_AWS_ENDPOINT_URL")
    try:
        session = boto3.Session(profile_name=profile, region_name=region)
    except bx.ProfileNotFound:
        raise AwsError(f"AWS profile {profile!r} not found (see ~/.aws/config)") from None
    region = region or os.environ.get("AWS_REGION") or session.region_name
    if not region:
        raise UserError("no AWS region: pass --region or set AWS_REGION (fsdpkit never picks one for you)")
    aws = Aws(session, region, "", endpoint_url)
    with aws_errors("reading your AWS identity (sts:GetCallerIdentity)"):
        aws.account = aws.client("sts").get_caller_identity()["Account"]
    return aws


@contextlib.contextmanager
def aws_errors(what: str, service: str = "sts") -> Iterator[None]:
    """`service` is the IAM prefix (s3, iam, ecr, codebuild, logs) used to name a denied action."""
    import botocore.exceptions as bx

    try:
        yield
    except (bx.NoCredentialsError, bx.PartialCredentialsError):
        raise AwsError(f"{what}: no AWS credentials found: run `aws configure` or `aws sso login`, or set "
                       "AWS_PROFILE / AWS_ACCESS_KEY_ID") from None
    except bx.ClientError as e:
        err = e.response.get("Error", {})
        code, msg = err.get("Code", "?"), err.get("Message", "")
        op = e.operation_name
        if code in ("AccessDenied", "AccessDeniedException", "UnauthorizedOperation", "403"):
            raise AwsError(f"{what}: access denied for {service}:{op}; your role needs that IAM permission "
                           f"({msg.splitlines()[0] if msg else code})") from None
        if code in ("Throttling", "ThrottlingException", "TooManyRequestsException", "RequestLimitExceeded",
                    "SlowDown"):
            raise AwsError(f"{what}: AWS kept throttling {op} after retries with backoff; try again in a minute, "
                           "or ask for a higher API rate limit") from None
        if code in ("ExpiredToken", "ExpiredTokenException", "InvalidClientTokenId", "UnrecognizedClientException"):
            raise AwsError(f"{what}: your AWS credentials are expired or invalid ({code}); refresh them "
                           "(aws sso login)") from None
        raise AwsError(f"{what}: {op} failed: {code}: {msg}") from None
    except bx.EndpointConnectionError as e:
        raise AwsError(f"{what}: cannot reach AWS ({e}); check the region and your network") from None
