"""HyperPod's in-memory checkpoint store, scripted for tests: the HTTP routes that
amzn-sagemaker-checkpointing's InMemoryCheckpointClient calls (namespaces, shards by rank and step,
the latest complete steps), each shard kept with the checksum header the client verifies on read.

The client's address is fixed (`ai-toolkit-gossip-headless.aws-hyperpod.svc.cluster.local:9200`,
a cluster Service), so the store is reached as an HTTP proxy: a process given `env` sends it every
request for that address, with the client's own code unchanged."""

from __future__ import annotations

import json
import re
import threading
from http.server import ThreadingHTTPServer
from urllib.parse import parse_qs, urlsplit

from http_reply import QuietHandler

NAMESPACE = re.compile(r"^/v1/cp/namespaces/([^/]+)$")
SHARD = re.compile(r"^/v1/cp/checkpoints/([^/]+)/(\d+)/(\d+)$")
LATEST = re.compile(r"^/v1/cp/checkpoints/([^/]+)/latest$")


class MemoryStore:
    def __init__(self) -> None:
        self.namespaces: dict[str, dict[str, int]] = {}
        self.shards: dict[tuple[str, int, int], tuple[bytes, str]] = {}
        self.requests: list[tuple[str, str]] = []   # (method, path) as received
        self.lock = threading.Lock()
        store = self

        class Handler(QuietHandler):
            def _route(self, method: str) -> None:
                url = urlsplit(self.path)
                query = {k: v[0] for k, v in parse_qs(url.query).items()}
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                with store.lock:
                    store.requests.append((method, url.path))
                    code, payload, headers = store.handle(method, url.path, query, body, self.headers)
                self.reply(code, payload, headers)

            def do_GET(self) -> None:
                self._route("GET")

            def do_POST(self) -> None:
                self._route("POST")

            def do_DELETE(self) -> None:
                self._route("DELETE")

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    @property
    def env(self) -> dict[str, str]:
        """A process's environment that sends the client's requests here (and nothing else)."""
        proxy = f"http://127.0.0.1:{self.server.server_address[1]}"
        return {"HTTP_PROXY": proxy, "http_proxy": proxy, "NO_PROXY": "127.0.0.1,localhost",
                "no_proxy": "127.0.0.1,localhost"}

    def complete_steps(self, namespace: str) -> list[int]:
        """Steps every rank and the metadata shard have written, newest first."""
        ranks = self.namespaces.get(namespace, {}).get("num_ranks", 0)
        steps: dict[int, set[int]] = {}
        for ns, rank, step in self.shards:
            if ns == namespace:
                steps.setdefault(step, set()).add(rank)
        return sorted((s for s, r in steps.items() if len(r) == ranks), reverse=True)

    def handle(self, method: str, path: str, query: dict[str, str], body: bytes,
               headers) -> tuple[int, bytes, dict[str, str]]:
        if m := NAMESPACE.match(path):
            ns = m.group(1)
            if method == "POST":
                self.namespaces[ns] = {"num_ranks": int(query["num_ranks"]),
                                       "steps_retained": int(query["steps_retained"])}
            elif method == "DELETE":
                self.namespaces.pop(ns, None)
            if ns not in self.namespaces:
                return 404, b'{"error": "namespace not found"}', {}
            return 200, json.dumps({"name": ns, **self.namespaces[ns]}).encode(), {}
        if m := LATEST.match(path):
            steps = self.complete_steps(m.group(1))[:int(query.get("limit", 5))]
            return 200, json.dumps(steps).encode(), {}
        if m := SHARD.match(path):
            key = (m.group(1), int(m.group(2)), int(m.group(3)))
            if method == "POST":
                if key[0] not in self.namespaces:
                    return 404, b'{"error": "namespace not found"}', {}
                self.shards[key] = (body, headers["Shard-Meta"])
                self._retain(key[0])
                return 200, b"{}", {}
            if method == "DELETE":
                self.shards.pop(key, None)
                return 200, b"{}", {}
            if key not in self.shards:
                return 404, b'{"error": "not found"}', {}
            data, meta = self.shards[key]
            return 200, data, {"Shard-Meta": meta}
        return 404, b'{"error": "no such route"}', {}

    def _retain(self, namespace: str) -> None:
        """Only the newest `steps_retained` complete steps are kept (older shards are dropped)."""
        keep = set(self.complete_steps(namespace)[:self.namespaces[namespace]["steps_retained"]])
        newest = max(keep, default=-1)
        for key in [k for k in self.shards if k[0] == namespace and k[2] < newest and k[2] not in keep]:
            del self.shards[key]

    def close(self) -> None:
        self.server.shutdown()
