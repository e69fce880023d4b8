"""Kubeflow Trainer v2 on a cluster: its API, how it is installed upstream, and `fsdpkit-torch`,
the ClusterTrainingRuntime fsdpkit adds beside the cluster's own `torch-distributed`."""

from __future__ import annotations

import re
from typing import Any

from fsdpkit.cluster.client import labels_match

GROUP, VERSION = "trainer.kubeflow.org", "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"
RELEASE = "v2.3.0"
# What fsdpkit's TrainJob needs of the controller: runtimePatches (Trainer 2.2) carrying the pod's
# terminationGracePeriodSeconds, so a checkpoint finishes before SIGKILL (2.3). An older one refuses
# the fields, or drops them where validation is not strict.
MIN_VERSION = (2, 3, 0)
NEEDS = f"Kubeflow Trainer >= v{'.'.join(map(str, MIN_VERSION))} (runtimePatches with the pod's grace period)"
_TAG = re.compile(r":v?(\d+)\.(\d+)\.(\d+)(?:[-+].*)?$")


def controller_images(deployments: list[dict[str, Any]]) -> list[str]:
    """The images of Trainer's controller among these Deployments (raw objects), found by its labels."""
    return [c.get("image", "") for d in deployments
            if any(labels_match((d.get("metadata") or {}).get("labels"), ls) for ls in CONTROLLER_LABELS)
            for c in (((d.get("spec") or {}).get("template") or {}).get("spec") or {}).get("containers") or []]


def image_version(image: str) -> tuple[int, ...] | None:
    """The release an image's tag names (`...trainer-controller-manager:v2.1.0` -> (2, 1, 0)); None for
    `latest`, a digest or another tag that says nothing."""
    m = _TAG.search(image.split("@", 1)[0])
    return tuple(int(g) for g in m.groups()) if m else None
NODE = "node"                       # the runtime's replicated job and container Trainer v2 fills in
ANCESTOR = "trainer.kubeflow.org/trainjob-ancestor-step"
FSDPKIT_RUNTIME = "fsdpkit-torch"
# Labels JobSet and the Job controller put on each pod of a TrainJob.
JOBSET_NAME = "jobset.sigs.k8s.io/jobset-name"
COMPLETION_INDEX = "batch.kubernetes.io/job-completion-index"
CONTROLLER_LABELS: list[dict[str, str | None]] = [
    {"app.kubernetes.io/name": "trainer", "app.kubernetes.io/component": "manager"}]
# The controller with its CRDs and JobSet, then upstream's runtimes (torch-distributed among them).
INSTALL = (f'kubectl apply --server-side -k "https://github.com/kubeflow/trainer.git/manifests/overlays/manager?ref='
           f'{RELEASE}" && kubectl -n kubeflow-system wait --for=condition=Available --timeout=300s '
           f'deployment/kubeflow-trainer-controller-manager && kubectl apply --server-side -k '
           f'"https://github.com/kubeflow/trainer.git/manifests/overlays/runtimes?ref={RELEASE}"')


def runtime_manifest(image: str, max_restarts: int = 3, namespace: str | None = None, name: str = FSDPKIT_RUNTIME,
                     pod: dict[str, Any] | None = None, labels: dict[str, str] | None = None) -> dict[str, Any]:
    """fsdpkit-torch: upstream's torch-distributed shape plus what a TrainJob cannot patch: a
    re-pushed tag is pulled again, and failed pods are started again `max_restarts` times before
    the TrainJob fails (then `fsdpkit job wait` may resubmit it; the trainer resumes from its
    newest checkpoint). The image is a placeholder each TrainJob replaces with its own. With
    `namespace`, the same as one job's TrainingRuntime, its pod given `pod`'s fields (the device
    claims a runtime patch has no field for)."""
    return {
        "apiVersion": API_VERSION, "kind": "TrainingRuntime" if namespace else "ClusterTrainingRuntime",
        "metadata": {"name": name, **({"namespace": namespace} if namespace else {}),
                     "labels": {"trainer.kubeflow.org/framework": "torch", "app.kubernetes.io/managed-by": "fsdpkit",
                                **(labels or {})}},
        "spec": {
            "mlPolicy": {"numNodes": 1, "torch": {}},
            "template": {"spec": {
                "failurePolicy": {"maxRestarts": max_restarts},
                "replicatedJobs": [{"name": NODE, "template": {
                    "metadata": {"labels": {ANCESTOR: "trainer"}},
                    "spec": {"template": {"spec": {"containers": [
                        {"name": NODE, "image": image, "imagePullPolicy": "Always"}], **(pod or {})}}},
                }}],
            }},
        },
    }
