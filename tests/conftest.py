"""Shared helpers: run the real CLI (in a subprocess, or in this process) and read what a run wrote."""

from __future__ import annotations

import contextlib
import gzip
import importlib
import io
import json
import logging
import os
import shutil
import subprocess
import sys
import types
import typing
from pathlib import Path
from unittest import mock

import pytest

from fsdpkit.cli.main import main as cli_main
from fsdpkit.envelope import show_diagnostics

import forked_cli
import torch_pass
import worker_order
from slurm_cluster import SlurmCluster, why_not

ROOT = Path(__file__).resolve().parents[1]
# CI (.ci/run sets CI=true) has everything the suite reads: ../shared's schemas and what `make venv`
# installs. There a missing one fails its tests; on a laptop or a fresh clone they skip and say why.
IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")


def unavailable(reason: str) -> typing.NoReturn:
    """Stop a test (or a test module) whose prerequisite is missing: skipped with the reason, or
    failed in CI."""
    if IN_CI:
        pytest.fail(f"{reason}; CI=true, where it must be present", pytrace=False)
    pytest.skip(reason, allow_module_level=True)


def require(module: str) -> types.ModuleType:
    """A test extra's module (`make venv` installs them all), or `unavailable`."""
    try:
        return importlib.import_module(module)
    except ImportError as e:
        unavailable(f"{module} cannot be imported ({e}); make venv installs it")

