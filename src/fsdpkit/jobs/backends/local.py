"""The single-machine path of a JobSpec: torchrun on this machine (`fsdpkit train --nproc N`),
started in the background like a cluster job. State lives in FSDPKIT_HOME/jobs/NAME
(default ~/.fsdpkit): the spec, the command, the log, the pid and, when it ends, the exit code."""

from __future__ import annotations

import contextlib
import itertools
import json
import logging
import os
import shlex
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from fsdpkit.errors import Conflict, NotFound, UserError
from fsdpkit.home import jobs_home, make_dir
from fsdpkit.jobs.backends.base import Listing, Rendered, Submitted, Target, no_server
from fsdpkit.jobs.backends.files import NETWORK_LINES, read_lines
from fsdpkit.jobs.health import network_verdict
from fsdpkit.jobs.resolved import ResolvedJob
from fsdpkit.jobs.spec import JobSpec, load_spec_dict
from fsdpkit.jobs.status import JobStatus
from fsdpkit.polling import poll_until
from fsdpkit.train.observe.nccl_log import NetworkVerdict

log = logging.getLogger(__name__)

# What says a local job exists, as opposed to what it made (log, run directory, checkpoints).
_RECORD = ("spec.json", "command", "pid", "rc", "attempt", "cancelled")
# How long a stopped job has to save its checkpoint and end.
STOP_SECONDS = 120


def _drop_record(job_dir: Path) -> None:
    for f in _RECORD:
        (job_dir / f).unlink(missing_ok=True)


