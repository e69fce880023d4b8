"""The Kubernetes job backends (Kubeflow Trainer v2's TrainJob, Kubeflow's PyTorchJob, SageMaker
HyperPod) through the official `kubernetes` client: submission (kube_submit) and observation
(kube_observe) joined, with `resubmit`, which makes a failed job again while its budget lasts."""

from __future__ import annotations

from fsdpkit.cluster import trainer
from fsdpkit.jobs import hyperpod, trainjob
from fsdpkit.jobs.backends.base import Rendered
from fsdpkit.jobs.backends.kube_api import log
from fsdpkit.jobs.backends.kube_observe import KubeObserver
from fsdpkit.jobs.backends.kube_submit import KubeSubmitter
from fsdpkit.jobs.manifests import MAX_RESUBMITS
from fsdpkit.jobs.resolved import ResolvedJob


class KubeBackend(KubeSubmitter, KubeObserver):
    name = "pytorchjob"

    def resubmit(self, name: str) -> bool:
        """A Failed job is made again from its own manifest while its resubmission budget lasts; the
        trainer then resumes from the newest checkpoint on the job's storage."""
        namespace = self.namespace
        kind, obj = self._require_job(name, namespace)
        st = self._status_of(kind, obj)
        budget = int((obj["metadata"].get("annotations") or {}).get(MAX_RESUBMITS, 0))
        if st.state != "Failed" or st.attempt >= budget:
            return False
        log.info(f"job {name} failed ({st.message or 'no message'}); resubmitting, attempt {st.attempt + 1} of "
                 f"{budget}, resuming from its newest checkpoint")
        self.recreate(kind, obj)
        return True


class HyperPodBackend(KubeBackend):
    name = "hyperpod"

    def render(self, job: ResolvedJob) -> Rendered:
        return Rendered(manifests=hyperpod.render(job), pod_security=job.spec.security)


class TrainJobBackend(KubeBackend):
    name = "trainjob"

    def render(self, job: ResolvedJob) -> Rendered:
        return Rendered(manifests=trainjob.render(job), pod_security=job.spec.security, needs=trainer.NEEDS)
