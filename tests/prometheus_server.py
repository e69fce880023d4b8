"""A Prometheus for tests: /api/v1/query_range answered with recorded DCGM responses (their pods
renamed to the queried job's), and, given the caller's secret, every request's SigV4 signature
checked the way a workspace of Amazon Managed Prometheus does (a bad one gets 403)."""

from __future__ import annotations

import hmac
import re
import threading
from http.server import ThreadingHTTPServer
from urllib.parse import parse_qs, urlsplit

from http_reply import JSON, QuietHandler

from conftest import ROOT

DATA = ROOT / "tests" / "data" / "prometheus"
_AUTH = re.compile(r"AWS4-HMAC-SHA256 Credential=([^/]+)/(\d{8})/([^/]+)/([^/]+)/aws4_request, "
                   r"SignedHeaders=([^,]+), Signature=([0-9a-f]{64})$")


def sigv4_valid(method: str, path: str, headers, secret: str, token: str) -> bool:
    """Recompute the signature from the request as received (its SignedHeaders, its raw query)
    with the caller's secret, as AWS does; compare."""
    from botocore.auth import SigV4Auth
    from botocore.awsrequest import AWSRequest
    from botocore.credentials import Credentials

    m = _AUTH.match(headers.get("Authorization", ""))
    if not m or headers.get("X-Amz-Security-Token") != token:
        return False
    akid, _date, region, service, signed, signature = m.groups()
    if (region, service) != ("us-west-2", "aps") or not {"host", "x-amz-date"} <= set(signed.split(";")):
        return False
    req = AWSRequest(method=method, url=f"http://{headers['Host']}{path}",
                     headers={h: headers[h] for h in signed.split(";")})
    req.context["timestamp"] = headers["X-Amz-Date"]
    signer = SigV4Auth(Credentials(akid, secret, token), service, region)
    expected = signer.signature(signer.string_to_sign(req, signer.canonical_request(req)), req)
    return hmac.compare_digest(expected, signature)


class RecordedPrometheus:
    """/workspaces/ws-1/api/v1/query_range with recorded answers; every request is kept with
    whether its signature held."""

    def __init__(self, secret: str | None = None, token: str | None = None):
        self.requests: list[tuple[dict, bool]] = []
        outer = self

        class Handler(QuietHandler):
            def do_GET(self):
                ok = secret is None or sigv4_valid("GET", self.path, self.headers, secret, token)
                params = {k: v[0] for k, v in parse_qs(urlsplit(self.path).query).items()}
                outer.requests.append((params, ok))
                if not ok:
                    body, status = b'{"message":"The request signature we calculated does not match"}', 403
                elif urlsplit(self.path).path != "/workspaces/ws-1/api/v1/query_range":
                    body, status = b'{"status":"error","error":"not found"}', 404
                else:
                    name = "gpu_util.json" if "DCGM_FI_DEV_GPU_UTIL" in params["query"] else "fb_used.json"
                    job = re.search(r'pod=~"(.+?)-\.\*"', params["query"]).group(1)
                    body, status = (DATA / name).read_bytes().replace(b"llama-tiny", job.encode()), 200
                self.reply(status, body, JSON)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_port}/workspaces/ws-1"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self):
        self.server.shutdown()


