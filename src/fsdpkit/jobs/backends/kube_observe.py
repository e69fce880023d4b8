"""Observing Kubernetes jobs: state, list, pods and their logs, the network NCCL chose, each node's
GPU and EFA utilisation, and one look at a running job with its findings (`fsdpkit job watch`)."""

from __future__ import annotations

import datetime as dt
import json
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from fsdpkit.cluster.client import (
    ClusterError,
    api_errors,
    api_message,
    is_forbidden,
    is_not_found,
    label_selector,
    labels_match,
)
from fsdpkit.errors import NotFound, TimedOut, UserError
from fsdpkit.jobs import events, manifests
from fsdpkit.jobs.backends.base import Listing, Snapshot
from fsdpkit.jobs.backends.kube_api import KINDS, KubeAPI, log
from fsdpkit.jobs.health import Finding, log_progress, network_verdict, pod_findings, pod_summary, step_time
from fsdpkit.jobs.manifests import ATTEMPT
from fsdpkit.jobs.status import JobStatus, state_from_conditions, trainer_progress, trainjob_state
from fsdpkit.jobs.utilisation import WatchHistory, asks_for_efa, efa_flat, parse_sample, sample_script, stragglers
from fsdpkit.polling import wait_saying
from fsdpkit.train.observe.nccl_log import NetworkVerdict

# States in which a job has no running pods yet: the events say why.
WAITING = ("Pending", "Created", "Unknown")
# The trainer reports its network before the first step: this much of rank 0's log holds it.
NETWORK_HEAD = 256 * 1024


def _not_yet(e: BaseException) -> bool:
    """A pod's log that cannot be read yet (its container not started: 400) or any more (gone)."""
    return is_not_found(e) or getattr(e, "status", None) == 400


def _kubelet_down(e: BaseException) -> bool:
    """The API server could not reach the pod's kubelet (it relays logs and exec): a 5xx whose
    message is the dial error. What a node that stopped answering looks like from here."""
    return (getattr(e, "status", None) or 0) >= 500


def _condition(obj: dict[str, Any], kind: str) -> dict[str, Any]:
    """A node's or pod's condition of that type ({} when it has none)."""
    found: dict[str, Any] = next((c for c in (obj.get("status") or {}).get("conditions") or []
                                  if c.get("type") == kind), {})
    return found


def _unanswered(e: BaseException) -> bool:
    """A pod's log or exec that this user may not read, or that its kubelet did not serve."""
    return is_forbidden(e) or _kubelet_down(e)


@dataclass
class _Rank0Log:
    """What one read of rank 0's last lines gave a snapshot (nothing, where the log cannot be read)."""

    lines: list[str] = field(default_factory=list)
    progress: dict[str, Any] = field(default_factory=dict)
    findings: list[Finding] = field(default_factory=list)
    network: NetworkVerdict | None = None


def _node_findings(name: str, nodes: list[dict[str, Any]], pods: list[dict[str, Any]], progress: dict[str, Any],
                   stall_after: float) -> list[Finding]:
    """Stragglers among the sampled nodes, and EFA that carries nothing while the job trains."""
    found = stragglers(nodes)
    training = "step" in progress and progress.get("last_step_age_s", stall_after + 1) <= stall_after
    if training and any(asks_for_efa(p) for p in pods):
        found += efa_flat(nodes, name)
    return found


