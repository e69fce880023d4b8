"""One module per backend, all with the same verbs: render, submit, status, logs, cancel, list, wait."""

from __future__ import annotations

from typing import Any

from fsdpkit.errors import UserError
from fsdpkit.jobs.backends.kube import HyperPodBackend, KubeBackend
from fsdpkit.jobs.backends.local import LocalBackend
from fsdpkit.jobs.backends.slurm import SlurmBackend
from fsdpkit.jobs.spec import BACKENDS


def get_backend(name: str, context: str | None = None, kubeconfig: str | None = None) -> Any:
    if name == "local":
        return LocalBackend()
    if name == "slurm":
        return SlurmBackend()
    if name in ("pytorchjob", "hyperpod"):
        cls = HyperPodBackend if name == "hyperpod" else KubeBackend
        return cls(context=context, kubeconfig=kubeconfig)
    raise UserError(f"backend: {name!r} is not a backend; choose one of: {', '.join(BACKENDS)}")
