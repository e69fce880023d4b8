"""One boto3 session for every AWS command: region and account come from the user's session (env,
profile, STS), never from constants; retries with backoff on throttling; AWS errors become one line
that names the missing permission."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from fsdpkit.errors import UserError


class AwsError(UserError):
    """AWS refused or could not be reached: exit code 3; `code` names the kind for --json."""

    exit_code = 3

    code = "failed"


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


def pick_region(region: str | None, configured: str | None = None) -> str:
    """The one region rule: --region, else $AWS_REGION or $AWS_DEFAULT_REGION, else the profile's
    (`configured`). fsdpkit never picks one for you: resources in a region you did not mean cost
    money and are hard to find again."""
    region = region or os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION") or configured
    if not region:
        raise UserError("no AWS region: pass --region or set AWS_REGION (fsdpkit never picks one for you)")
    return region


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
        raise AwsError(f"AWS profile {profile!r} not found; check ~/.aws/config", code="no_credentials") from None
    try:
        region = pick_region(region, session.region_name)
    except UserError:
        if session.get_credentials() is None:  # no AWS set up at all: what every other AWS command says
            raise AwsError("no AWS credentials found and no AWS region: run `aws configure` or `aws sso login`, or "
                           "set AWS_PROFILE / AWS_ACCESS_KEY_ID and AWS_REGION", code="no_credentials") from None
        raise
    aws = Aws(session, region, "", endpoint_url)
    with aws_errors("reading your AWS identity (sts:GetCallerIdentity)"):
        aws.account = aws.client("sts").get_caller_identity()["Account"]
    return aws


# A dry run shows what needs AWS to know by these names when AWS cannot be asked.
OFFLINE_ACCOUNT, OFFLINE_REGION = "ACCOUNT", "REGION"


def connect_for(region: str | None, profile: str | None, dry_run: bool,
                say: Callable[[str], None] = print) -> Aws:
    """AWS for a command that can dry-run: connected when it can be; on a dry run without
    credentials, a region or a network, an offline stand-in (said once) whose account and region
    are placeholders, so the plan is still printed."""
    try:
        return connect(region, profile)
    except UserError as e:
        if not dry_run or e.code not in ("no_credentials", "unreachable", "bad_input"):
            raise
        say(f"note: dry run without AWS ({e}); ACCOUNT and REGION stand for yours")
    region = region or os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION") or OFFLINE_REGION
    return Aws(None, region, OFFLINE_ACCOUNT)


NOT_FOUND = ("ResourceNotFoundException", "NoSuchEntity", "NoSuchBucket", "NotFound", "NotFoundException",
             "RepositoryNotFoundException", "ImageNotFoundException", "FileSystemNotFound", "ValidationError")
THROTTLED = ("Throttling", "ThrottlingException", "TooManyRequestsException", "RequestLimitExceeded", "SlowDown")
EXPIRED = ("ExpiredToken", "ExpiredTokenException", "InvalidClientTokenId", "UnrecognizedClientException")
DENIED = ("AccessDenied", "AccessDeniedException", "UnauthorizedOperation", "403")


def translate(e: BaseException, what: str, service: str = "sts") -> AwsError | None:
    """The one-line AwsError for a botocore failure (None for anything else): no credentials,
    expired credentials, access denied, throttling, not found, unreachable. `service` is the IAM
    prefix (s3, iam, ecr, codebuild, logs) used to name a denied action."""
    import botocore.exceptions as bx

    if isinstance(e, (bx.NoCredentialsError, bx.PartialCredentialsError)):
        return AwsError(f"{what}: no AWS credentials found: run `aws configure` or `aws sso login`, or set "
                        "AWS_PROFILE / AWS_ACCESS_KEY_ID", code="no_credentials")
    if isinstance(e, bx.ClientError):
        err = e.response.get("Error", {})
        code, msg = err.get("Code", "?"), (err.get("Message") or "").strip()
        op, first = e.operation_name, msg.splitlines()[0] if msg else code
        if code in DENIED:
            return AwsError(f"{what}: access denied for {service}:{op}; your role needs that IAM permission ({first})",
                            hint=f"grant {service}:{op} to your IAM role or user", code="access_denied")
        if code in THROTTLED:
            return AwsError(f"{what}: AWS kept throttling {op} after retries with backoff; try again in a minute, "
                            "or ask for a higher API rate limit", code="unreachable")
        if code in EXPIRED:
            return AwsError(f"{what}: your AWS credentials are expired or invalid ({code}); refresh them "
                            "(aws sso login)", code="no_credentials")
        if code in NOT_FOUND or e.response.get("ResponseMetadata", {}).get("HTTPStatusCode") == 404:
            return AwsError(f"{what}: not found ({op}: {first}); check the name and the region", code="not_found")
        return AwsError(f"{what}: {op} failed: {code}: {first}")
    if isinstance(e, (bx.EndpointConnectionError, bx.ConnectionClosedError, bx.ConnectTimeoutError,
                      bx.ReadTimeoutError, bx.ProxyConnectionError)):
        return AwsError(f"{what}: cannot reach AWS ({str(e).splitlines()[0]}); check the region and your network",
                        code="unreachable")
    if isinstance(e, bx.NoRegionError):
        return AwsError(f"{what}: no AWS region: pass --region or set AWS_REGION", code="bad_input")
    if isinstance(e, bx.BotoCoreError):
        return AwsError(f"{what}: {str(e).splitlines()[0]}")
    return None


@contextlib.contextmanager
def aws_errors(what: str, service: str = "sts") -> Iterator[None]:
    """Run AWS calls with their failures translated (see `translate`); other errors pass through."""
    try:
        yield
    except Exception as e:
        if (err := translate(e, what, service)) is None:
            raise
        raise err from None
