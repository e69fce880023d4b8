"""fsdpkit.cluster.client against an API server over TLS: a kubeconfig that says
insecure-skip-tls-verify is taken as kubectl takes it, without urllib3's warning on every request."""

from __future__ import annotations

import datetime as dt
import json
import ssl
import threading
import warnings
from http.server import ThreadingHTTPServer

import pytest
from http_reply import JSON, QuietHandler

from fsdpkit.cluster.client import connect

from conftest import require


def self_signed(tmp_path):
    """A certificate and key for 127.0.0.1 that no CA signed."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")])
    now = dt.datetime.now(dt.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(now - dt.timedelta(minutes=1))
            .not_valid_after(now + dt.timedelta(hours=1)).sign(key, hashes.SHA256()))
    (tmp_path / "cert.pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    (tmp_path / "key.pem").write_bytes(key.private_bytes(serialization.Encoding.PEM,
                                                         serialization.PrivateFormat.PKCS8,
                                                         serialization.NoEncryption()))
    return tmp_path / "cert.pem", tmp_path / "key.pem"


@pytest.fixture
def tls_server(tmp_path):
    """An HTTPS server answering GET /version as the API server does."""
    class Version(QuietHandler):
        def do_GET(self):
            body = json.dumps({"major": "1", "minor": "36", "gitVersion": "v1.36.0", "gitCommit": "0" * 40,
                               "gitTreeState": "clean", "buildDate": "2026-11-01T00:00:00Z", "goVersion": "go1.25",
                               "compiler": "gc", "platform": "linux/amd64"}).encode()
            self.reply(200, body, JSON)

    cert, key = self_signed(tmp_path)
    server = ThreadingHTTPServer(("127.0.0.1", 0), Version)
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(cert, key)
    server.socket = context.wrap_socket(server.socket, server_side=True)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"https://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def test_an_insecure_kubeconfig_is_taken_without_a_warning_on_each_request(tls_server, tmp_path):
    k8s = require("kubernetes")
    path = tmp_path / "kubeconfig"
    path.write_text("apiVersion: v1\nkind: Config\ncurrent-context: c\n"
                    f"clusters: [{{name: c, cluster: {{server: '{tls_server}', insecure-skip-tls-verify: true}}}}]\n"
                    "contexts: [{name: c, context: {cluster: c, user: u}}]\nusers: [{name: u, user: {token: t}}]\n")
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("default")
        api = connect(kubeconfig=str(path))
        for _ in range(3):
            assert k8s.client.VersionApi(api).get_code().git_version == "v1.36.0"
    assert [str(w.message) for w in seen if "Unverified HTTPS" in str(w.message)] == []
    # Without the kubeconfig's say-so, the same server's certificate is refused, not warned about.
    path.write_text(path.read_text().replace(", insecure-skip-tls-verify: true", ""))
    with pytest.raises(Exception, match=r"CERTIFICATE_VERIFY_FAILED|certificate verify failed"):
        k8s.client.VersionApi(connect(kubeconfig=str(path))).get_code(_request_timeout=5)