class LocalBackend:
    name = "local"

    def __init__(self, target: Target | None = None):
        self.target = target or Target()   # jobs are named in FSDPKIT_HOME: no context or namespace

    def _dir(self, name: str) -> Path:
        return jobs_home() / name

    @staticmethod
    def command(job: ResolvedJob) -> list[str]:
        """Outputs in the job's own directory (FSDPKIT_HOME/jobs/NAME), or under a shared path if
        given (the job's resolved root)."""
        spec = job.spec
        if spec.command is not None:
            return list(spec.command)
        return [sys.executable, "-m", "fsdpkit", "train", "--nproc", str(spec.procs),
                "--max-restarts", str(spec.max_restarts), *job.flags()]

    def render(self, job: ResolvedJob) -> Rendered:
        env = "".join(f"{k}={shlex.quote(v)} " for k, v in job.spec.env.items())
        return Rendered(command=f"{env}{shlex.join(self.command(job))}\n")

    def submit(self, job: ResolvedJob, replace: bool = False, dry_run: str | None = None) -> Submitted:
        spec = job.spec
        job_dir = self._dir(spec.name)
        cmd = self.command(job)
        if dry_run:
            no_server(self.name, dry_run)
            return Submitted(spec.name, dry_run, command=cmd, dir=str(job_dir))
        for ref in spec.secrets:  # no Kubernetes here: the value must come from this shell
            if ref.env not in os.environ:
                raise UserError(f"secrets: {ref.env} refers to Secret {ref.secret}, which the local backend cannot "
                                f"read; export {ref.env} in this shell instead")
        if (job_dir / "spec.json").exists():
            st = self.status(spec.name)
            if not replace:
                raise Conflict(f"job {spec.name!r} already exists ({st.state}) in {job_dir}; pick another name, or "
                                "pass --replace to start it again (its checkpoints are kept and resumed)")
            self.cancel(spec.name)
        make_dir(job_dir)
        _drop_record(job_dir)   # a deleted job's outputs stay; its record starts again (no stale rc)
        (job_dir / "spec.json").write_text(json.dumps(spec.to_dict(), indent=2))
        (job_dir / "command").write_text(shlex.join(cmd) + "\n")
        (job_dir / "attempt").write_text("0")
        pid = self._launch(job_dir, cmd, spec)
        return Submitted(spec.name, False, pid=pid, dir=str(job_dir), log=str(job_dir / "log"))

    @staticmethod
    def _launch(job_dir: Path, cmd: list[str], spec: JobSpec, attempt: int = 0) -> int:
        env = {**os.environ, "PYTHONUNBUFFERED": "1", **spec.env, "FSDPKIT_ATTEMPT": str(attempt)}
        if spec.hf_token_env and os.environ.get(spec.hf_token_env):
            env["HF_TOKEN"] = os.environ[spec.hf_token_env]
        # A shell stays behind as the parent to record the exit code once the job ends. Its no-op
        # trap keeps a cancel's SIGTERM (sent to the whole group) from ending it before the job has
        # stopped; a trap, unlike an ignored signal, is not inherited by the job.
        wrapper = f'trap : TERM INT; {shlex.join(cmd)}; echo $? > {shlex.quote(str(job_dir / "rc"))}'
        with open(job_dir / "log", "ab") as log:
            proc = subprocess.Popen(["/bin/sh", "-c", wrapper], stdout=log, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL, env=env, start_new_session=True)
        (job_dir / "pid").write_text(str(proc.pid))
        return proc.pid

    def resubmit(self, name: str) -> bool:
        """Start a Failed job again (it resumes from its newest checkpoint) while its budget lasts."""
        st = self.status(name)
        job_dir = self._dir(name)
        spec_doc = json.loads((job_dir / "spec.json").read_text())
        attempt = int((job_dir / "attempt").read_text() or 0) if (job_dir / "attempt").exists() else 0
        if st.state != "Failed" or attempt >= int(spec_doc.get("resubmits", 0)):
            return False
        spec = load_spec_dict(spec_doc)
        log.info(f"job {name} failed ({st.message}); resubmitting, attempt {attempt + 1} of {spec.resubmits}")
        (job_dir / "rc").unlink(missing_ok=True)
        (job_dir / "attempt").write_text(str(attempt + 1))
        self._launch(job_dir, shlex.split((job_dir / "command").read_text()), spec, attempt + 1)
        return True

    def _alive(self, job_dir: Path) -> bool:
        try:
            pid = int((job_dir / "pid").read_text())
            os.kill(pid, 0)
        except (OSError, ValueError):
            return False
        # A zombie of ours (the submitting process is still alive) counts as ended.
        try:
            return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
        except OSError:
            return True

    def status(self, name: str) -> JobStatus:
        job_dir = self._dir(name)
        if not (job_dir / "spec.json").is_file():
            raise NotFound(f"job {name!r} not found in {jobs_home()} (see `fsdpkit job list --backend local`)")
        rc_file = job_dir / "rc"
        details: dict[str, Any] = {"dir": str(job_dir), "log": str(job_dir / "log")}
        if rc_file.exists() and rc_file.read_text().strip():
            rc = int(rc_file.read_text().strip())
            details["exit_code"] = rc
            attempt = int((job_dir / "attempt").read_text() or 0) if (job_dir / "attempt").exists() else 0
            if rc == 0:
                return JobStatus(name, self.name, "Succeeded", attempt=attempt, details=details)
            if (job_dir / "cancelled").exists():
                return JobStatus(name, self.name, "Cancelled", f"cancelled (exit code {rc})", details=details)
            return JobStatus(name, self.name, "Failed", f"exit code {rc}; see {job_dir / 'log'}", details=details)
        if self._alive(job_dir):
            return JobStatus(name, self.name, "Running", details=details)
        return JobStatus(name, self.name, "Failed", "the process ended without recording an exit code",
                         details=details)

    def jobs(self) -> Listing:
        root = jobs_home()
        return Listing([self.status(d.name) for d in sorted(root.iterdir()) if (d / "spec.json").exists()]
                       if root.is_dir() else [], {})

    def cancel(self, name: str, delete_storage: bool = False,
               dry_run: bool = False) -> list[str]:
        """SIGTERM to the whole process group: torchrun forwards it and the trainer saves a checkpoint.
        The job's record goes once it has stopped, as a deleted cluster job leaves `job list`; its
        outputs (log, run, checkpoints) stay unless delete_storage, and a new submit resumes them."""
        st = self.status(name)
        job_dir = self._dir(name)
        if dry_run:
            return [f"{job_dir} (deleted)" if delete_storage else f"local/{name}"]
        if not st.finished:
            (job_dir / "cancelled").touch()
            with contextlib.suppress(OSError, ValueError):  # already gone
                os.killpg(int((job_dir / "pid").read_text()), signal.SIGTERM)
            if not poll_until(lambda: self.status(name), lambda st: st.finished, STOP_SECONDS, 0.5).finished:
                raise Conflict(f"job {name!r} is still running {STOP_SECONDS} s after SIGTERM (saving a checkpoint?); "
                               f"it stays listed: run `fsdpkit job delete {name}` again once it has stopped")
        if delete_storage:
            shutil.rmtree(job_dir, ignore_errors=True)
            return [f"{job_dir} (deleted)"]
        _drop_record(job_dir)
        return [f"local/{name}"]

    def network(self, name: str) -> NetworkVerdict | None:
        """The network the trainer reported before its first step, from the start of the job's log."""
        return network_verdict(list(itertools.islice(self.logs(name), NETWORK_LINES)))

    def logs(self, name: str, follow: bool = False, replica: str | None = None,
             previous: bool = False, wait: float = 600, poll: float = 0.5) -> Iterator[str]:
        self.status(name)
        yield from read_lines(self._dir(name) / "log", follow, lambda: self.status(name).finished, poll)

