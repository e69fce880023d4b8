"""One module per backend, all keeping the contract of `base.Backend`: render, submit, status,
logs, network, cancel, list, wait."""

from __future__ import annotations

from fsdpkit.jobs.backends.base import Backend, Rendered, Watchable
from fsdpkit.jobs.backends.kube import HyperPodBackend, KubeBackend, TrainJobBackend
from fsdpkit.jobs.backends.local import LocalBackend
from fsdpkit.jobs.backends.slurm import SlurmBackend

__all__ = ["Backend", "HyperPodBackend", "KubeBackend", "LocalBackend", "Rendered", "SlurmBackend", "TrainJobBackend",
           "Watchable", "get_backend"]


def get_backend(name: str, context: str | None = None, kubeconfig: str | None = None) -> Backend:
    """The backend of that name (a JobSpec's `backend`, already checked against BACKENDS)."""
    if name == "local":
        return LocalBackend()
    if name == "slurm":
        return SlurmBackend()
    cls = {"hyperpod": HyperPodBackend, "trainjob": TrainJobBackend}.get(name, KubeBackend)
    return cls(context=context, kubeconfig=kubeconfig)