class KubeObserver(KubeAPI):
    def _status_of(self, kind: str, obj: dict[str, Any]) -> JobStatus:
        meta, status = obj.get("metadata", {}), obj.get("status") or {}
        conditions = status.get("conditions") or []
        if kind == "TrainJob":
            state, message = trainjob_state(status)
            replicas = {j.get("name", ""): {k: v for k, v in j.items() if k != "name"}
                        for j in status.get("jobsStatus") or []}
        else:
            state, message = state_from_conditions(conditions)
            replicas = status.get("replicaStatuses") or {}
        if since := meta.get("deletionTimestamp"):   # deleted, its finalizers (the operator's) still at work
            state, message = "Deleting", f"being deleted since {since}" + (
                f" (waiting on {', '.join(meta['finalizers'])})" if meta.get("finalizers") else "")
        return JobStatus(
            name=meta.get("name", ""), backend=KINDS[kind].backend, state=state, message=message,
            namespace=meta.get("namespace"), attempt=int((meta.get("annotations") or {}).get(ATTEMPT, 0)),
            replicas=replicas, conditions=conditions,
            details={"kind": kind, "startTime": status.get("startTime"),
                     "completionTime": status.get("completionTime")},
            progress=trainer_progress(status) if kind == "TrainJob" else None,
        )

    def status(self, name: str) -> JobStatus:
        return self._look(name)[1]

    def _look(self, name: str) -> tuple[str, JobStatus]:
        """The job's kind and state; while it has no running pods, with why from the events
        (jobs.events): the newest reason in `message` and `details["event"]`, and `details["blocked"]`
        where the operator cannot create its pods (a job that will never start as it is)."""
        kind, obj = self._require_job(name, self.namespace)
        st = self._status_of(kind, obj)
        if st.state in WAITING:
            self._why_waiting(st, kind, name)
        return kind, st

    def _why_waiting(self, st: JobStatus, kind: str, name: str) -> None:
        try:
            with api_errors(f"reading the events of {name}", self.host, keep=is_forbidden):
                found = json.loads(self._core().list_namespaced_event(
                    self.namespace, _preload_content=False).data or b"{}").get("items") or []
        except Exception as e:
            if not is_forbidden(e):
                raise
            st.details["gaps"] = {**st.details.get("gaps", {}), "events": api_message(e)}
            return
        if (why := events.why_waiting(found, name, kind)) is None:
            return
        st.details["event"], st.message = why.to_dict(), why.line()
        if why.cannot_create:
            st.details["blocked"] = st.message

    def jobs(self) -> Listing:
        """fsdpkit's jobs of every kind the server serves. A kind this user may not list is named in
        `unread`; when every kind served is refused, the cluster could not be read: an error, never
        "no jobs"."""
        namespace = self.namespace
        out: list[JobStatus] = []
        unread: dict[str, str] = {}
        served = self.served()
        for kind in served:
            group, version, plural = KINDS[kind].find()
            try:
                with api_errors(f"listing {plural}", self.host, keep=is_forbidden):
                    items = self._custom().list_namespaced_custom_object(
                        group, version, namespace, plural, label_selector=label_selector(manifests.MANAGED_BY))["items"]
            except Exception as e:
                if is_forbidden(e):
                    unread[f"{plural}.{group}"] = api_message(e)
                    continue
                if is_not_found(e):  # the CRD went between discovery and now
                    continue
                raise
            out += [self._status_of(kind, o) for o in items
                    if labels_match(o.get("metadata", {}).get("labels"), manifests.MANAGED_BY)]
        if served and len(unread) == len(served):
            raise ClusterError(f"cannot list jobs on the Kubernetes API at {self.host} in namespace {namespace}: "
                               f"every job kind it serves was refused ({'; '.join(unread.values())}); ask the "
                               f"cluster's admin for the Role `fsdpkit cluster rbac --namespace {namespace}` renders",
                               code="access_denied")
        return Listing(sorted(out, key=lambda st: st.name), unread)

    def _raw_pods(self, name: str, namespace: str, kind: str) -> list[dict[str, Any]]:
        """The job's pods as the API returns them (plain JSON: a partial object cannot break a look)."""
        sel = {KINDS[kind].pod_label: name}
        with api_errors(f"listing pods of {name}", self.host):
            resp = self._core().list_namespaced_pod(namespace, label_selector=label_selector(sel),
                                                    _preload_content=False)
        return [p for p in json.loads(resp.data or b"{}").get("items") or []
                if labels_match((p.get("metadata") or {}).get("labels"), sel)]

    def _node_health(self, pods: list[dict[str, Any]], gaps: dict[str, str]) -> dict[str, dict[str, Any]]:
        """Each node that runs one of `pods` and is not Ready, from its Ready condition: node ->
        {node, since, detail}. Nodes are cluster-scoped: a user without that read gets a named gap
        (and the pods' own conditions speak instead)."""
        out: dict[str, dict[str, Any]] = {}
        for node in sorted({str(n) for p in pods if (n := (p.get("spec") or {}).get("nodeName"))}):
            try:
                with api_errors(f"reading node {node}", self.host, keep=is_forbidden):
                    obj = json.loads(self._core().read_node(node, _preload_content=False).data or b"{}")
            except Exception as e:
                if is_forbidden(e):
                    gaps["nodes"] = api_message(e)
                    return out
                if is_not_found(e):  # the node is gone: its pods are lost
                    out[node] = {"node": node, "since": None, "detail": "the node no longer exists"}
                    continue
                raise
            ready = _condition(obj, "Ready")
            if ready.get("status") != "True":
                out[node] = {"node": node, "since": ready.get("lastTransitionTime"),
                             "detail": f"not ready (Ready={ready.get('status', 'Unknown')}"
                                       + (f": {ready['message']}" if ready.get("message") else "") + ")"}
        return out

    @staticmethod
    def _unreachable(nodes: dict[str, dict[str, Any]], pods: list[dict[str, Any]],
                     kubelet: dict[str, str]) -> list[dict[str, Any]]:
        """Per node that is not ready or whose kubelet did not answer: the node, since when, why, and
        its pods. `kubelet`: pod -> the error the API server gave relaying to that pod's kubelet."""
        by_node: dict[str, dict[str, Any]] = {n: dict(v, pods=[]) for n, v in nodes.items()}
        for p in pods:
            pod, node = p["metadata"]["name"], (p.get("spec") or {}).get("nodeName")
            if node and pod in kubelet and node not in by_node:
                ready = _condition(p, "Ready")
                by_node[node] = {"node": node, "since": ready.get("lastTransitionTime")
                                 if ready.get("status") == "False" else None,
                                 "detail": f"kubelet unreachable: {kubelet[pod]}", "pods": []}
            if node in by_node:
                by_node[node]["pods"].append(pod)
        return [by_node[n] for n in sorted(by_node)]

    def describe(self, name: str) -> JobStatus:
        """What `job status` shows of a Kubernetes job: its state, each pod with its node, the network
        NCCL chose, and each node that is not ready or does not answer. A node that stopped answering
        is part of the answer, not a failure of it; what could not be read is named in `gaps`."""
        return self._described(name)[0]

    def _described(self, name: str) -> tuple[JobStatus, NetworkVerdict | None]:
        """`describe`'s answer, and the network verdict its details hold as JSON."""
        namespace = self.namespace
        kind, st = self._look(name)
        k = KINDS[kind]
        pods = self._raw_pods(name, namespace, kind)
        gaps: dict[str, str] = st.details.get("gaps", {})
        kubelet: dict[str, str] = {}
        network = None
        rank0 = self._rank0(pods, kind)
        if rank0 is not None:
            try:
                network = self._network_of(rank0, namespace, k.container)
            except Exception as e:
                if is_forbidden(e):
                    gaps["network"] = api_message(e)
                elif _kubelet_down(e):
                    kubelet[rank0] = api_message(e)
                else:
                    raise
        st.details.update(pods=[pod_summary(p) for p in pods],
                          network=network.to_dict() if network else None,
                          unreachable=self._unreachable(self._node_health(pods, gaps), pods, kubelet), gaps=gaps)
        return st, network

    def _rank0(self, pods: list[dict[str, Any]], kind: str) -> str | None:
        """The pod that holds rank 0 (its log has the network verdict and the progress lines)."""
        k = KINDS[kind]
        first = k.first_rank0({k.replica((p.get("metadata") or {}).get("labels") or {}) or "": p for p in pods})
        return first["metadata"]["name"] if first is not None else None

    # -- logs --------------------------------------------------------------------------------------
    def pods(self, name: str, namespace: str, kind: str | None = None) -> list[Any]:
        """The job's pods, found by the label its operator (or fsdpkit) puts on them."""
        kind = kind or self._require_job(name, namespace)[0]
        sel = {KINDS[kind].pod_label: name}
        with api_errors(f"listing pods of {name}", self.host):
            items = self._core().list_namespaced_pod(namespace, label_selector=label_selector(sel)).items
        return [p for p in items if labels_match(p.metadata.labels, sel)]

    @staticmethod
    def replica_of(pod: Any, kind: str = "PyTorchJob") -> str:
        return KINDS[kind].replica(pod.metadata.labels or {}) or pod.metadata.name

    def _pick(self, pods: list[Any], replica: str | None, kind: str) -> list[Any]:
        by_replica = {self.replica_of(p, kind): p for p in pods}
        if replica == "all":
            return [by_replica[k] for k in sorted(by_replica)]
        if replica:
            if replica not in by_replica:
                raise UserError(f"--replica {replica!r}: no such pod; this job has: {', '.join(sorted(by_replica))}")
            return [by_replica[replica]]
        first = KINDS[kind].first_rank0(by_replica)  # rank 0 by default
        return [first if first is not None else by_replica[sorted(by_replica)[0]]]

    def logs(self, name: str, follow: bool = False, replica: str | None = None, previous: bool = False,
             wait: float = 600, poll: float = 2.0) -> Iterator[str]:
        """Log lines of the job's rank-0 pod (or `replica`, or every pod with replica='all').
        Waits up to `wait` seconds for the pods to exist and their containers to start, saying what
        it waits on; a job that is deleted, or that ended and whose pods are gone, has no logs to
        wait for: one line at once."""
        namespace = self.namespace
        kind, obj = self._require_job(name, namespace)
        self._not_deleting(name, obj)
        deadline = time.monotonic() + wait

        def look() -> tuple[list[Any], JobStatus | None]:
            pods = self.pods(name, namespace, kind)
            if pods:
                return pods, None
            found = self.get_job(name, namespace)
            return [], self._status_of(*found) if found else None

        def what(seen: tuple[list[Any], JobStatus | None], waited: str) -> str | None:
            pods, st = seen
            if pods or st is None or st.finished:
                return None
            return f"waiting for the pods of {name} (job {st.state}, {waited}) ..."

        pods, st = wait_saying(look, lambda seen: bool(seen[0]) or seen[1] is None or seen[1].finished, wait, poll,
                               what, log.info)
        if not pods:
            if st is None:
                raise NotFound(f"job {name!r} was deleted while waiting for its pods; it has no logs")
            if st.finished:
                raise NotFound(f"job {name!r} ended {st.state} and its pods are gone, so are their logs; what it "
                               f"wrote is on its storage (see `fsdpkit ckpt list` and its run directory)")
            raise TimedOut(f"job {name!r} has no pods after {wait:g} s (job {st.state}); see `fsdpkit job status "
                           f"{name}` and `kubectl describe {kind.lower()} {name}` for scheduling problems")
        chosen = self._pick(pods, replica, kind)
        prefix = len(chosen) > 1
        for pod in chosen:
            label = self.replica_of(pod, kind)
            for line in self._pod_log(pod.metadata.name, namespace, KINDS[kind].container, follow and not prefix,
                                      previous, deadline, poll):
                yield f"[{label}] {line}" if prefix else line

    @staticmethod
    def _not_deleting(name: str, obj: dict[str, Any]) -> None:
        """A job being deleted (its pods going with it) has nothing left to follow."""
        if (obj.get("metadata") or {}).get("deletionTimestamp"):
            raise NotFound(f"job {name!r} is being deleted (since {obj['metadata']['deletionTimestamp']}); "
                           "it has no logs to follow")

    def _pod_log(self, pod: str, namespace: str, container: str, follow: bool, previous: bool, deadline: float,
                 poll: float) -> Iterator[str]:
        from kubernetes.client import ApiException

        said = False
        while True:
            try:
                resp = self._core().read_namespaced_pod_log(
                    pod, namespace, container=container, follow=follow, previous=previous,
                    _preload_content=False)
                break
            except ApiException as e:
                # 400 while the container is still being created: wait for it, as `kubectl logs -f` does not.
                if e.status == 400 and not previous:
                    if time.monotonic() >= deadline:
                        raise TimedOut(f"pod {pod}'s container has not started ({api_message(e)}); see `kubectl "
                                       f"describe pod {pod} -n {namespace}`") from None
                    if not said:
                        log.info(f"waiting for {pod} to start ({api_message(e)}) ...")
                        said = True
                    time.sleep(poll)
                    continue
                with api_errors(f"reading logs of {pod}", self.host):
                    raise
        pending = b""
        try:
            for chunk in resp.stream(amt=65536, decode_content=True):
                pending += chunk
                *lines, pending = pending.split(b"\n")
                for line in lines:
                    yield line.decode(errors="replace")
            if pending:
                yield pending.decode(errors="replace")
        finally:
            resp.release_conn()

    def network(self, name: str) -> NetworkVerdict | None:
        """The network NCCL chose, as the trainer reported it before its first step (the start of
        rank 0's log); None before that line exists, or where it cannot be read (see `describe`)."""
        return self._described(name)[1]

    def _network_of(self, pod: str, namespace: str, container: str) -> NetworkVerdict | None:
        try:
            with api_errors(f"reading logs of {pod}", self.host, keep=_unanswered):
                head = self._core().read_namespaced_pod_log(pod, namespace, container=container,
                                                            limit_bytes=NETWORK_HEAD, _preload_content=False).data
        except Exception as e:  # no container yet, or gone: no verdict yet
            if _not_yet(e):
                return None
            raise  # refused, or its kubelet did not answer: untranslated, for the caller to name
        return network_verdict(head.decode(errors="replace").splitlines())

    # -- watch ---------------------------------------------------------------------------------------
    def sample_node(self, pod: str, namespace: str, container: str, window: float) -> dict[str, Any]:
        """GPU utilisation and memory and EFA bytes/s of the pod's node over `window` seconds (one exec
        of the sample script); {"error": why} when the pod cannot be asked."""
        from kubernetes import client
        from kubernetes.stream import stream

        # stream() swaps its ApiClient's request method while it runs: one client per call, so pods
        # are sampled in parallel threads safely.
        with client.ApiClient(self.client.configuration) as api:
            try:
                out = stream(client.CoreV1Api(api).connect_get_namespaced_pod_exec, pod, namespace,
                             container=container, command=["sh", "-c", sample_script(window)], stdout=True,
                             stderr=False, stdin=False, tty=False, _request_timeout=window + 30)
            except Exception as e:  # no exec permission, container gone, websocket blocked: not a finding
                return {"error": f"cannot exec into {pod}: {str(e).splitlines()[0][:160]}"}
        return parse_sample(out if isinstance(out, str) else "", window).to_dict()

    def _pod_log_tail(self, pod: str, namespace: str, container: str, lines: int) -> str:
        with api_errors(f"reading logs of {pod}", self.host, keep=_kubelet_down):
            raw: bytes = self._core().read_namespaced_pod_log(pod, namespace, container=container, tail_lines=lines,
                                                              timestamps=True, _preload_content=False).data
            return raw.decode(errors="replace")

    def _nodes(self, pods: list[dict[str, Any]], namespace: str, container: str, window: float,
               rank0: str | None, rank0_log: list[str], kubelet: dict[str, str]) -> list[dict[str, Any]]:
        """Per running pod (one per node): the node's sample and its own step time from its log. A pod
        whose kubelet does not answer goes into `kubelet` (pod -> why) and is not sampled."""
        running = [p for p in pods if (p.get("status") or {}).get("phase") == "Running"
                   and p["metadata"]["name"] not in kubelet]

        def one(p: dict[str, Any]) -> dict[str, Any]:
            name = p["metadata"]["name"]
            row: dict[str, Any] = {"pod": name, "node": (p.get("spec") or {}).get("nodeName")}
            row.update(self.sample_node(name, namespace, container, window))
            try:
                lines = rank0_log if name == rank0 else self._pod_log_tail(name, namespace, container, 50).splitlines()
            except Exception as e:  # a log that cannot be read yet, or whose node does not answer: no step time
                if _kubelet_down(e):
                    kubelet[name] = api_message(e)
                elif not _not_yet(e):
                    raise
                lines = []
            row["step_time_s"] = step_time(lines)
            return row
        if not running:
            return []
        with ThreadPoolExecutor(max_workers=min(16, len(running))) as pool:
            return list(pool.map(one, running))

    def _rank0_log(self, pod: str, container: str, now: Any, stall_after: float,
                   kubelet: dict[str, str]) -> _Rank0Log:
        """Rank 0's last lines, read once for progress, its findings (a stall) and the network; a log
        that cannot be read yet is not a finding of its own, a kubelet that does not answer goes
        into `kubelet`."""
        look = _Rank0Log()
        try:
            look.lines = self._pod_log_tail(pod, self.namespace, container, 500).splitlines()
            look.progress, look.findings = log_progress(look.lines, pod, now or dt.datetime.now(dt.timezone.utc),
                                                        stall_after)
            look.network = network_verdict(look.lines) or self._network_of(pod, self.namespace, container)
        except Exception as e:
            if _kubelet_down(e):
                kubelet[pod] = api_message(e)
            elif not _not_yet(e):
                raise
        return look

    def snapshot(self, name: str, stall_after: float = 900, now: Any = None, sample: float = 0,
                 history: WatchHistory | None = None) -> Snapshot:
        """One look at a running job: state, per-pod phase and restarts, the trainer's latest step,
        loss and tokens/s from rank 0's log, and findings (stall, OOMKilled, crash loop, pending
        reason, NCCL timeout). With `sample` seconds, also each node's GPU and EFA rates over that
        window and its step time, with stragglers and flat EFA among the findings. A node that is not
        ready or whose kubelet does not answer is named in `unreachable`; the look goes on."""
        namespace = self.namespace
        kind, st = self._look(name)
        k = KINDS[kind]
        pods = self._raw_pods(name, namespace, kind)
        findings = pod_findings(pods)
        if blocked := st.details.get("blocked"):   # no pod to find it on: the job's own finding
            findings.append(Finding("cannot_create", "", blocked, "fix what it names in the spec and submit it again "
                                                                  "(job submit --replace)"))
        kubelet: dict[str, str] = {}
        rank0_name = self._rank0(pods, kind)
        rank0 = next((p for p in pods if p["metadata"]["name"] == rank0_name), None)
        running = bool(rank0_name and rank0 and (rank0.get("status") or {}).get("phase") == "Running")
        look = self._rank0_log(rank0_name, k.container, now, stall_after, kubelet) \
            if rank0_name and running and not st.finished else _Rank0Log()
        findings += look.findings
        nodes = self._nodes(pods, namespace, k.container, sample, rank0_name, look.lines, kubelet) \
            if sample and not st.finished else []
        if nodes:
            findings += _node_findings(name, nodes, pods, look.progress, stall_after)
            if history is not None:
                history.add(nodes)
        gaps: dict[str, str] = st.details.get("gaps", {})
        unreachable = self._unreachable(self._node_health(pods, gaps), pods, kubelet)
        return Snapshot(name, st.state, st.attempt, st.message, st.details.get("event"), st.details.get("blocked"),
                        [pod_summary(p) for p in pods], nodes, look.progress,
                        look.network.to_dict() if look.network else None, unreachable, gaps,
                        [f.to_dict() for f in findings])
