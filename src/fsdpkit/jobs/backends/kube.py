"""The Kubernetes job backends (Kubeflow Trainer v2's TrainJob, Kubeflow's PyTorchJob, SageMaker
HyperPod) through the official `kubernetes` client: submission (kube_submit) and observation
(kube_observe) joined, with `wait`, which watches a job and resubmits it after a failure while its
budget lasts."""

from __future__ import annotations

import time
from collections.abc import Callable

from fsdpkit.jobs import hyperpod, trainjob
from fsdpkit.jobs.backends.base import Rendered
from fsdpkit.jobs.backends.kube_api import log
from fsdpkit.jobs.backends.kube_observe import KubeObserver
from fsdpkit.jobs.backends.kube_submit import KubeSubmitter
from fsdpkit.jobs.manifests import MAX_RESUBMITS
from fsdpkit.jobs.spec import JobSpec
from fsdpkit.jobs.status import JobStatus


class KubeBackend(KubeSubmitter, KubeObserver):
    name = "pytorchjob"

    def wait(self, name: str, namespace: str = "default", timeout: float | None = None, poll: float = 10.0,
             on_change: Callable[[JobStatus], None] | None = None) -> JobStatus:
        """Poll until the job ends. A job that ends Failed (beyond what the operator retries) is
        resubmitted from its own manifest while its resubmission budget lasts; the trainer then
        resumes from the newest checkpoint on the job's storage."""
        deadline = None if timeout is None else time.monotonic() + timeout
        last = None
        # Looks start 1 s apart and double up to `poll`: a job that fails at once (an image that
        # cannot be pulled, a bad flag) is reported in seconds, a long one costs few API calls.
        delay = min(1.0, poll)
        while True:
            kind, obj = self._require_job(name, namespace)
            st = self._status_of(kind, obj)
            if (st.state, st.attempt) != last and on_change:
                on_change(st)
            last = (st.state, st.attempt)
            if st.state == "Failed":
                budget = int((obj["metadata"].get("annotations") or {}).get(MAX_RESUBMITS, 0))
                if st.attempt < budget:
                    log.info(f"job {name} failed ({st.message or 'no message'}); resubmitting, attempt "
                             f"{st.attempt + 1} of {budget}, resuming from its newest checkpoint")
                    self.resubmit(kind, obj)
                    continue
            if st.finished:
                return st
            if deadline is not None and time.monotonic() > deadline:
                return st
            time.sleep(delay if deadline is None else max(0.0, min(delay, deadline - time.monotonic())))
            delay = min(poll, delay * 2)


class HyperPodBackend(KubeBackend):
    name = "hyperpod"

    def render(self, spec: JobSpec) -> Rendered:
        return Rendered(manifests=hyperpod.render(spec))


class TrainJobBackend(KubeBackend):
    name = "trainjob"

    def render(self, spec: JobSpec) -> Rendered:
        return Rendered(manifests=trainjob.render(spec))
