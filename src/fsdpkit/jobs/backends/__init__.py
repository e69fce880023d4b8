"""One module per backend, all keeping the contract of `base.Backend`: render, submit, status,
logs, network, cancel, jobs, resubmit; `wait` polls any of them until its job ends."""

from __future__ import annotations

from fsdpkit.errors import UserError
from fsdpkit.jobs.backends.base import Backend, Rendered, Target, Watchable, wait
from fsdpkit.jobs.backends.kube import HyperPodBackend, KubeBackend, TrainJobBackend
from fsdpkit.jobs.backends.local import LocalBackend
from fsdpkit.jobs.backends.slurm import SlurmBackend

__all__ = ["Backend", "HyperPodBackend", "KubeBackend", "LocalBackend", "Rendered", "SlurmBackend", "Target",
           "TrainJobBackend", "Watchable", "get_backend", "get_kube_backend", "wait"]

KUBE_BACKENDS: dict[str, type[KubeBackend]] = {
    "pytorchjob": KubeBackend, "hyperpod": HyperPodBackend, "trainjob": TrainJobBackend}


def get_backend(name: str, target: Target | None = None) -> Backend:
    """The backend of that name (a JobSpec's `backend`), acting where `target` says."""
    if name == "local":
        return LocalBackend(target)
    if name == "slurm":
        return SlurmBackend(target)
    return get_kube_backend(name, target)


def get_kube_backend(name: str, target: Target | None = None) -> KubeBackend:
    """The Kubernetes backend of that name (what `deploy` and the cluster verbs drive)."""
    if name not in KUBE_BACKENDS:
        raise UserError(f"backend: {name!r} is not one of local, slurm, {', '.join(KUBE_BACKENDS)}")
    return KUBE_BACKENDS[name](target)
