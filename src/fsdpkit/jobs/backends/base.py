"""The contract every job backend keeps: what a spec renders to, and the verbs the CLI and
`deploy` call. Progress (a rollback, a resubmission, waiting for pods) goes to the `fsdpkit`
logger; the CLI shows it on stderr."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from fsdpkit import yamlfile
from fsdpkit.errors import UserError
from fsdpkit.jobs.spec import JobSpec
from fsdpkit.jobs.status import JobStatus


@dataclass(frozen=True)
class Rendered:
    """What a spec becomes: Kubernetes objects in creation order, a batch script, or the command
    line of a local job. Exactly one is set."""

    manifests: list[dict[str, Any]] | None = None
    script: str | None = None
    command: str | None = None

    @property
    def kind(self) -> str:
        return "manifests" if self.manifests is not None else "script" if self.script is not None else "command"

    def as_json(self) -> dict[str, Any]:
        return {self.kind: getattr(self, self.kind)}

    def text(self) -> str:
        """As a person reads it: YAML documents, or the script or command as it runs."""
        return yamlfile.dump_all(self.manifests) if self.manifests is not None else (self.script or self.command or "")


class Backend(Protocol):
    name: str

    def render(self, spec: JobSpec) -> Rendered: ...

    def submit(self, spec: JobSpec, replace: bool = False, dry_run: str | None = None) -> dict[str, Any]:
        """`dry_run`: None submits; "client" renders and says what would happen; "server" also has a
        Kubernetes API server check every object (no other backend has one to ask)."""
        ...

    def status(self, name: str, namespace: str = "default") -> JobStatus: ...

    def list(self, namespace: str = "default") -> list[JobStatus]: ...

    def cancel(self, name: str, namespace: str = "default", delete_storage: bool = False,
               dry_run: bool = False) -> list[str]:
        """Stop and remove the job (its storage too with `delete_storage`); what went, or with
        `dry_run` what would go, as KIND/NAME."""
        ...

    def logs(self, name: str, namespace: str = "default", follow: bool = False, replica: str | None = None,
             previous: bool = False) -> Iterator[str]: ...

    def network(self, name: str, namespace: str = "default") -> dict[str, Any] | None: ...

    def wait(self, name: str, namespace: str = "default", timeout: float | None = None, poll: float = 10.0,
             on_change: Callable[[JobStatus], None] | None = None) -> JobStatus: ...


def no_server(backend: str, dry_run: str) -> None:
    """A server-side dry run where there is no Kubernetes API server to ask is the user's mistake."""
    if dry_run == "server":
        raise UserError(f"--dry-run=server: the {backend} backend has no API server to ask; use --dry-run")


@runtime_checkable
class Watchable(Protocol):
    """A backend that can look at a running job as the cluster sees it (`fsdpkit job watch`)."""

    def snapshot(self, name: str, namespace: str = "default", stall_after: float = 900, now: Any = None,
                 sample: float = 0, history: Any = None) -> dict[str, Any]: ...
