"""Kubeflow PyTorchJob (and HyperPod) backend: submit, status, logs, cancel, list and wait through
the official `kubernetes` client. Nothing is sent before every input is checked; if a later object
fails to create, the ones this call created are deleted again, so a job is never left half-applied."""

from __future__ import annotations

import copy
import os
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

from fsdpkit.cluster.client import ClusterError, api_errors, api_message, connect, is_not_found
from fsdpkit.errors import UserError
from fsdpkit.jobs import hyperpod, manifests
from fsdpkit.jobs.health import GPU_QUERY, log_progress, network_verdict, parse_gpu_util, pod_findings, pod_summary
from fsdpkit.jobs.manifests import ATTEMPT, JOB_LABEL, KF_JOB_NAME, KF_REPLICA_INDEX, KF_REPLICA_TYPE, MAX_RESUBMITS
from fsdpkit.jobs.spec import JobSpec
from fsdpkit.jobs.status import JobStatus, state_from_conditions

# (group, version, plural) of the job kinds this backend manages.
# The trainer reports its network before the first step: this much of rank 0's log holds it.
NETWORK_HEAD = 256 * 1024
KINDS = {
    "PyTorchJob": ("kubeflow.org", "v1", "pytorchjobs"),
    "HyperPodPyTorchJob": ("sagemaker.amazonaws.com", "v1", "hyperpodpytorchjobs"),
}


def _matches(labels: dict[str, str] | None, wanted: dict[str, str]) -> bool:
    """Label selection done on our side as well: the selector is sent to the API server, and the
    answer is checked again, so a server (or proxy) that ignores labelSelector cannot mix jobs."""
    labels = labels or {}
    return all(labels.get(k) == v for k, v in wanted.items())


def _selector(wanted: dict[str, str]) -> str:
    return ",".join(f"{k}={v}" for k, v in wanted.items())


