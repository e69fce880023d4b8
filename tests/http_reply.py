"""The base of the suite's stand-in HTTP servers (an API server's /version, Prometheus, EC2, IAM,
HyperPod's memory store): a reply is its whole body with its length, and no access log is printed."""

from __future__ import annotations

from collections.abc import Mapping
from http.server import BaseHTTPRequestHandler


class QuietHandler(BaseHTTPRequestHandler):
    def reply(self, status: int, body: bytes, headers: Mapping[str, str]) -> None:
        self.send_response(status)
        for k, v in headers.items():
            self.send_header(k, v)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


JSON = {"Content-Type": "application/json"}
XML = {"Content-Type": "text/xml"}
