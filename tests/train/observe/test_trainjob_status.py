"""A run inside a Kubeflow TrainJob posts its progress to the controller's status server, as
Trainer 2.2's controller injects it: an HTTPS endpoint with its own CA and a projected token. The
test server here takes the controller's place: its route, its bearer token, its TLS, and each
payload checked against the TrainJob CRD's own schema (status.trainerStatus), strictly."""

from __future__ import annotations

import datetime
import ipaddress
import json
import re
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from fsdpkit.jobs import trainjob
from fsdpkit.jobs.resolved import load_job
from fsdpkit.train.observe.trainjob_status import MIN_INTERVAL_S, TrainJobStatusSink

from conftest import FAST, read_metrics, run_cli
from manifest_schemas import IMAGE, crd_validator

# The controller's route (kubeflow/trainer pkg/statusserver: POST StatusUrl(namespace, name)).
ROUTE = re.compile(r"^/apis/trainer\.kubeflow\.org/v1alpha1/namespaces/([^/]+)/trainjobs/([^/]+)/status$")
TOKEN = "eyJhbGciOiJSUzI1NiJ9.projected-token"


def _certificate(tmp: Path) -> tuple[Path, Path]:
    """A self-signed certificate for 127.0.0.1, its own CA (the controller's webhook CA in a pod)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "kubeflow-trainer-controller-manager")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(hours=1))
            .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), False)
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), True)
            .sign(key, hashes.SHA256()))
    cert_path, key_path = tmp / "ca.crt", tmp / "tls.key"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    return cert_path, key_path


def trainjob_with(status: dict) -> dict:
    """A rendered TrainJob carrying `status`, as the API server would store it."""
    spec = load_job(None, [("name", "llama-tiny"), ("backend", "trainjob"), ("image", IMAGE),
                            ("train", {"preset": "tiny"})])
    return {**trainjob.trainjob_manifest(spec), "status": status}


def trainjob_schema():
    """The TrainJob CRD's schema, read in the test's own thread: where ../shared is absent the test
    is skipped there, before any server starts (a skip raised in the server's thread would only drop
    the client's connection)."""
    return crd_validator("trainer.kubeflow.org_trainjobs.yaml")


def check_trainer_status(status: dict, schema=None) -> None:
    """What the API server would accept: the CRD's schema (strict), its CEL rule and RFC 3339 time."""
    (schema or trainjob_schema()).validate(trainjob_with({"trainerStatus": status}))
    assert "lastUpdatedTime" in status  # x-kubernetes-validations: lastUpdatedTime is required
    datetime.datetime.strptime(status["lastUpdatedTime"], "%Y-%m-%dT%H:%M:%SZ")


@pytest.fixture
def controller(tmp_path):
    """The status server: records each accepted post; refuses a wrong route or token as the
    controller does (404, 403)."""
    import ssl

    schema = trainjob_schema()
    cert, key = _certificate(tmp_path)
    posts: list[dict] = []
    refused: list[int] = []

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            code = 200
            if not ROUTE.match(self.path):
                code = 404
            elif self.headers.get("Authorization") != f"Bearer {TOKEN}":
                code = 403
            else:
                try:
                    check_trainer_status(body["trainerStatus"], schema)
                    posts.append(body["trainerStatus"])
                except Exception:   # what the API server refuses: 422, seen by the test as a refusal
                    code = 422
            if code != 200:
                refused.append(code)
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.end_headers()
            self.wfile.write(json.dumps(body).encode())

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(cert, key)
    server.socket = context.wrap_socket(server.socket, server_side=True)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    (tmp_path / "token").write_text(TOKEN + "\n")
    url = f"https://127.0.0.1:{server.server_address[1]}/apis/trainer.kubeflow.org/v1alpha1/namespaces/default/" \
          "trainjobs/llama-tiny/status"
    env = {"KUBEFLOW_TRAINER_SERVER_URL": url, "KUBEFLOW_TRAINER_SERVER_CA_CERT": str(cert),
           "KUBEFLOW_TRAINER_SERVER_TOKEN": str(tmp_path / "token")}
    yield env, posts, refused
    server.shutdown()


@pytest.mark.slow
def test_a_run_posts_its_progress_in_trainer_s_schema(controller, tmp_path):
    env, posts, refused = controller
    r = run_cli("train", *FAST, "--max_steps", "40", "--logging_freq", "5", "--run_dir", str(tmp_path / "run"),
                env=env)
    assert r.returncode == 0, r.stderr
    assert not refused and "TrainJob status" not in r.stdout + r.stderr
    # The first logging line at once, then at most one post every MIN_INTERVAL_S, and the end.
    assert len(posts) >= 2
    first, last = posts[0], posts[-1]
    assert first["progressPercentage"] == 12 and {"name": "step", "value": "5"} in first["metrics"]
    assert last["progressPercentage"] == 100 and last["estimatedRemainingSeconds"] == 0
    figures = {m["name"]: m["value"] for m in last["metrics"]}
    final = read_metrics(tmp_path / "run")[-1]
    assert figures["step"] == "40" and figures["total_steps"] == "40"
    assert float(figures["loss"]) == pytest.approx(final["loss"], rel=1e-5)
    assert float(figures["tokens_per_s"]) == pytest.approx(final["tokens_per_s"], rel=1e-5)
    percents = [p["progressPercentage"] for p in posts]
    assert percents == sorted(percents)


def test_posts_are_throttled_and_a_down_controller_is_said_once(controller, diagnostics):
    env, posts, refused = controller
    clock = [100.0]
    sink = TrainJobStatusSink.from_env(200, env)
    assert sink is not None and TrainJobStatusSink.from_env(200, {}) is None
    sink.clock = lambda: clock[0]
    sink.log("start", {"step": 100})   # a resumed attempt: the time left is this attempt's pace
    for step in range(110, 160, 10):
        clock[0] += 1.0
        sink.log("train", {"step": step, "loss": 2.5, "tokens_per_s": 1000.0})
    assert len(posts) == 1 and posts[0]["estimatedRemainingSeconds"] == round(0.1 * 90)
    clock[0] += MIN_INTERVAL_S
    sink.log("val", {"step": 150, "val_loss": 2.4})
    assert len(posts) == 2 and {"name": "val_loss", "value": "2.4"} in posts[1]["metrics"]
    # The controller refuses (a token for another job); training goes on, said once, then recovers.
    sink.token_path = str(Path(env["KUBEFLOW_TRAINER_SERVER_TOKEN"]).with_name("other"))
    Path(sink.token_path).write_text("someone-else")
    for _ in range(3):
        clock[0] += MIN_INTERVAL_S
        sink.log("train", {"step": 160, "loss": 2.4})
    assert refused == [403, 403, 403]
    assert diagnostics == [
        f"warning: TrainJob status: the controller at {env['KUBEFLOW_TRAINER_SERVER_URL']} did not take the progress "
        "(HTTPError: HTTP Error 403: Forbidden); training goes on, and later steps try again"]
    sink.token_path = env["KUBEFLOW_TRAINER_SERVER_TOKEN"]
    sink.close(ok=False)   # stopped before max_steps: the end is posted, not as done
    assert len(posts) == 3 and posts[-1]["progressPercentage"] == 80 and TOKEN not in json.dumps(posts)
