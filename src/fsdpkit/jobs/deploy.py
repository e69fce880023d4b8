"""`fsdpkit deploy SPEC`: check the cluster, ensure storage, ensure the secret, submit, watch.

Each step can be skipped. Progress is kept in FSDPKIT_HOME/deploy/NAMESPACE-NAME.json, so after a
failure a second `deploy` continues at the failed step. A step that fails deletes what it created
itself; what earlier steps made stays (that is what the resumed run builds on) and is named in the
error, so nothing is left half-created without the user being told."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fsdpkit.cluster.checks import run_checks
from fsdpkit.errors import Conflict, UserError
from fsdpkit.home import home, make_dir
from fsdpkit.jobs.backends.base import Backend, wait
from fsdpkit.jobs.backends.kube import KubeBackend
from fsdpkit.jobs.backends.kube_api import KINDS
from fsdpkit.jobs.capacity import DoesNotFit, capacity
from fsdpkit.jobs.hub import check_hub_access
from fsdpkit.jobs.resolved import ResolvedJob
from fsdpkit.jobs.spec import CLUSTER_BACKENDS, JobSpec

STEPS = ("check", "storage", "secret", "submit", "watch")


def state_path(spec: JobSpec) -> Path:
    root = home()
    return root / "deploy" / f"{spec.namespace}-{spec.name}.json"


@dataclass
class DeployState:
    done: list[str] = field(default_factory=list)
    created: list[str] = field(default_factory=list)

    @classmethod
    def load(cls, path: Path) -> DeployState:
        return cls(**json.loads(path.read_text())) if path.exists() else cls()

    def save(self, path: Path) -> None:
        make_dir(path.parent)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"done": self.done, "created": self.created}))
        tmp.replace(path)


class StepFailed(UserError):
    exit_code = 1


def deploy(job: ResolvedJob, backend: Backend, skip: set[str], say: Callable[[str], None], stall_after: float = 900,
           poll: float = 15.0, fresh: bool = False, strict: bool = False) -> dict[str, Any]:
    spec = job.spec
    token = _preconditions(spec, skip)
    assert isinstance(backend, KubeBackend)  # a cluster backend's, as the preconditions make sure
    path = state_path(spec)
    state = DeployState() if fresh else DeployState.load(path)
    if state.done:
        say(f"resuming: already done: {', '.join(state.done)}")
    if why := job.default_steps():
        say(f"  WARN {why}")
    objs = {o["kind"]: o for o in backend.render(job).objects()}
    job_kind = next(k for k in objs if k in KINDS)
    results: dict[str, Any] = {}
    for step in STEPS:
        if step in skip or step in state.done:
            results[step] = "skipped" if step in skip else "done before"
            continue
        say(f"[{step}]")
        try:
            if step == "check":
                results[step] = _check(job, backend, job_kind, strict, say)
            elif step == "watch":
                results[step] = _watch(spec, backend, poll, say)
            else:
                results[step] = _apply(step, spec, backend, objs, token, state, say)
        except UserError as e:
            state.save(path)
            raise type(e)(f"deploy step {step}: {e}; left in the cluster: {', '.join(state.created) or 'nothing'}; "
                          f"run deploy again to continue from {step}") from None
        state.done.append(step)
        state.save(path)
    path.unlink(missing_ok=True)  # finished: the next deploy of this spec starts from the beginning
    return {"name": spec.name, "namespace": spec.namespace, "steps": results, "created": state.created}


def _preconditions(spec: JobSpec, skip: set[str]) -> str | None:
    """What must hold before any step runs; the HF token from the shell, if the spec names one."""
    if spec.backend not in CLUSTER_BACKENDS:
        raise UserError(f"backend: deploy runs Kubernetes jobs (trainjob, pytorchjob, hyperpod), not {spec.backend}; "
                        "use `fsdpkit job submit` for local and Slurm jobs")
    unknown = skip - set(STEPS)
    if unknown:
        raise UserError(f"--skip: {', '.join(sorted(unknown))} is not a step; steps: {', '.join(STEPS)}")
    token = os.environ.get(spec.hf_token_env) if spec.hf_token_env else None
    if spec.hf_token_env and not token and "secret" not in skip:
        raise UserError(f"hf_token_env: ${spec.hf_token_env} is not set in this shell; export it (or --skip secret "
                        "if the Secret already exists)")
    check_hub_access(spec)
    return token


def _uses(job: ResolvedJob, component: str) -> bool:
    """Whether the job needs a component `cluster check` looks at: Kueue only for a job on a queue,
    KubeRay never (`deploy` runs no RayCluster); the rest (devices, operators, storage) as checked."""
    return {"Kueue": job.spec.queue is not None, "KubeRay operator": False}.get(component, True)


def _check(job: ResolvedJob, backend: KubeBackend, kind: str, strict: bool, say: Callable[[str], None]) -> str:
    """The cluster is ready for this job (no failed check of what it uses) and the job fits its GPUs
    (or only a warning). Another backend's operator is not this job's concern: CRDs an add-on left
    behind are common, and its check is a note, not a failure."""
    report = run_checks(backend.client)
    mine = KINDS[kind].backend
    failed = []
    for c in report.checks:
        if (c.backend and c.backend != mine) or not _uses(job, c.name):
            if c.status == "fail":
                say(f"  note: {c.name}: {c.detail} (not used by this {mine} job)")
            continue
        if c.status == "unread":  # a namespace user's gap: named, and the submit's own checks still run
            say(f"  note: {c.name}: {c.detail}")
            continue
        if c.backend == mine and c.status == "warn":
            c.status = "fail"  # absent where the cluster as a whole needs none of it, but this job does
        if c.status == "fail":
            failed.append(c)
            say(f"  FAIL {c.name}: {c.detail}" + (f" (fix: {c.fix})" if c.fix else ""))
    if failed:
        raise StepFailed(f"cluster check failed ({len(failed)} problem(s) above); fix them, or --skip check")
    try:
        capacity(job, strict, lambda line: say(f"  WARN {line}"))
    except DoesNotFit as e:
        raise StepFailed(str(e)) from None
    return "passed"


def _apply(step: str, spec: JobSpec, backend: KubeBackend, objs: dict[str, dict[str, Any]], token: str | None,
           state: DeployState, say: Callable[[str], None]) -> Any:
    """storage, secret or submit: create the step's object unless it is there already."""
    kind = {"storage": "PersistentVolumeClaim", "secret": "Secret", "submit": None}[step]
    if kind is None:
        kind = next(k for k in objs if k in KINDS)
        backend.require_operator(kind, spec.namespace)
        backend.require_release(kind)
        if backend.get_job(spec.name, spec.namespace) is not None:
            raise Conflict(f"job {spec.name!r} already exists in {spec.namespace}; `fsdpkit job delete "
                            f"{spec.name}` first, or watch it with `fsdpkit job watch {spec.name}`")
    if kind not in objs:
        return "not needed"
    created, reused = backend.apply(spec, [objs[kind]], token)
    state.created += created
    for r in created + reused:
        say(f"  {'created' if r in created else 'reusing'} {r}")
    return {"created": created, "reused": reused}


def _watch(spec: JobSpec, backend: KubeBackend, poll: float, say: Callable[[str], None]) -> str:
    final = wait(backend, spec.name, poll=poll, on_change=lambda st: say(
        f"  {st.name}: {st.state}" + (f" ({st.message})" if st.message else "")))
    if final.state != "Succeeded":
        raise StepFailed(f"job {spec.name} ended {final.state}: {final.message or 'see its logs'} "
                         f"(fsdpkit job logs {spec.name} --previous)")
    return final.state