class KubeBackend:
    name = "pytorchjob"

    def __init__(self, context: str | None = None, kubeconfig: str | None = None,
                 log: Callable[[str], None] | None = None):
        self.context, self.kubeconfig = context, kubeconfig
        self._client: Any = None
        self.log = log or (lambda msg: print(msg, file=sys.stderr))

    # -- plumbing ----------------------------------------------------------------------------------
    @property
    def client(self) -> Any:
        if self._client is None:
            self._client = connect(self.context, self.kubeconfig)
        return self._client

    @property
    def host(self) -> str:
        return self.client.configuration.host

    def _core(self) -> Any:
        from kubernetes import client

        return client.CoreV1Api(self.client)

    def _custom(self) -> Any:
        from kubernetes import client

        return client.CustomObjectsApi(self.client)

    def render(self, spec: JobSpec) -> list[dict[str, Any]]:
        return manifests.render(spec)

    def _get_job(self, name: str, namespace: str) -> tuple[str, dict[str, Any]] | None:
        for kind, (group, version, plural) in KINDS.items():
            try:
                with api_errors(f"reading job {name}", self.host):
                    return kind, self._custom().get_namespaced_custom_object(group, version, namespace, plural, name)
            except Exception as e:
                if not is_not_found(e):
                    raise
        return None

    def _require_job(self, name: str, namespace: str) -> tuple[str, dict[str, Any]]:
        found = self._get_job(name, namespace)
        if found is None:
            raise UserError(f"job {name!r} not found in namespace {namespace} (see `fsdpkit job list`)")
        return found

    # -- submit ------------------------------------------------------------------------------------
    def submit(self, spec: JobSpec, replace: bool = False, dry_run: bool = False) -> dict[str, Any]:
        objs = self.render(spec)
        token = os.environ.get(spec.hf_token_env) if spec.hf_token_env else None
        missing = (f"hf_token_env: ${spec.hf_token_env} is not set in this shell; export it, or drop hf_token_env "
                   "for public models") if spec.hf_token_env and not token else None
        summary = [f"{o['kind']}/{o['metadata']['name']}" for o in objs]
        if dry_run:
            out = {"name": spec.name, "namespace": spec.namespace, "dry_run": True, "objects": summary}
            return {**out, "warnings": [missing]} if missing else out
        if missing:
            raise UserError(missing)
        if self._get_job(spec.name, spec.namespace) is not None:
            if not replace:
                raise UserError(f"job {spec.name!r} already exists in namespace {spec.namespace}; pick another name, "
                                "or pass --replace to delete it and submit again (checkpoints on its storage are kept)")
            self.cancel(spec.name, spec.namespace)
            self._wait_gone(spec.name, spec.namespace)
        created, reused = self.apply(spec, objs, token)
        return {"name": spec.name, "namespace": spec.namespace, "dry_run": False, "created": created,
                "reused": reused}

    def apply(self, spec: JobSpec, objs: list[dict[str, Any]], token: str | None = None) -> tuple[list[str], list[str]]:
        """Create `objs` in order; an existing PVC of this job is reused. If one fails, the ones this
        call created are deleted again. Returns (created, reused) as KIND/NAME."""
        created: list[dict[str, Any]] = []
        reused: list[str] = []
        try:
            for obj in objs:
                kind, name = obj["kind"], obj["metadata"]["name"]
                if kind == "Secret":
                    self._put_secret(manifests.secret_manifest(spec, token))
                    created.append(obj)
                elif kind == "PersistentVolumeClaim":
                    # An existing claim of this job holds the checkpoints of an earlier run: keep it.
                    if self._exists_pvc(name, spec.namespace):
                        reused.append(f"{kind}/{name}")
                    else:
                        with api_errors(f"creating {kind}/{name}", self.host):
                            self._core().create_namespaced_persistent_volume_claim(spec.namespace, obj)
                        created.append(obj)
                else:
                    group, version, plural = KINDS[kind]
                    with api_errors(f"creating {kind}/{name}", self.host):
                        self._custom().create_namespaced_custom_object(group, version, spec.namespace, plural, obj)
                    created.append(obj)
        except BaseException as e:
            self._rollback(created, spec.namespace)
            if is_not_found(e):
                raise ClusterError(f"creating {kind}/{name}: the API server does not know it ({api_message(e)}): "
                                   f"check that namespace {spec.namespace} exists and, for a job, that its operator's "
                                   "CRD is installed (the Kubeflow training operator for PyTorchJob)") from None
            raise
        return [f"{o['kind']}/{o['metadata']['name']}" for o in created], reused

    def _put_secret(self, secret: dict[str, Any]) -> None:
        name, ns = secret["metadata"]["name"], secret["metadata"]["namespace"]
        core = self._core()
        try:
            with api_errors(f"reading Secret/{name}", self.host):
                existing = core.read_namespaced_secret(name, ns)
        except Exception as e:
            if not is_not_found(e):
                raise
            existing = None
        if existing is not None:
            if not _matches(existing.metadata.labels, manifests.MANAGED_BY):
                raise UserError(f"Secret/{name} exists in {ns} and was not made by fsdpkit; delete or rename it")
            with api_errors(f"deleting Secret/{name}", self.host):
                core.delete_namespaced_secret(name, ns)
        with api_errors(f"creating Secret/{name}", self.host):
            core.create_namespaced_secret(ns, secret)

    def _exists_pvc(self, name: str, namespace: str) -> bool:
        try:
            with api_errors(f"reading PersistentVolumeClaim/{name}", self.host):
                self._core().read_namespaced_persistent_volume_claim(name, namespace)
            return True
        except Exception as e:
            if is_not_found(e):
                return False
            raise

    def _rollback(self, created: list[dict[str, Any]], namespace: str) -> None:
        for obj in reversed(created):
            kind, name = obj["kind"], obj["metadata"]["name"]
            try:
                self._delete_object(kind, name, namespace)
                self.log(f"rolled back {kind}/{name}")
            except Exception as e:  # keep rolling back the rest; say what is left
                self.log(f"could not roll back {kind}/{name}: {e}; delete it by hand")

    def _delete_object(self, kind: str, name: str, namespace: str) -> None:
        core = self._core()
        with api_errors(f"deleting {kind}/{name}", self.host):
            if kind == "Secret":
                core.delete_namespaced_secret(name, namespace)
            elif kind == "PersistentVolumeClaim":
                core.delete_namespaced_persistent_volume_claim(name, namespace)
            else:
                group, version, plural = KINDS[kind]
                self._custom().delete_namespaced_custom_object(group, version, namespace, plural, name,
                                                               propagation_policy="Foreground")

    def _wait_gone(self, name: str, namespace: str, timeout: float = 120, poll: float = 1.0) -> None:
        deadline = time.monotonic() + timeout
        while self._get_job(name, namespace) is not None:
            if time.monotonic() > deadline:
                raise ClusterError(f"job {name!r} is still being deleted after {timeout:.0f} s; try again later")
            time.sleep(poll)

    # -- status, list ------------------------------------------------------------------------------
    def _status_of(self, kind: str, obj: dict[str, Any]) -> JobStatus:
        meta, status = obj.get("metadata", {}), obj.get("status") or {}
        conditions = status.get("conditions") or []
        state, message = state_from_conditions(conditions)
        return JobStatus(
            name=meta.get("name", ""), backend=self.name, state=state, message=message,
            namespace=meta.get("namespace"), attempt=int((meta.get("annotations") or {}).get(ATTEMPT, 0)),
            replicas=status.get("replicaStatuses") or {}, conditions=conditions,
            details={"kind": kind, "startTime": status.get("startTime"),
                     "completionTime": status.get("completionTime")},
        )

    def status(self, name: str, namespace: str = "default") -> JobStatus:
        kind, obj = self._require_job(name, namespace)
        return self._status_of(kind, obj)

    def list(self, namespace: str = "default") -> list[JobStatus]:
        out = []
        for kind, (group, version, plural) in KINDS.items():
            try:
                with api_errors(f"listing {plural}", self.host):
                    items = self._custom().list_namespaced_custom_object(
                        group, version, namespace, plural, label_selector=_selector(manifests.MANAGED_BY))["items"]
            except Exception as e:
                if is_not_found(e):  # the CRD is not installed: no jobs of that kind
                    continue
                raise
            out += [self._status_of(kind, o) for o in items
                    if _matches(o.get("metadata", {}).get("labels"), manifests.MANAGED_BY)]
        return sorted(out, key=lambda s: s.name)

    # -- cancel --------------------------------------------------------------------------------------
    def cancel(self, name: str, namespace: str = "default", delete_storage: bool = False) -> list[str]:
        kind, _obj = self._require_job(name, namespace)
        self._delete_object(kind, name, namespace)
        deleted = [f"{kind}/{name}"]
        core = self._core()
        kinds = [("Secret", core.list_namespaced_secret)]
        if delete_storage:
            kinds.append(("PersistentVolumeClaim", core.list_namespaced_persistent_volume_claim))
        sel = {**manifests.MANAGED_BY, JOB_LABEL: name}
        for kind, lister in kinds:  # only what fsdpkit made for this job
            with api_errors(f"listing the job's {kind}s", self.host):
                items = lister(namespace, label_selector=_selector(sel)).items
            for obj in items:
                if _matches(obj.metadata.labels, sel):
                    self._delete_object(kind, obj.metadata.name, namespace)
                    deleted.append(f"{kind}/{obj.metadata.name}")
        return deleted

    # -- logs --------------------------------------------------------------------------------------
    def pods(self, name: str, namespace: str) -> list[Any]:
        sel = {KF_JOB_NAME: name}
        with api_errors(f"listing pods of {name}", self.host):
            items = self._core().list_namespaced_pod(namespace, label_selector=_selector(sel)).items
        found = [p for p in items if _matches(p.metadata.labels, sel)]
        if not found:  # HyperPodPyTorchJob pods carry our own label
            sel = {JOB_LABEL: name}
            with api_errors(f"listing pods of {name}", self.host):
                items = self._core().list_namespaced_pod(namespace, label_selector=_selector(sel)).items
            found = [p for p in items if _matches(p.metadata.labels, sel)]
        return found

    @staticmethod
    def replica_of(pod: Any) -> str:
        labels = pod.metadata.labels or {}
        rtype, index = labels.get(KF_REPLICA_TYPE), labels.get(KF_REPLICA_INDEX)
        return f"{rtype.lower()}-{index}" if rtype and index is not None else pod.metadata.name

    def _pick(self, pods: list[Any], replica: str | None) -> list[Any]:
        by_replica = {self.replica_of(p): p for p in pods}
        if replica == "all":
            return [by_replica[k] for k in sorted(by_replica)]
        if replica:
            if replica not in by_replica:
                raise UserError(f"--replica {replica!r}: no such pod; this job has: {', '.join(sorted(by_replica))}")
            return [by_replica[replica]]
        for first in ("master-0", "worker-0"):  # rank 0 by default
            if first in by_replica:
                return [by_replica[first]]
        return [by_replica[sorted(by_replica)[0]]]

    def logs(self, name: str, namespace: str = "default", follow: bool = False, replica: str | None = None,
             previous: bool = False, wait: float = 600, poll: float = 2.0) -> Iterator[str]:
        """Log lines of the job's rank-0 pod (or `replica`, or every pod with replica='all').
        Waits for the pods to exist and their containers to start before reading."""
        self._require_job(name, namespace)
        deadline = time.monotonic() + wait
        said = False
        while not (pods := self.pods(name, namespace)):
            if time.monotonic() > deadline:
                raise ClusterError(f"job {name!r} has no pods after {wait:.0f} s; see `fsdpkit job status {name}` "
                                   "and `kubectl describe pytorchjob` for scheduling problems")
            if not said:
                self.log(f"waiting for the pods of {name} ...")
                said = True
            time.sleep(poll)
        chosen = self._pick(pods, replica)
        prefix = len(chosen) > 1
        for pod in chosen:
            label = self.replica_of(pod)
            for line in self._pod_log(pod.metadata.name, namespace, follow and not prefix, previous, deadline, poll):
                yield f"[{label}] {line}" if prefix else line

    def _pod_log(self, pod: str, namespace: str, follow: bool, previous: bool, deadline: float,
                 poll: float) -> Iterator[str]:
        from kubernetes.client import ApiException

        while True:
            try:
                resp = self._core().read_namespaced_pod_log(
                    pod, namespace, container=manifests.CONTAINER, follow=follow, previous=previous,
                    _preload_content=False)
                break
            except ApiException as e:
                # 400 while the container is still being created: wait for it, as `kubectl logs -f` does not.
                if e.status == 400 and not previous and time.monotonic() < deadline:
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

    def network(self, name: str, namespace: str = "default") -> dict[str, Any] | None:
        """The network NCCL chose, as the trainer reported it before its first step (the start of
        rank 0's log); None before that line exists."""
        pods = self.pods(name, namespace)
        return self._network_of(self._pick(pods, None)[0].metadata.name, namespace) if pods else None

    def _network_of(self, pod: str, namespace: str) -> dict[str, Any] | None:
        try:
            with api_errors(f"reading logs of {pod}", self.host):
                head = self._core().read_namespaced_pod_log(pod, namespace, container=manifests.CONTAINER,
                                                            limit_bytes=NETWORK_HEAD, _preload_content=False).data
        except Exception as e:  # no container yet, or gone: no verdict yet
            if is_not_found(e) or getattr(e, "status", None) == 400:
                return None
            raise
        return network_verdict(head.decode(errors="replace").splitlines())

    # -- watch ---------------------------------------------------------------------------------------
    def gpu_utilisation(self, pod: str, namespace: str) -> list[dict[str, int]]:
        """nvidia-smi in the pod's container (exec), parsed; [] if it cannot be asked."""
        from kubernetes.stream import stream

        try:
            out = stream(self._core().connect_get_namespaced_pod_exec, pod, namespace, container=manifests.CONTAINER,
                         command=GPU_QUERY, stdout=True, stderr=False, stdin=False, tty=False)
        except Exception:  # no exec permission, no nvidia-smi (CPU pods), websocket blocked: not a finding
            return []
        return parse_gpu_util(out if isinstance(out, str) else "")

    def snapshot(self, name: str, namespace: str = "default", stall_after: float = 900,
                 now: Any = None, gpu: bool = False) -> dict[str, Any]:
        """One look at a running job: state, per-pod phase and restarts, the trainer's latest step,
        loss and tokens/s from rank 0's log, and findings (stall, OOMKilled, crash loop, pending
        reason, NCCL timeout)."""
        import datetime as dt
        import json

        st = self.status(name, namespace)
        with api_errors(f"listing pods of {name}", self.host):
            resp = self._core().list_namespaced_pod(namespace, label_selector=_selector({KF_JOB_NAME: name}),
                                                    _preload_content=False)
        pods = [p for p in json.loads(resp.data or b"{}").get("items") or []
                if _matches((p.get("metadata") or {}).get("labels"), {KF_JOB_NAME: name})]
        findings = pod_findings(pods)
        progress: dict[str, Any] = {}
        network = None
        by_replica = {f"{(p['metadata'].get('labels') or {}).get(KF_REPLICA_TYPE, '').lower()}-"
                      f"{(p['metadata'].get('labels') or {}).get(KF_REPLICA_INDEX)}": p for p in pods}
        rank0 = by_replica.get("master-0") or by_replica.get("worker-0")
        if rank0 is not None and (rank0.get("status") or {}).get("phase") == "Running" and not st.finished:
            pod = rank0["metadata"]["name"]
            try:
                with api_errors(f"reading logs of {pod}", self.host):
                    log = self._core().read_namespaced_pod_log(pod, namespace, container=manifests.CONTAINER,
                                                               tail_lines=500, timestamps=True,
                                                               _preload_content=False).data.decode(errors="replace")
                progress, more = log_progress(log.splitlines(), pod, now or dt.datetime.now(dt.timezone.utc),
                                              stall_after)
                findings += more
                network = network_verdict(log.splitlines()) or self._network_of(pod, namespace)
            except Exception as e:  # a log that cannot be read yet is not a finding of its own
                if not is_not_found(e) and getattr(e, "status", None) != 400:
                    raise
        summaries = [pod_summary(p) for p in pods]
        if gpu:
            for s in summaries:
                if s["phase"] == "Running":
                    s["gpus"] = self.gpu_utilisation(s["name"], namespace)
        return {"name": name, "state": st.state, "attempt": st.attempt, "message": st.message,
                "pods": summaries, "progress": progress, "network": network,
                "findings": [f.to_dict() for f in findings]}

    # -- wait and resubmit ---------------------------------------------------------------------------
    def wait(self, name: str, namespace: str = "default", timeout: float | None = None, poll: float = 10.0,
             on_change: Callable[[JobStatus], None] | None = None) -> JobStatus:
        """Poll until the job ends. A job that ends Failed (beyond what the operator retries) is
        resubmitted from its own manifest while its resubmission budget lasts; the trainer then
        resumes from the newest checkpoint on the job's storage."""
        deadline = None if timeout is None else time.monotonic() + timeout
        last = None
        while True:
            kind, obj = self._require_job(name, namespace)
            st = self._status_of(kind, obj)
            if (st.state, st.attempt) != last and on_change:
                on_change(st)
            last = (st.state, st.attempt)
            if st.state == "Failed":
                budget = int((obj["metadata"].get("annotations") or {}).get(MAX_RESUBMITS, 0))
                if st.attempt < budget:
                    self.log(f"job {name} failed ({st.message or 'no message'}); resubmitting, attempt "
                             f"{st.attempt + 1} of {budget}, resuming from its newest checkpoint")
                    self.resubmit(kind, obj)
                    continue
            if st.finished:
                return st
            if deadline is not None and time.monotonic() > deadline:
                return st
            time.sleep(poll)

    def resubmit(self, kind: str, obj: dict[str, Any]) -> None:
        meta = obj["metadata"]
        fresh = {
            "apiVersion": obj.get("apiVersion"), "kind": kind,
            "metadata": {"name": meta["name"], "namespace": meta.get("namespace"), "labels": meta.get("labels") or {},
                         "annotations": dict(meta.get("annotations") or {})},
            "spec": copy.deepcopy(obj["spec"]),
        }
        fresh["metadata"]["annotations"][ATTEMPT] = str(int(fresh["metadata"]["annotations"].get(ATTEMPT, 0)) + 1)
        group, version, plural = KINDS[kind]
        self._delete_object(kind, meta["name"], meta.get("namespace"))
        self._wait_gone(meta["name"], meta.get("namespace"))
        with api_errors(f"resubmitting {kind}/{meta['name']}", self.host):
            self._custom().create_namespaced_custom_object(group, version, meta.get("namespace"), plural, fresh)


class HyperPodBackend(KubeBackend):
    name = "hyperpod"

    def render(self, spec: JobSpec) -> list[dict[str, Any]]:
        return hyperpod.render(spec)
