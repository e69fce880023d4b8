"""The contract every job backend keeps: what a spec renders to, and the verbs the CLI and
`deploy` call. Progress (a rollback, a resubmission, waiting for pods) goes to the `fsdpkit`
logger; the CLI shows it on stderr."""

from __future__ import annotations

import shlex
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, fields
from typing import Any, Protocol, runtime_checkable

from fsdpkit import yamlfile
from fsdpkit.errors import UserError
from fsdpkit.jobs.resolved import ResolvedJob
from fsdpkit.jobs.status import JobStatus
from fsdpkit.polling import poll_until
from fsdpkit.train.observe.nccl_log import NetworkVerdict


@dataclass(frozen=True)
class Rendered:
    """What a spec becomes: Kubernetes objects in creation order, a batch script, or the command
    line of a local job. Exactly one is set."""

    manifests: list[dict[str, Any]] | None = None
    script: str | None = None
    command: str | None = None
    pod_security: str | None = None   # the Pod Security level the manifests' pods meet
    needs: str | None = None          # the operator release the manifests need, where it matters

    @property
    def kind(self) -> str:
        return "manifests" if self.manifests is not None else "script" if self.script is not None else "command"

    def objects(self) -> list[dict[str, Any]]:
        """The Kubernetes objects of a cluster backend's render."""
        if self.manifests is None:
            raise TypeError(f"this render is a {self.kind}, not Kubernetes objects")
        return self.manifests

    def as_json(self) -> dict[str, Any]:
        out = {self.kind: getattr(self, self.kind)}
        return {**out, **{k: v for k, v in (("pod_security", self.pod_security), ("needs", self.needs)) if v}}

    def text(self) -> str:
        """As a person reads it: YAML documents, or the script or command as it runs."""
        return yamlfile.dump_all(self.manifests) if self.manifests is not None else (self.script or self.command or "")


@dataclass
class Submitted:
    """What a submit made, or with `dry_run` ("client", "server") would make. Each backend fills its
    own fields (Kubernetes: the objects; local: the command, its process and folder; Slurm: the
    script and sbatch's job id); the others stay None and are left out of `to_dict`, the JSON of
    `job submit --json`."""

    name: str
    dry_run: str | bool
    namespace: str | None = None
    # Kubernetes: a dry run's objects (KIND/NAME, in creation order) and manifests; a server dry run's
    # verdict; a submit's created and reused objects and Kueue's admission.
    objects: list[str] | None = None
    manifests: list[dict[str, Any]] | None = None
    accepted: list[str] | None = None
    existing: list[str] | None = None
    warnings: list[str] | None = None
    created: list[str] | None = None
    reused: list[str] | None = None
    admission: dict[str, Any] | None = None
    # Local: the command line, the launcher's pid, the job's folder and log.
    command: list[str] | None = None
    pid: int | None = None
    dir: str | None = None
    log: str | None = None
    # Slurm: the script's path and (dry run) text; whether sbatch took it, its job id, or what to do.
    script: str | None = None
    text: str | None = None
    submitted: bool | None = None
    job_id: str | None = None
    hint: str | None = None

    def made(self) -> list[str]:
        """What a person is told was (or would be) made: the objects, else the command line, the
        script or the job's folder."""
        if self.dry_run:
            return self.objects or [shlex.join(self.command) if self.command else str(self.script)]
        return self.created or [str(self.script or self.dir)]

    def to_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self) if getattr(self, f.name) is not None}


@dataclass(frozen=True)
class Target:
    """Where a backend's verbs act, given once when it is made: the kubeconfig context and file,
    and the namespace of the jobs it names (a local or Slurm backend has none of these)."""

    context: str | None = None
    kubeconfig: str | None = None
    namespace: str = "default"


@dataclass(frozen=True)
class Listing:
    """The jobs a backend could read, and what it could not read with why (a job kind this user
    may not list): never an empty list standing for an error."""

    jobs: list[JobStatus]
    unread: dict[str, str]


class Backend(Protocol):
    name: str
    target: Target

    def render(self, job: ResolvedJob) -> Rendered: ...

    def submit(self, job: ResolvedJob, replace: bool = False, dry_run: str | None = None) -> Submitted:
        """`dry_run`: None submits; "client" renders and says what would happen; "server" also has a
        Kubernetes API server check every object (no other backend has one to ask)."""
        ...

    def status(self, name: str) -> JobStatus: ...

    def jobs(self) -> Listing: ...

    def cancel(self, name: str, delete_storage: bool = False, dry_run: bool = False) -> list[str]:
        """Stop and remove the job (its storage too with `delete_storage`); what went, or with
        `dry_run` what would go, as KIND/NAME."""
        ...

    def logs(self, name: str, follow: bool = False, replica: str | None = None,
             previous: bool = False, wait: float = 600) -> Iterator[str]:
        """`wait`: how long to wait for a job's output to exist (its pods, their containers)."""
        ...

    def network(self, name: str) -> NetworkVerdict | None:
        """The network NCCL chose, as the trainer reported it before its first step; None before then."""
        ...

    def resubmit(self, name: str) -> bool:
        """Start a Failed job again (it resumes from its newest checkpoint) if its own budget
        (`resubmits:` in its spec) allows; whether it did."""
        ...


def wait(backend: Backend, name: str, timeout: float | None = None, poll: float = 10.0,
         on_change: Callable[[JobStatus], None] | None = None, resubmit: bool = True) -> JobStatus:
    """Poll until the job ends, or `timeout` seconds pass. A job that ends Failed (beyond what its
    operator retries) is resubmitted while its budget lasts, with `resubmit`, and waited for again."""
    deadline = None if timeout is None else time.monotonic() + timeout
    while True:
        left = None if deadline is None else max(0.0, deadline - time.monotonic())
        # A job whose pods cannot be created will not start as it is: that ends the wait too.
        st = poll_until(lambda: backend.status(name), lambda s: s.finished or bool(s.details.get("blocked")), left,
                        poll, on_change, key=lambda s: (s.state, s.attempt, s.message))
        if not (st.state == "Failed" and resubmit and backend.resubmit(name)):
            return st


def no_server(backend: str, dry_run: str) -> None:
    """A server-side dry run where there is no Kubernetes API server to ask is the user's mistake."""
    if dry_run == "server":
        raise UserError(f"--dry-run=server: the {backend} backend has no API server to ask; use --dry-run")


@dataclass
class Snapshot:
    """One look at a running job (`Watchable.snapshot`, `fsdpkit job watch`): its state, pods,
    nodes (with a sample window), the trainer's progress and network from rank 0's log, what could
    not be reached or read, and the findings. `to_dict` is `job watch --json`'s data, every key
    present."""

    name: str
    state: str
    attempt: int
    message: str
    event: str | None
    blocked: str | None
    pods: list[dict[str, Any]]
    nodes: list[dict[str, Any]]
    progress: dict[str, Any]
    network: dict[str, Any] | None
    unreachable: list[dict[str, Any]]
    gaps: dict[str, str]
    findings: list[dict[str, Any]]

    def to_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


@runtime_checkable
class Watchable(Protocol):
    """A backend that can look at a running job as the cluster sees it (`fsdpkit job watch`)."""

    def snapshot(self, name: str, stall_after: float = 900, now: Any = None, sample: float = 0,
                 history: Any = None) -> Snapshot: ...

    def describe(self, name: str) -> JobStatus:
        """The job's state with its pods, network and unanswering nodes (`fsdpkit job status`)."""
        ...