# `make test` runs two pytest-xdist workers. Each worker's training processes get the worker's share
# of the cores, as torchrun gives each rank its share: two OpenMP pools spinning on the same cores
# slow each other down many times over.
# Inductor's compile pool too: by default each compiling process starts one worker a core, each a
# new interpreter importing torch (3.5 s of CPU a compiled run here), to compile on cores the other
# worker is using.
if _workers := int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0")):
    _share = str(max(1, (os.cpu_count() or 1) // _workers))
    os.environ.setdefault("OMP_NUM_THREADS", _share)
    os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", _share)
# The suite runs as on a machine with no cluster: the developer's own kubeconfig (its clusters, its
# context's namespace, which every render now takes) reaches no test; a test that needs one gives its own.
os.environ["KUBECONFIG"] = "/nonexistent/fsdpkit-tests/kubeconfig"

@pytest.hookimpl(tryfirst=True)  # before `-m` deselects by markers
def pytest_collection_modifyitems(items):
    """Mark the tests that depend on torch (tests/torch_pass.py): CI's newest-torch pass runs those.
    Then the longest files first, the order the workers take them in (tests/worker_order.py)."""
    torch_pass.mark(items)
    worker_order.order(items)


def pytest_sessionfinish(session):
    forked_cli.close()


# Small, fast settings shared by the training tests (tiny preset, short sequences).
FAST = ["--seq_len", "64", "--validation_freq", "0", "--validation_batches", "2", "--progress", "off"]


def run_cli(*args: str, timeout: float = 300, env: dict | None = None, cwd: Path | None = None,
            stdin: str = "") -> subprocess.CompletedProcess:
    """The CLI in a process of its own; `stdin` is what a user types (nothing: a closed stdin)."""
    return fsdpkit_process(list(args), {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}, cwd or ROOT, stdin,
                           timeout)


def fsdpkit_process(argv: list[str], env: dict[str, str], cwd: Path, stdin: str = "",
                    timeout: float = 300) -> subprocess.CompletedProcess:
    """`python -m fsdpkit ARGV` with exactly this environment, forked from a process that imported
    what the command needs once (tests/forked_cli.py), where its environment allows."""
    if argv and (done := forked_cli.run(argv, env, Path(cwd), stdin, timeout)) is not None:
        return done
    return subprocess.run([sys.executable, "-m", "fsdpkit", *argv], capture_output=True, text=True, timeout=timeout,
                          env=env, cwd=cwd, input=stdin)


def cli_here(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """The CLI in this process, for commands that only read, print or talk to an API server (render,
    plan, explain, ray's verbs against kmock): what run_cli returns, without a Python start-up, and
    with the calls visible to the test's process (`make mutation` sees which test reaches which
    function only there); `env` is set for the call only. Commands that train or hold processes run
    in a subprocess (run_cli)."""
    out, err = io.StringIO(), io.StringIO()
    with mock.patch.dict(os.environ, env or {}), contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = cli_main(list(args))
        except SystemExit as e:  # argparse's usage errors and --help
            code = e.code if isinstance(e.code, int) else int(e.code is not None)
    return subprocess.CompletedProcess(["fsdpkit", *args], code, out.getvalue(), err.getvalue())


def copy_of_the_suite(root: Path) -> Path:
    """The suite and its pytest settings copied into `root` (the package's source linked in, so
    nothing beside it: no ../shared): for tests of how the suite itself behaves in another tree."""
    root.mkdir(parents=True, exist_ok=True)
    shutil.copy(ROOT / "pyproject.toml", root)
    (root / "src").symlink_to(ROOT / "src")
    shutil.copytree(ROOT / "tests", root / "tests", ignore=shutil.ignore_patterns("__pycache__"))
    return root


def read_metrics(run_dir: Path, kind: str = "train") -> list[dict]:
    lines = (Path(run_dir) / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["kind"] == kind]


def processes_naming(path: Path) -> list[str]:
    """Command lines of live processes that name `path` (every rank of a run gets its --run_dir)."""
    out = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            cmd = cmdline.read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if str(path) in cmd:
            out.append(cmd)
    return out


def losses(run_dir: Path) -> list[float]:
    return [r["loss"] for r in read_metrics(run_dir)]


DOCS = [f"document {i}: " + " ".join(f"w{(i * 7 + j) % 50}" for j in range(5 + i % 13)) for i in range(500)]


def write_fixture(root, fmt: str):
    root.mkdir(parents=True, exist_ok=True)
    records = [{"text": d, "id": i} for i, d in enumerate(DOCS)]
    if fmt == "jsonl":
        (root / "a.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records[:60]))
        (root / "b.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records[60:]))
    elif fmt == "jsonl.gz":
        with gzip.open(root / "all.jsonl.gz", "wt") as f:
            f.writelines(json.dumps(r) + "\n" for r in records)
    elif fmt == "jsonl.zst":
        import zstandard

        data = "".join(json.dumps(r) + "\n" for r in records).encode()
        (root / "all.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(data))
    elif fmt == "json":
        (root / "all.json").write_text(json.dumps(records))
    elif fmt == "parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.table({"text": DOCS, "id": list(range(len(DOCS)))}), root / "all.parquet", row_group_size=25)
    elif fmt == "txt":
        for i, d in enumerate(DOCS):
            (root / f"{i:03d}.txt").write_text(d)
    return root


@pytest.fixture
def cli():
    return run_cli


@pytest.fixture
def diagnostics():
    """The lines fsdpkit's loggers say in this process, as the CLI or the trainer shows them
    (through the one handler, fsdpkit.envelope.show_diagnostics); the loggers as they were after."""
    logger = logging.getLogger("fsdpkit")
    saved = logger.handlers[:], logger.level, logger.propagate
    lines: list[str] = []
    show_diagnostics(lines.append)
    yield lines
    logger.handlers[:], logger.level, logger.propagate = saved[0], saved[1], saved[2]


# -- a Kubernetes API for tests: kmock's emulator on 127.0.0.1, in a thread with its own loop ---------
class _History(list):
    """kmock's record of the requests a server saw. kmock finds whether a scripted route (`route`)
    answers a request by looking for that request among every one the route's filter passes: each
    request cost a walk over all that came before (0.1 s a request once a server had seen 600, and a
    test sends thousands). Iterated, this record shows kmock only the requests being answered at that
    moment (`answering`, kept by the Emulator), which holds the one it looks for; `every()` is the
    whole record, in order, for the tests' own reading."""

    def __init__(self) -> None:
        super().__init__()
        self.answering: dict[int, object] = {}

    def __iter__(self):
        return iter(list(self.answering.values()))

    def every(self) -> list:
        return list.__getitem__(self, slice(None))


class KubeMock:
    """kmock's KubernetesEmulator served over HTTP, reached by the official client through a
    kubeconfig file. kmock stores objects and records requests; it ignores labelSelector, answers a
    create with an empty body, and serves neither pod logs nor nodes, so tests script those routes
    (`route`) and play the training operator by patching `/status` as it would. A server-side dry
    run (`dryRun=All`) is answered as the API server answers it: the object back, nothing stored;
    `dry_runs` records them (path?query, body)."""

    RESOURCES = ("trainer.kubeflow.org/v1alpha1/trainjobs", "trainer.kubeflow.org/v1alpha1/clustertrainingruntimes",
                 "jobset.x-k8s.io/v1alpha2/jobsets",
                 "kubeflow.org/v1/pytorchjobs", "sagemaker.amazonaws.com/v1/hyperpodpytorchjobs",
                 "v1/secrets", "v1/persistentvolumeclaims", "v1/pods", "v1/nodes", "apps/v1/daemonsets",
                 "apps/v1/deployments", "apiextensions.k8s.io/v1/customresourcedefinitions",
                 "storage.k8s.io/v1/storageclasses", "storage.k8s.io/v1/csidrivers", "ray.io/v1/rayclusters",
                 "ray.io/v1/rayjobs", "kubeflow.org/v2beta1/mpijobs", "v1/persistentvolumes", "v1/services",
                 "kueue.x-k8s.io/v1beta2/localqueues", "kueue.x-k8s.io/v1beta2/workloads",
                 "kueue.x-k8s.io/v1beta2/clusterqueues", "v1/resourcequotas", "v1/events")

    def __init__(self, tmp_path):
        import asyncio
        import threading

        self._asyncio = asyncio
        self.loop = asyncio.new_event_loop()
        ready = threading.Event()
        self._thread = threading.Thread(target=self.loop.run_until_complete, args=(self._serve(ready),), daemon=True)
        self._thread.start()
        assert ready.wait(20), "kmock did not start"
        self.dry_runs: list[tuple[str, dict]] = []
        # token -> (user name, Role rules, the Role's namespace): users the API server authorizes with RBAC.
        self.users: dict[str, tuple[str, list[dict], str]] = {}
        self.reviews: list[dict] = []   # the SelfSubjectAccessReviews asked, in order
        self.kubeconfig = tmp_path / "kubeconfig"
        self.kubeconfig.write_text(
            "apiVersion: v1\nkind: Config\ncurrent-context: kmock\n"
            f"clusters: [{{name: kmock, cluster: {{server: '{self.url}'}}}}]\n"
            "contexts: [{name: kmock, context: {cluster: kmock, user: tester}}]\n"
            "users: [{name: tester, user: {token: not-a-real-token}}]\n")
        self.env = {"KUBECONFIG": str(self.kubeconfig)}

    async def _serve(self, ready):
        import kmock

        mock = self

        class Emulator(kmock.KubernetesEmulator):
            """kmock with pod exec: a websocket on the `v4.channel.k8s.io` protocol, as the API server
            relays it from the kubelet, answered by the test's `serve_exec` handler."""

            async def __call__(self, raw_request):
                if (refused := await mock._authorize(raw_request)) is not None:
                    return refused
                if (refused := await mock._admit(raw_request)) is not None:
                    return refused
                if raw_request.path.endswith("/exec") and mock.exec_handler is not None:
                    return await mock._exec(raw_request)
                if (refused := mock._unserved(raw_request.path)) is not None:
                    return refused
                if raw_request.method == "POST" and raw_request.query.get("dryRun") == "All":
                    return await mock._dry_run(raw_request)
                if (answer := await mock._namespace(raw_request)) is not None:
                    return answer
                response = await super().__call__(raw_request)
                if raw_request.method == "POST" and raw_request.path == mock.CRDS and response.status < 300:
                    mock._serve_crd(await raw_request.json())
                return response

            async def _handle(self, request):
                self._requests.answering[id(request)] = request   # see _History
                try:
                    return await super()._handle(request)
                finally:
                    del self._requests.answering[id(request)]

        self._stop = self._asyncio.Event()
        async with Emulator() as handler, kmock.Server(handler) as server:
            handler._requests = _History()
            for res in self.RESOURCES:
                handler.resources[res] = {}
            self.handler, self.url = handler, str(server.url).rstrip("/")
            ready.set()
            await self._stop.wait()

    exec_handler = None
    CRDS = "/apis/apiextensions.k8s.io/v1/customresourcedefinitions"

    def _serve_crd(self, crd: dict) -> None:
        """A CRD created with its spec makes its API appear, as the API server serves it: each served
        version in discovery and at its paths. (A CRD given by name alone, as most tests record one
        for the readiness checks, leaves the API as RESOURCES declared it.)"""
        spec = crd.get("spec") or {}
        if not spec.get("group"):
            return
        names = spec["names"]
        for version in spec.get("versions", []):
            if version.get("served", True):
                self._register(f"{spec['group']}/{version['name']}/{names['plural']}", {
                    "kind": names["kind"], "singular": names.get("singular"),
                    "namespaced": spec.get("scope") == "Namespaced",
                    "verbs": ["create", "delete", "get", "list", "patch", "update", "watch"],
                    "subresources": sorted(version.get("subresources") or {})})

    def _register(self, resource: str, info: dict) -> None:
        """Serve an API (on the server's loop): in discovery, and its requests no longer refused."""
        self.unserved = self.unserved - {resource}
        self.handler.resources[resource] = info

    def user(self, name: str, rules: list[dict], namespace: str = "default",
             context_namespace: str | None = None) -> dict[str, str]:
        """A user bound to a Role with these rules in `namespace` and nothing cluster-wide, as a
        shared cluster gives a team: the environment whose kubeconfig is that user's (its context
        naming `context_namespace`, as `kubectl config set-context --current --namespace` does)."""
        token = f"token-{len(self.users)}-" + "".join(c if c.isalnum() else "-" for c in name)
        self.users = {**self.users, token: (name, rules, namespace)}
        path = self.kubeconfig.parent / f"kubeconfig-{token}"
        text = self.kubeconfig.read_text().replace("not-a-real-token", token)
        if context_namespace:
            text = text.replace("user: tester}", f"user: tester, namespace: {context_namespace}}}")
        path.write_text(text)
        return {"KUBECONFIG": str(path)}

    async def _authorize(self, raw_request):
        """RBAC as kube-apiserver applies it (tests/kube_access.py); SelfSubjectAccessReviews answered
        from the same rules. None lets the request through."""
        from aiohttp import web

        import kube_access

        token = raw_request.headers.get("Authorization", "").removeprefix("Bearer ").strip()
        name, rules, namespace = self.users.get(token, ("tester", None, ""))
        if raw_request.method == "POST" and raw_request.path.startswith("/apis/authorization.k8s.io/v1/selfsubject"):
            review = await raw_request.json()
            self.reviews.append(review)
            return web.json_response(kube_access.access_review(review, name, rules, namespace), status=201)
        if rules is None:
            return None
        a = kube_access.attributes(raw_request.method, raw_request.path, dict(raw_request.query))
        if not a.is_resource:
            return None  # discovery: every authenticated user
        for verb in kube_access.checks(a):
            if not kube_access.allowed(rules, namespace, verb, a.group, a.resource, a.subresource, a.namespace,
                                       a.name):
                return web.json_response(kube_access.forbidden_status(name, a, verb), status=403)
        return None
    # The admission Pod creates meet (tests/kube_admission.py: PriorityClasses, Pod Security levels by
    # namespace); None admits every pod.
    pod_admission = None

    async def _admit(self, raw_request):
        import re

        from aiohttp import web

        m = re.fullmatch(r"/api/v1/namespaces/([^/]+)/pods", raw_request.path)
        if raw_request.method != "POST" or m is None or self.pod_admission is None:
            return None
        if (status := self.pod_admission.refuse(m.group(1), await raw_request.json())) is not None:
            return web.json_response(status, status=status["code"])
        return None

    # A server-side dry run's verdict: `refuse(path, body)` -> None to accept, or the API server's
    # message for a 400 (what a real one says of a field its CRD does not know, say).
    refuse = None

    namespaces: dict[str, dict] = {}  # noqa: RUF012 - replaced whole by each create, never mutated

    async def _namespace(self, raw_request):
        """Namespaces as the API server keeps them (kmock reads /api/v1/namespaces/X as a namespaced
        path): create, read, list; a name taken is its 409, one absent its 404."""
        import re

        from aiohttp import web

        m = re.fullmatch(r"/api/v1/namespaces(?:/([^/]+))?", raw_request.path)
        if m is None:
            return None
        name = m.group(1)

        def status(code, reason, message):
            return web.json_response({"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
                                      "message": message, "reason": reason, "code": code}, status=code)

        if raw_request.method == "POST" and name is None:
            body = await raw_request.json()
            taken = body["metadata"]["name"]
            if taken in self.namespaces:
                return status(409, "AlreadyExists", f'namespaces "{taken}" already exists')
            self.namespaces = {**self.namespaces, taken: body}
            return web.json_response(body, status=201)
        if raw_request.method == "GET" and name is None:
            return web.json_response({"kind": "NamespaceList", "apiVersion": "v1", "metadata": {},
                                      "items": list(self.namespaces.values())})
        if raw_request.method == "GET" and name in self.namespaces:
            return web.json_response(self.namespaces[name])
        return status(404, "NotFound", f'namespaces "{name}" not found')

    async def _dry_run(self, raw_request):
        from aiohttp import web

        body = await raw_request.json()
        self.dry_runs.append((raw_request.path_qs, body))
        if self.refuse is not None and (message := self.refuse(raw_request.path, body)):
            return web.json_response({"apiVersion": "v1", "kind": "Status", "status": "Failure", "code": 400,
                                      "reason": "BadRequest", "message": message}, status=400)
        return web.json_response(body, status=201)

    def serve_exec(self, handler) -> None:
        """Answer pod exec: `await handler(pod, container, command)` -> (stdout bytes, exit code),
        run on the server's loop. Each exec is recorded in `self.execs` as (pod, container, command)."""
        self.execs: list[tuple[str, str, list[str]]] = []
        self.exec_handler = handler

    async def _exec(self, raw_request):
        import json

        from aiohttp import web

        pod, container = raw_request.path.split("/")[-2], raw_request.query.get("container", "")
        command = raw_request.query.getall("command", [])
        self.execs.append((pod, container, command))
        ws = web.WebSocketResponse(protocols=("v4.channel.k8s.io",))
        await ws.prepare(raw_request)
        out, code = await self.exec_handler(pod, container, command)
        await ws.send_bytes(b"\x01" + out)  # channel 1: stdout
        status = {"status": "Success"} if code == 0 else {
            "status": "Failure", "reason": "NonZeroExitCode",
            "details": {"causes": [{"reason": "ExitCode", "message": str(code)}]}}
        await ws.send_bytes(b"\x03" + json.dumps(status).encode())  # channel 3: the exit status
        await ws.close()
        return ws

    def call(self, fn):
        """Run `fn()` on the server's loop (kmock is not thread-safe) and return its result."""
        async def run():
            return fn()
        return self._asyncio.run_coroutine_threadsafe(run(), self.loop).result(10)

    unserved: frozenset[str] = frozenset()

    def forget(self, resource: str) -> None:
        """A cluster without this API (its operator's CRD not installed): discovery leaves it out and
        every request for it gets the API server's 404 (kmock itself would store whatever is posted)."""
        self.unserved = self.unserved | {resource}
        self.call(lambda: self.handler.resources.pop(resource, None))

    def serve(self, resource: str, info: dict | None = None) -> None:
        """The API back, as once its CRD is installed."""
        self.call(lambda: self._register(resource, info or {}))

    def _unserved(self, path: str):
        """The API server's answer to a request for an API it does not serve; None for one it does."""
        import re

        from aiohttp import web

        m = re.match(r"/apis/([^/]+)/([^/]+)/(?:namespaces/[^/]+/)?([^/]+)", path)
        if m is None or "/".join(m.groups()) not in self.unserved:
            return None
        return web.json_response({"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
                                  "message": "the server could not find the requested resource", "reason": "NotFound",
                                  "details": {}, "code": 404}, status=404)

    def route(self, pattern: str, payload) -> None:
        self.call(lambda: self.handler[pattern] << payload)

    def request_count(self) -> int:
        return self.call(lambda: len(self.handler._requests))

    def requests(self, since: int = 0) -> list[tuple[str, str, object]]:
        """(METHOD, path?query, parsed body) of every request the server saw, in order (from the
        `since`-th on)."""
        def snapshot():
            out = []
            for r in self.handler._requests.every()[since:]:
                url = r.url if hasattr(r, "url") else ""
                path = str(url).split(self.url, 1)[-1]
                out.append((str(r.method.value if hasattr(r.method, "value") else r.method).upper(), path, r.data))
            return out
        return self.call(snapshot)

    def create(self, path: str, obj: dict) -> None:
        """POST an object as a controller or installer would (nodes, DaemonSets, CRDs, ...)."""
        import json
        import urllib.request

        req = urllib.request.Request(self.url + path, data=json.dumps(obj).encode(), method="POST",
                                     headers={"Content-Type": "application/json"})
        urllib.request.urlopen(req, timeout=10).read()

    def api(self):
        """An ApiClient for the test itself (playing the operator or the kubelet)."""
        from kubernetes import config

        return config.new_client_from_config(config_file=str(self.kubeconfig))

    def get_job(self, name: str, plural: str = "pytorchjobs", group: str = "kubeflow.org",
                version: str = "v1", namespace: str = "default") -> dict | None:
        """The custom object as stored, or None while it is absent: a resubmission deletes the
        job and creates it again, and a poll can land in between."""
        from kubernetes import client

        try:
            return client.CustomObjectsApi(self.api()).get_namespaced_custom_object(
                group, version, namespace, plural, name)
        except client.ApiException as e:
            if e.status != 404:
                raise
            return None

    def close(self):
        """Stop the server; again is a no-op (a test may close its fixture's server and start another)."""
        if not self._thread.is_alive():
            return
        self.loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(10)


def start_moto(tmp_path: Path):
    """moto in server mode on 127.0.0.1, empty: (server, url, env for the CLI, which reaches it
    through FSDPKIT_AWS_ENDPOINT_URL with throwaway credentials and no config files)."""
    import urllib.request

    moto_server = require("moto.server")
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=0)
    server.start()
    host, port = server.get_host_and_port()
    url = f"http://{host}:{port}"
    # moto keeps its backends per process, across server instances: start every test from empty.
    urllib.request.urlopen(urllib.request.Request(f"{url}/moto-api/reset", method="POST"), timeout=10).read()
    env = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_REGION": "us-west-2",
           "FSDPKIT_AWS_ENDPOINT_URL": url, "AWS_CONFIG_FILE": str(tmp_path / "none"),
           "AWS_SHARED_CREDENTIALS_FILE": str(tmp_path / "none")}
    return server, url, env


@pytest.fixture
def moto(tmp_path):
    """moto in server mode on 127.0.0.1: (url, env for the CLI)."""
    server, url, env = start_moto(tmp_path)
    yield url, env
    server.stop()


def aws_client(url: str, service: str):
    import boto3

    return boto3.client(service, region_name="us-west-2", endpoint_url=url, aws_access_key_id="testing",
                        aws_secret_access_key="testing")


@pytest.fixture
def kube(tmp_path):
    k = KubeMock(tmp_path)
    yield k
    k.close()


@pytest.fixture(scope="session")
def slurm(tmp_path_factory):
    """A real Slurm (slurmctld and two slurmd nodes on 127.0.0.1) for the session; skipped, with the
    reason, where Slurm is not installed or the tests do not run as root."""
    if reason := why_not():
        unavailable(reason)
    cluster = SlurmCluster(tmp_path_factory.mktemp("slurm"))
    cluster.start()
    yield cluster
    cluster.stop()


@pytest.fixture
def slurm_accounting(tmp_path_factory, monkeypatch):
    """A Slurm of its own that keeps accounting (slurmdbd over MariaDB), reached through SLURM_CONF
    in this process: for what sacct answers once the controller has let a job go."""
    if reason := why_not(accounting=True):
        unavailable(reason)
    cluster = SlurmCluster(tmp_path_factory.mktemp("slurm-accounting"), accounting=True)
    cluster.start()
    for k, v in cluster.env.items():
        monkeypatch.setenv(k, v)
    yield cluster
    cluster.stop()

