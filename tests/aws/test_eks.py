"""EKS access against moto in server mode: the token has the format `aws eks get-token` produces
and STS answers its presigned request; DescribeCluster gives the client its endpoint and CA."""

from __future__ import annotations

import base64
import os
import subprocess
import sys
import urllib.parse
import urllib.request

import pytest

from fsdpkit.aws.eks import TOKEN_PREFIX, api_client, get_token

from conftest import require

moto_server = require("moto.server")
boto3 = require("boto3")


@pytest.fixture
def aws(monkeypatch):
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=0)
    server.start()
    host, port = server.get_host_and_port()
    # moto keeps its backends per process, across server instances: start every test from empty.
    urllib.request.urlopen(urllib.request.Request(f"http://{host}:{port}/moto-api/reset", method="POST"),
                           timeout=10).read()
    for k, v in {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
                 "AWS_DEFAULT_REGION": "us-west-2"}.items():
        monkeypatch.setenv(k, v)
    yield f"http://{host}:{port}"
    server.stop()


def decode(token: str) -> str:
    body = token.removeprefix(TOKEN_PREFIX)
    return base64.urlsafe_b64decode(body + "=" * (-len(body) % 4)).decode()


def test_token_is_a_presigned_sts_call_bound_to_the_cluster(aws):
    session = boto3.Session(region_name="us-west-2")
    out = get_token("my-cluster", "us-west-2", session, endpoint_url=aws)
    token = out["token"]
    assert token.startswith("k8s-aws-v1.") and "=" not in token and "+" not in token and "/" not in token
    url = decode(token)
    q = dict(urllib.parse.parse_qsl(urllib.parse.urlparse(url).query))
    assert q["Action"] == "GetCallerIdentity" and q["Version"] == "2011-06-15"
    assert q["X-Amz-Algorithm"] == "AWS4-HMAC-SHA256" and q["X-Amz-Expires"] == "60"
    assert q["X-Amz-SignedHeaders"] == "host;x-k8s-aws-id"
    assert q["X-Amz-Credential"].endswith("/us-west-2/sts/aws4_request")
    assert out["expiration"].endswith("Z")
    # What the EKS authenticator does with it: send the signed request to STS with the cluster
    # header. moto's server picks the service from the Authorization header, never from a presigned
    # query, so the same signature is also presented as a header.
    auth = (f"AWS4-HMAC-SHA256 Credential={q['X-Amz-Credential']}, SignedHeaders={q['X-Amz-SignedHeaders']}, "
            f"Signature={q['X-Amz-Signature']}")
    req = urllib.request.Request(url, headers={"x-k8s-aws-id": "my-cluster", "Authorization": auth})
    body = urllib.request.urlopen(req, timeout=10).read().decode()
    assert "<GetCallerIdentityResult>" in body and "<Arn>" in body


def _cluster(aws: str, name: str = "train") -> None:
    session = boto3.Session(region_name="us-west-2")
    role = session.client("iam", endpoint_url=aws).create_role(RoleName=f"eks-{name}",
                                                               AssumeRolePolicyDocument="{}")["Role"]["Arn"]
    session.client("eks", endpoint_url=aws).create_cluster(
        name=name, roleArn=role, resourcesVpcConfig={"subnetIds": ["subnet-1"]})


def test_client_for_an_eks_cluster_by_name(aws):
    session = boto3.Session(region_name="us-west-2")
    _cluster(aws)
    client = api_client("train", "us-west-2", session, endpoint_url=aws)
    cfg = client.configuration
    assert cfg.host.startswith("https://")
    with open(cfg.ssl_ca_cert, "rb") as f:
        assert f.read()  # the cluster's CA, decoded
    auth = cfg.get_api_key_with_prefix("authorization")
    assert auth.startswith("Bearer k8s-aws-v1.")
    assert decode(auth.removeprefix("Bearer ")).count("GetCallerIdentity") == 1
    from fsdpkit.errors import UserError

    with pytest.raises(UserError, match="no EKS cluster 'nope' in us-west-2"):
        api_client("nope", "us-west-2", session, endpoint_url=aws)


# A process that connects to a cluster by name, as `fsdpkit ... --eks-cluster` does: the CA file's path.
CONNECT = ("import sys; from fsdpkit.aws.eks import api_client; "
           "a = api_client('train', 'us-west-2', endpoint_url=sys.argv[1]); "
           "b = api_client('train', 'us-west-2', endpoint_url=sys.argv[1]); "
           "assert a.configuration.ssl_ca_cert == b.configuration.ssl_ca_cert; print(a.configuration.ssl_ca_cert)")


def test_the_cluster_s_ca_file_is_written_once_and_gone_when_the_process_ends(aws, tmp_path):
    """One file per CA however often a process connects (an MCP server connects per call), removed
    at the process's end rather than left in the temp folder for good."""
    _cluster(aws)
    r = subprocess.run([sys.executable, "-c", CONNECT, aws], capture_output=True, text=True, timeout=120,
                       env={**os.environ, "TMPDIR": str(tmp_path)})
    assert r.returncode == 0, r.stderr[-2000:]
    path = r.stdout.strip()
    assert path.startswith(str(tmp_path)) and not os.path.exists(path)
    assert list(tmp_path.iterdir()) == []
