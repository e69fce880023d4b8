"""Submitting Kubernetes jobs: create a job's objects in order (rolled back if one fails), cancel
a job with what fsdpkit made for it, and resubmit a failed one from its own manifest. Nothing is
sent before every input is checked, so a job is never left half-applied. Every create asks for
strict field validation: a field the cluster's CRD does not know is refused, not silently pruned
(an operator older than the manifest would otherwise run a job without what it was told)."""

from __future__ import annotations

import copy
import os
from collections.abc import Callable
from typing import Any

from fsdpkit.cluster import kueue, quota, trainer
from fsdpkit.cluster.client import (
    ClusterError,
    api_errors,
    api_message,
    api_resources,
    is_forbidden,
    is_not_found,
    label_selector,
    labels_match,
)
from fsdpkit.cluster.pod_rules import templates
from fsdpkit.cluster.pods import dry_run_pods
from fsdpkit.errors import Conflict, TimedOut, UserError
from fsdpkit.jobs import devices, manifests
from fsdpkit.jobs.backends.base import Rendered, Submitted
from fsdpkit.jobs.backends.kube_api import KINDS, SUPPORT, KubeAPI, log
from fsdpkit.jobs.manifests import ATTEMPT, JOB_LABEL
from fsdpkit.jobs.resolved import ResolvedJob
from fsdpkit.jobs.spec import JobSpec
from fsdpkit.polling import poll_until, wait_saying

CLAIM_GONE_S = 120.0   # how long a submit waits for a claim being deleted to go
KUEUE_ANSWER_S = 15.0  # how long a submit on a queue waits for Kueue's verdict on the job's Workload


class KubeSubmitter(KubeAPI):
    def render(self, job: ResolvedJob) -> Rendered:
        return Rendered(manifests=manifests.render(job), pod_security=job.spec.security)

    def submit(self, job: ResolvedJob, replace: bool = False, dry_run: str | None = None) -> Submitted:
        """Create the job's objects. `dry_run` "client": only render and say what would be made;
        "server": the API server validates each create (schemas, strict fields, admission) and
        persists nothing."""
        spec, objs = job.spec, self.render(job).objects()   # every input checked before the cluster is asked
        if dry_run != "client" and (placed := self.placed(job)) is not job:
            job, objs = placed, self.render(placed).objects()
        token = os.environ.get(spec.hf_token_env) if spec.hf_token_env else None
        missing = (f"hf_token_env: ${spec.hf_token_env} is not set in this shell; export it, or drop hf_token_env "
                   "for public models") if spec.hf_token_env and not token else None
        summary = [f"{o['kind']}/{o['metadata']['name']}" for o in objs]
        if dry_run:
            out = Submitted(spec.name, dry_run, spec.namespace, objects=summary, manifests=objs,
                            warnings=[missing] if missing else None)
            if dry_run == "server":
                self.require_operator(objs[-1]["kind"], spec.namespace)
                self.require_access("job submit --dry-run=server", objs[-1]["kind"], spec.namespace, objs)
                self.require_release(objs[-1]["kind"])
                self.require_queue(spec)
                out.accepted, out.existing = self.server_dry_run(spec, objs, replace)
            return out
        if missing:
            raise UserError(missing)
        self.require_access("job submit --replace" if replace else "job submit", objs[-1]["kind"], spec.namespace,
                            objs)
        # Everything that could refuse the new job before the old one is deleted for --replace.
        self.require_operator(objs[-1]["kind"], spec.namespace)
        self.require_release(objs[-1]["kind"])
        queue = self.require_queue(spec)
        exists = self.get_job(spec.name, spec.namespace) is not None
        if exists and not replace:
            raise Conflict(f"job {spec.name!r} already exists in namespace {spec.namespace}; pick another name, "
                            "or pass --replace to delete it and submit again (checkpoints on its storage are kept)")
        # The pods' admission before anything exists: a refused pod would otherwise surface only as the
        # operator's FailedCreate events on a job said to be submitted.
        self.require_quota(spec, objs, replacing=exists)
        dry_run_pods(self._core(), objs[-1], self.host, objs)
        if exists:
            self._cancel(spec.name, spec.namespace)
            self._wait_gone(spec.name, spec.namespace)
        created, reused = self.apply(spec, objs, token)
        admission = None if queue is None else self.admitted(spec, objs, created, queue).to_dict()
        return Submitted(spec.name, False, spec.namespace, created=created, reused=reused, admission=admission)

    def admitted(self, spec: JobSpec, objs: list[dict[str, Any]], created: list[str],
                 queue: tuple[str, str]) -> kueue.Admission:
        """Kueue's verdict on the job just created, from its Workload's QuotaReserved condition: a
        job over what its ClusterQueue could ever have is taken back (what this submit created
        deleted) and refused in one line naming the quota; one waiting for quota in use is said and
        kept; silence within KUEUE_ANSWER_S is said too."""
        kind, (version, cluster_queue) = objs[-1]["kind"], queue
        group = kueue.GROUP

        def look() -> kueue.Admission:
            with api_errors(f"reading Kueue's Workloads in {spec.namespace}", self.host, keep=is_forbidden):
                found = self._custom().list_namespaced_custom_object(
                    group, version, spec.namespace, "workloads", _preload_content=False).json().get("items") or []
            return kueue.admission(next((w for w in found if kueue.owned_by(w, kind, spec.name)), None))

        try:
            answer = poll_until(look, lambda a: a.state != "unanswered", KUEUE_ANSWER_S, 1.0)
        except Exception as e:
            if not is_forbidden(e):
                raise
            log.info(f"note: Kueue's verdict not read ({api_message(e)})")
            return kueue.Admission("unanswered", api_message(e))
        where = f"queue {spec.queue} (ClusterQueue {cluster_queue})"
        if answer.state == "never":
            self._rollback([o for o in objs if f"{o['kind']}/{o['metadata']['name']}" in created], spec.namespace,
                           log.debug)
            raise ClusterError(f"{where}: Kueue will never admit job {spec.name}: {answer.message}; ask for less "
                               "(nodes, gpus_per_node) or for the team's quota to be raised; nothing was left "
                               "behind", code="refused")
        if answer.state == "queued":
            log.warning(f"job {spec.name} is queued in {where}, not admitted: {answer.message}; it starts when "
                        f"quota frees (kubectl -n {spec.namespace} get workloads)")
        elif answer.state == "unanswered":
            log.info(f"job {spec.name} is in {where}; Kueue gave no verdict within {KUEUE_ANSWER_S:.0f} s "
                     f"(kubectl -n {spec.namespace} get workloads)")
        return answer

    def placed(self, job: ResolvedJob) -> ResolvedJob:
        """The job with its devices chosen against this cluster: DRA where it serves
        resource.k8s.io/v1 with the drivers' DeviceClasses (devices auto or dra), said in one line."""
        if not devices.asks_cluster(job.spec):
            return job
        offer = self.dra_offer()
        placed = job.on_cluster(offer)
        if offer.served:   # said where DRA was there to choose: what was chosen, or what it lacked
            log.info(f"devices: {'DRA claims' if placed.devices.mode == 'dra' else 'extended resources'} "
                     f"({placed.devices.why})")
        return placed

    def dra_offer(self) -> devices.DraOffer:
        """Whether the cluster serves resource.k8s.io/v1 (discovery, open to every user) and which
        DeviceClasses it has (cluster-scoped: a namespace user may be refused, which is said)."""
        group, version = devices.API_VERSION.split("/")
        if "deviceclasses" not in (api_resources(self._custom(), group, version, self.host,
                                                 "finding Dynamic Resource Allocation's API") or ()):
            return devices.DraOffer(False)
        try:
            with api_errors("reading the cluster's DeviceClasses", self.host, keep=is_forbidden):
                found = self._custom().list_cluster_custom_object(group, version, "deviceclasses",
                                                                  _preload_content=False).json()
        except Exception as e:
            if is_not_found(e):   # gone since discovery answered
                return devices.DraOffer(False)
            if not is_forbidden(e):
                raise
            return devices.DraOffer(True, unread=api_message(e))
        return devices.DraOffer(True, frozenset(str((o.get("metadata") or {}).get("name"))
                                                for o in found.get("items") or []))

    def server_dry_run(self, spec: JobSpec, objs: list[dict[str, Any]], replace: bool) -> tuple[list[str], list[str]]:
        """Each object a submit would create, sent as a create with dryRun=All: the API server runs
        every check it would run for real (schema, strict fields, admission webhooks) and stores
        nothing. The Secret goes with its placeholder, never the token. What exists already is
        what the submit would reuse (a PVC) or replace (the Secret; the job with --replace), and is
        not sent. Then one Pod of each kind the job's operator will create, the same way: the
        job object passes admission that its pods do not (Pod Security, PriorityClass, quotas,
        LimitRanges, webhooks on pods), and those would refuse only once the job exists, in its
        events. A 409 for a pod means admission let it through (an old pod has its name).
        Returns (accepted, existing) as KIND/NAME."""
        if not replace and self.get_job(spec.name, spec.namespace) is not None:
            raise Conflict(f"job {spec.name!r} already exists in namespace {spec.namespace}; pick another name, or "
                           "pass --replace to delete it and submit again (checkpoints on its storage are kept)")
        self.require_quota(spec, objs, replacing=replace and self.get_job(spec.name, spec.namespace) is not None)
        accepted, existing = [], []
        for obj in objs:
            kind, name = obj["kind"], obj["metadata"]["name"]
            if self._exists(kind, name, spec.namespace):
                existing.append(f"{kind}/{name}")
                continue
            with api_errors(f"server dry run of {kind}/{name}", self.host):
                self._create(spec.namespace, obj, dry_run="All")
            accepted.append(f"{kind}/{name}")
        return accepted + dry_run_pods(self._core(), objs[-1], self.host, objs), existing

    def require_quota(self, spec: JobSpec, objs: list[dict[str, Any]], replacing: bool) -> None:
        """The job's pods in all against each ResourceQuota of the namespace (cluster.quota): over
        one is refused in one line naming it, before anything is made. Replacing a job whose pods
        still count as used, only the hard limits are held. A user who may not read quotas is told
        the pods are held to them one at a time."""
        try:
            with api_errors(f"reading the ResourceQuotas of namespace {spec.namespace}", self.host, keep=is_forbidden):
                found = self._core().list_namespaced_resource_quota(
                    spec.namespace, _preload_content=False).json().get("items") or []
        except Exception as e:
            if not is_forbidden(e):
                raise
            log.info(f"note: the namespace's ResourceQuotas not read ({api_message(e)}); each pod is still held "
                     "to them, one at a time")
            return
        pods = quota.replicas(objs[-1])
        if over := quota.excesses(found, pods, against_hard_only=replacing):
            raise ClusterError(f"{over[0].line(sum(n for n, _ in pods))}; ask for less (nodes, gpus_per_node) or for "
                               "the quota to be raised; nothing was created", code="refused")

    def require_release(self, kind: str) -> None:
        """A TrainJob needs Trainer's controller at MIN_VERSION or newer: an older one is refused in
        one line, before anything is made, naming both. The release is its image's tag; where the
        controller cannot be read (a namespace user) or its tag names no release, that is said."""
        if kind != "TrainJob":
            return
        selector = label_selector({k: v for k, v in trainer.CONTROLLER_LABELS[0].items() if v is not None})
        try:
            with api_errors("reading Kubeflow Trainer's controller", self.host, keep=is_forbidden):
                found = self._apps().list_deployment_for_all_namespaces(
                    label_selector=selector, _preload_content=False).json().get("items") or []
        except Exception as e:
            if not is_forbidden(e):
                raise
            log.info(f"note: Kubeflow Trainer's release not checked ({api_message(e)}); this job needs "
                     f"{trainer.NEEDS}")
            return
        images = trainer.controller_images(found)
        versions = [v for v in map(trainer.image_version, images) if v is not None]
        if not versions:
            if images:
                log.warning(f"Kubeflow Trainer's release not known from its image ({images[0]}); this job "
                            f"needs {trainer.NEEDS}")
            return
        running = min(versions)
        if running < trainer.MIN_VERSION:
            raise ClusterError(f"TrainJob: this cluster runs Kubeflow Trainer v{'.'.join(map(str, running))}; this "
                               f"job needs {trainer.NEEDS}; upgrade it: fsdpkit cluster addons install --only "
                               "trainer, or submit with --set backend=pytorchjob")

    def require_queue(self, spec: JobSpec) -> tuple[str, str] | None:
        """The spec's Kueue LocalQueue exists in the job's namespace: on a queue that does not, the job
        is created and then waits for ever, never admitted (only its Workload says why). A user who
        may not read LocalQueues is told the queue went unchecked. Returns (the Kueue API version
        served, the queue's ClusterQueue or "unread"); None without a queue."""
        if not spec.queue:
            return None
        version = kueue.served_version(self._custom(), self.host)
        if version is None:
            raise ClusterError(f"queue: {spec.queue}: this cluster has no Kueue (no {kueue.GROUP} API); install "
                               "Kueue, or drop queue", code="not_found")
        try:
            with api_errors(f"reading Kueue LocalQueue {spec.queue}", self.host, keep=is_forbidden):
                local = self._custom().get_namespaced_custom_object(kueue.GROUP, version, spec.namespace,
                                                                    "localqueues", spec.queue)
            return version, str((local.get("spec") or {}).get("clusterQueue") or "unnamed")
        except Exception as e:
            if is_not_found(e):
                raise ClusterError(f"queue: no Kueue LocalQueue {spec.queue!r} in namespace {spec.namespace}; pick "
                                   f"one of `kubectl get localqueues -n {spec.namespace}`", code="not_found") from None
            if not is_forbidden(e):
                raise
            log.warning(f"queue {spec.queue!r} not checked: {api_message(e)}")
            return version, "unread"

    def _create(self, namespace: str, obj: dict[str, Any], **kw: Any) -> None:
        """One create, with strict field validation."""
        kw["field_validation"] = "Strict"
        kind = obj["kind"]
        if kind == "Secret":
            self._core().create_namespaced_secret(namespace, obj, **kw)
        elif kind == "PersistentVolumeClaim":
            self._core().create_namespaced_persistent_volume_claim(namespace, obj, **kw)
        elif kind in SUPPORT:
            group, version, plural = SUPPORT[kind]
            self._custom().create_namespaced_custom_object(group, version, namespace, plural, obj, **kw)
        else:
            group, version, plural = KINDS[kind].find()
            self._custom().create_namespaced_custom_object(group, version, namespace, plural, obj, **kw)

    def require_operator(self, kind: str, namespace: str) -> None:
        """Before anything is created: the cluster serves this job kind, else one line naming what
        installs it and the backends this cluster does run."""
        if self.serves(kind, namespace):
            return
        have = [f"{k.backend} ({k.kind})" for k in KINDS.values()
                if k.kind != kind and self.serves(k.kind, namespace)]
        raise ClusterError(f"{kind}: this cluster has no such API; install {KINDS[kind].operator}"
                           + (f", or submit with the backend it runs: {', '.join(have)} (--set backend=...)"
                              if have else ""))

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
                    # An existing claim of this job holds the checkpoints of an earlier run: keep it;
                    # one being deleted (a rollback a moment ago) is waited out, never reused.
                    self._wait_claim_deleted(name, spec.namespace)
                    if self._exists(kind, name, spec.namespace):
                        reused.append(f"{kind}/{name}")
                    else:
                        with api_errors(f"creating {kind}/{name}", self.host):
                            self._create(spec.namespace, obj)
                        created.append(obj)
                else:
                    with api_errors(f"creating {kind}/{name}", self.host):
                        self._create(spec.namespace, obj)
                    created.append(obj)
        except BaseException as e:
            self._rollback(created, spec.namespace)
            if is_not_found(e):
                raise ClusterError(f"creating {kind}/{name}: the API server does not know it ({api_message(e)}): "
                                   f"check that namespace {spec.namespace} exists and, for a job, that its operator's "
                                   f"CRD is installed ({KINDS[kind].operator if kind in KINDS else 'its operator'})"
                                   ) from None
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
            if not labels_match(existing.metadata.labels, manifests.MANAGED_BY):
                raise UserError(f"Secret/{name} exists in {ns} and was not made by fsdpkit; delete or rename it")
            with api_errors(f"deleting Secret/{name}", self.host):
                core.delete_namespaced_secret(name, ns)
        with api_errors(f"creating Secret/{name}", self.host):
            self._create(ns, secret)

    def _wait_claim_deleted(self, name: str, namespace: str, timeout: float = CLAIM_GONE_S, poll: float = 2.0) -> None:
        """A claim with a deletionTimestamp (kept by its pvc-protection finalizer until no pod uses
        it) would pass for the job's checkpoints and then vanish: wait until it is gone."""
        def deleting() -> bool:
            try:
                with api_errors(f"reading PersistentVolumeClaim/{name}", self.host):
                    claim = self._core().read_namespaced_persistent_volume_claim(name, namespace)
            except Exception as e:
                if is_not_found(e):
                    return False
                raise
            return claim.metadata.deletion_timestamp is not None

        if wait_saying(deleting, lambda still: not still, timeout, poll,
                       lambda still, waited: f"waiting for PersistentVolumeClaim/{name} to finish deleting ({waited}); "
                       "a claim being deleted cannot hold this job's checkpoints" if still else None,
                       log.info, every=10):
            raise TimedOut(f"PersistentVolumeClaim/{name} is still being deleted after {timeout:.0f} s (a pod or a "
                           f"finalizer holds it: kubectl -n {namespace} describe pvc {name}); try again once it is "
                           "gone")

    def _exists(self, kind: str, name: str, namespace: str) -> bool:
        if kind in KINDS:
            return self.get_job(name, namespace) is not None
        group, version, plural = SUPPORT[kind]
        try:
            with api_errors(f"reading {kind}/{name}", self.host):
                if group:
                    self._custom().get_namespaced_custom_object(group, version, namespace, plural, name,
                                                                _preload_content=False)
                else:
                    {"Secret": self._core().read_namespaced_secret, "PersistentVolumeClaim":
                     self._core().read_namespaced_persistent_volume_claim}[kind](name, namespace,
                                                                                 _preload_content=False)
            return True
        except Exception as e:
            if is_not_found(e):
                return False
            raise

    def _rollback(self, created: list[dict[str, Any]], namespace: str,
                  say: Callable[[str], None] = log.info) -> None:
        for obj in reversed(created):
            kind, name = obj["kind"], obj["metadata"]["name"]
            try:
                self._delete_object(kind, name, namespace)
                say(f"rolled back {kind}/{name}")
            except Exception as e:  # keep rolling back the rest; say what is left
                log.info(f"could not roll back {kind}/{name}: {e}; delete it by hand")

    def cancel(self, name: str, delete_storage: bool = False, dry_run: bool = False) -> list[str]:
        """The job, then what fsdpkit made for it: its Secret, and with `delete_storage` the PVC it
        created (never a claim it was given)."""
        return self._cancel(name, self.namespace, delete_storage, dry_run)

    def _cancel(self, name: str, namespace: str, delete_storage: bool = False, dry_run: bool = False) -> list[str]:
        kind, obj = self._require_job(name, namespace)
        device_objects = self._device_objects(obj)
        if dry_run and (since := (obj.get("metadata") or {}).get("deletionTimestamp")):   # said once: the look first
            log.warning(f"job {name} is already being deleted (since {since}); what fsdpkit made for it goes too")
        if not dry_run:
            self.require_access("job delete --delete-storage" if delete_storage else "job delete", kind, namespace,
                                [{"kind": k} for k in ("Secret", "PersistentVolumeClaim")] +
                                [{"kind": k} for k, _ in device_objects])
        targets = [(kind, name), *device_objects]
        core = self._core()
        kinds = [("Secret", core.list_namespaced_secret)]
        if delete_storage:
            kinds.append(("PersistentVolumeClaim", core.list_namespaced_persistent_volume_claim))
        sel = {**manifests.MANAGED_BY, JOB_LABEL: name}
        for made, lister in kinds:  # only what fsdpkit made for this job
            with api_errors(f"listing the job's {made}s", self.host):
                items = lister(namespace, label_selector=label_selector(sel)).items
            targets += [(made, o.metadata.name) for o in items if labels_match(o.metadata.labels, sel)]
        for target in targets if not dry_run else ():
            self._delete_object(*target, namespace)
        return [f"{k}/{n}" for k, n in targets]


    @staticmethod
    def _device_objects(obj: dict[str, Any]) -> list[tuple[str, str]]:
        """The DRA objects a job was submitted with, from the job itself: the claim templates its
        pods name, and a TrainJob's own runtime (which names the template of the same name)."""
        ref = (obj.get("spec") or {}).get("runtimeRef") or {}
        runtime = [ref["name"]] if ref.get("kind") == "TrainingRuntime" else []
        named = {c["resourceClaimTemplateName"] for _, t in templates(obj)
                 for c in (t.get("spec") or {}).get("resourceClaims") or [] if c.get("resourceClaimTemplateName")}
        return [("TrainingRuntime", n) for n in runtime] + [("ResourceClaimTemplate", n)
                                                             for n in sorted(named | set(runtime))]

    def recreate(self, kind: str, obj: dict[str, Any]) -> None:
        """The job made again from its own manifest, its attempt counted."""
        meta = obj["metadata"]
        fresh = {
            "apiVersion": obj.get("apiVersion"), "kind": kind,
            "metadata": {"name": meta["name"], "namespace": meta.get("namespace"), "labels": meta.get("labels") or {},
                         "annotations": dict(meta.get("annotations") or {})},
            "spec": copy.deepcopy(obj["spec"]),
        }
        fresh["metadata"]["annotations"][ATTEMPT] = str(int(fresh["metadata"]["annotations"].get(ATTEMPT, 0)) + 1)
        self.require_access("job wait (resubmit)", kind, meta.get("namespace"))  # never deleted and not made again
        self._delete_object(kind, meta["name"], meta.get("namespace"))
        self._wait_gone(meta["name"], meta.get("namespace"))
        with api_errors(f"resubmitting {kind}/{meta['name']}", self.host):
            self._create(meta.get("namespace"), fresh)
