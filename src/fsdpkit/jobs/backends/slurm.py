"""Slurm: an sbatch script (one srun task per node, each running torchrun with c10d rendezvous on the
first node, EFA settings of the instance type, optionally inside a pyxis/enroot container), written
to disk and submitted with `sbatch` when it is on PATH. Status and logs read `scontrol show job`
(the controller keeps finished jobs for MinJobAge), which every Slurm has; sacct, which needs
accounting storage, only for a job the controller no longer holds. Cancel is scancel: SIGTERM to
every step first, so the trainer writes its checkpoint."""

from __future__ import annotations

import itertools
import os
import re
import shlex
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

from fsdpkit.errors import Conflict, Unreachable, UserError
from fsdpkit.jobs.backends.base import Listing, Rendered, Submitted, Target, no_server
from fsdpkit.jobs.backends.files import NETWORK_LINES, read_lines
from fsdpkit.jobs.command import node_command, node_env
from fsdpkit.jobs.health import network_verdict
from fsdpkit.jobs.resolved import ResolvedJob
from fsdpkit.jobs.spec import JobSpec
from fsdpkit.jobs.status import JobStatus
from fsdpkit.train.observe.nccl_log import NetworkVerdict

# What sbatch says when no controller answers (Slurm's own messages): the cluster, not the input.
_UNREACHABLE = re.compile(r"Unable to contact slurm controller|Socket timed out|Connection refused|"
                          r"Zero Bytes were transmitted", re.I)
# A machine with Slurm's commands but no slurm.conf, SLURM_CONF or configless DNS record to find one
# (a slurm.conf that is there but broken is the command's refusal: "Unable to process configuration file").
_NO_CONFIG = re.compile(r"Could not establish a configuration source", re.I)


# sacct on a cluster with AccountingStorageType=accounting_storage/none.
_NO_ACCOUNTING = re.compile(r"accounting storage is disabled", re.I)
# How far back sacct looks for a job the controller has let go (its own default is since midnight).
ACCOUNTING_DAYS = 30


class SlurmUnreachable(Unreachable):
    """The Slurm controller could not be reached."""


# `Key=value` fields of one `scontrol show job -o` line.
_FIELD = re.compile(r"(\w[\w:/]*)=(\S*)")
# Slurm job states -> fsdpkit states
_STATES = {
    "PENDING": "Pending", "CONFIGURING": "Created", "RUNNING": "Running", "COMPLETING": "Running",
    "REQUEUED": "Restarting", "RESIZING": "Running", "SUSPENDED": "Pending", "COMPLETED": "Succeeded",
    "FAILED": "Failed", "TIMEOUT": "Failed", "NODE_FAIL": "Failed", "OUT_OF_MEMORY": "Failed",
    "PREEMPTED": "Failed", "BOOT_FAIL": "Failed", "DEADLINE": "Failed", "CANCELLED": "Cancelled",
}


def _last_line(out: subprocess.CompletedProcess[str]) -> str:
    """The last thing a Slurm command said (its error), or its exit status when it said nothing."""
    said = (out.stderr.strip() or out.stdout.strip()).splitlines()
    return said[-1] if said else f"exit {out.returncode}"


def _unreachable(tool: str, why: str) -> SlurmUnreachable | None:
    """What a failed Slurm command's last line says of the controller: none to reach from here (no
    configuration: this is not a login node), one that does not answer, or None (another refusal)."""
    if _NO_CONFIG.search(why):
        return SlurmUnreachable(f"{tool} found no Slurm configuration on this machine ({why}); run this on a login "
                                "node of the cluster, or set SLURM_CONF to its slurm.conf")
    if _UNREACHABLE.search(why):
        return SlurmUnreachable(f"{tool} could not reach the Slurm controller ({why}); check that slurmctld runs "
                                "and that this is a login node of the cluster (SLURM_CONF)")
    return None


def _check_conf() -> None:
    """SLURM_CONF naming no file: Slurm's commands would retry reading it for a minute before failing."""
    conf = os.environ.get("SLURM_CONF")
    if conf and not Path(conf).is_file():
        raise SlurmUnreachable(f"SLURM_CONF is {conf}, which is not a file here; point it at the cluster's "
                               "slurm.conf, or unset it on a login node")


def _shell_word(arg: str) -> str:
    """Quote one argument; ours with ${VAR} stay expandable (double quotes), the rest are literal."""
    if "${" in arg:
        return '"' + arg.replace("\\", "\\\\").replace('"', '\\"') + '"'
    return shlex.quote(arg)


def script(job: ResolvedJob) -> str:
    spec = job.spec
    lo, _ = spec.nodes
    s = spec.slurm
    lines = ["#!/bin/bash", f"#SBATCH --job-name={spec.name}", f"#SBATCH --nodes={lo}",
             "#SBATCH --ntasks-per-node=1", "#SBATCH --exclusive", f"#SBATCH --output={s.output}"]
    if spec.gpus:
        lines.append(f"#SBATCH --gpus-per-node={spec.gpus}")
    for flag, value in (("partition", s.partition), ("account", s.account), ("time", s.time)):
        if value:
            lines.append(f"#SBATCH --{flag}={value}")
    if s.time and (grace := job.grace_seconds):
        # SIGTERM this long before the time limit: the run checkpoints and exits 143 instead of
        # being killed at the limit with its work since the last checkpoint lost.
        lines.append(f"#SBATCH --signal=TERM@{grace}")
    if spec.resubmits:
        lines.append("#SBATCH --requeue")
    lines += ["", "# Generated by fsdpkit from a JobSpec: edit the spec, not this file.", "set -euo pipefail", ""]
    lines += [f"export {k}={shlex.quote(str(v))}" for k, v in node_env(spec).items()]
    if spec.hf_token_env:
        lines.append(f'export HF_TOKEN="${{{spec.hf_token_env}:?export {spec.hf_token_env} before sbatch}}"')
    for ref in spec.secrets:
        lines.append(f': "${{{ref.env}:?export {ref.env} before sbatch}}"')
    lines += [
        "",
        "# c10d rendezvous on the first node of the allocation (by the address Slurm reaches it at);",
        "# every node runs one torchrun.",
        'head_node=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)',
        'head_addr=$(scontrol show node "$head_node" 2>/dev/null | sed -n \'s/.*NodeAddr=\\([^ ]*\\).*/\\1/p\')',
        f'rdzv_endpoint="${{head_addr:-$head_node}}:{spec.rdzv_port}"',
        "",
    ]
    cmd = node_command(job, "${rdzv_endpoint}", "${SLURM_JOB_ID}", nnodes="${SLURM_JOB_NUM_NODES}")
    quoted = " ".join(_shell_word(a) for a in cmd)
    srun = ["srun", "--kill-on-bad-exit=1", *(["--auto-resume=1"] if s.hyperpod else [])]
    if image := s.image(spec.image):
        srun.append(f"--container-image={shlex.quote(image)}")
        mounts = list(s.container_mounts)
        if spec.storage.root:
            mounts.append(f"{spec.storage.root}:{spec.storage.root}")
        if mounts:
            srun.append(f"--container-mounts={shlex.quote(','.join(mounts))}")
    lines.append(f"{' '.join(srun)} {quoted}")
    return "\n".join(lines) + "\n"


class SlurmBackend:
    name = "slurm"

    def __init__(self, target: Target | None = None):
        self.target = target or Target()   # the cluster is the one sbatch and squeue reach

    def render(self, job: ResolvedJob) -> Rendered:
        return Rendered(script=script(job))

    def _path(self, spec: JobSpec) -> Path:
        return Path(spec.slurm.script_dir) / f"{spec.name}.sbatch"

    def submit(self, job: ResolvedJob, replace: bool = False, dry_run: str | None = None) -> Submitted:
        spec, text = job.spec, script(job)
        path = self._path(spec)
        if dry_run:
            no_server(self.name, dry_run)
            return Submitted(spec.name, dry_run, script=str(path), text=text)
        if path.exists() and not replace:
            raise Conflict(f"{path} already exists; pass --replace to overwrite it, or pick another name")
        path.parent.mkdir(parents=True, exist_ok=True)
        earlier = path.read_text() if path.is_file() else None
        tmp = path.with_suffix(".sbatch.tmp")
        tmp.write_text(text)
        tmp.replace(path)  # never a half-written script
        if shutil.which("sbatch") is None:
            return Submitted(spec.name, False, script=str(path), submitted=False,
                             hint=f"sbatch is not on PATH here; copy {path} to the cluster and run: sbatch {path.name}")
        _check_conf()
        out = subprocess.run(["sbatch", "--parsable", str(path)], capture_output=True, text=True)
        if out.returncode != 0:
            # Nothing was submitted: the script this submit wrote goes again (an earlier one is put back).
            if earlier is None:
                path.unlink(missing_ok=True)
            else:
                path.write_text(earlier)
            why = _last_line(out)
            raise _unreachable("sbatch", why) or UserError(f"sbatch refused {path.name}: {why}")
        job_id = out.stdout.strip().split(";")[0]
        return Submitted(spec.name, False, script=str(path), submitted=True, job_id=job_id)

    @staticmethod
    def _need(tool: str) -> None:
        if shutil.which(tool) is None:
            raise UserError(f"{tool} is not on PATH: run this on a Slurm login node")
        _check_conf()

    def _jobs(self) -> list[dict[str, str]]:
        """Every job the controller holds (running, pending, and finished within MinJobAge), oldest first."""
        self._need("scontrol")
        out = subprocess.run(["scontrol", "show", "job", "-o"], capture_output=True, text=True)
        if out.returncode != 0 and "Invalid job id" not in out.stderr:
            why = _last_line(out)
            raise _unreachable("scontrol", why) or UserError(f"scontrol show job failed: {why}")
        jobs = [dict(_FIELD.findall(line)) for line in out.stdout.splitlines() if line.startswith("JobId=")]
        return sorted(jobs, key=lambda j: int(j.get("JobId", "0")))

    def _status_of(self, job: dict[str, str]) -> JobStatus:
        state = job.get("JobState", "UNKNOWN")
        message = f"{state} exit {job.get('ExitCode', '?')}" + (
            f" ({job['Reason']})" if job.get("Reason") not in (None, "None") else "")
        return JobStatus(job.get("JobName", ""), self.name, _STATES.get(state, "Unknown"), message,
                         attempt=int(job.get("Restarts", "0") or 0),
                         details={"job_id": job.get("JobId"), "stdout": job.get("StdOut")})

    def status(self, name: str) -> JobStatus:
        mine = [j for j in self._jobs() if j.get("JobName") == name]
        if mine:
            return self._status_of(mine[-1])
        return self._from_accounting(name)

    def _from_accounting(self, name: str) -> JobStatus:
        """A job the controller no longer holds: sacct over the last ACCOUNTING_DAYS, where the cluster
        keeps accounting; a cluster without it is named as the gap it is, and an accounting store
        that does not answer is an error, not "no such job"."""
        gone = f"no Slurm job named {name!r}"
        if shutil.which("sacct") is None:
            raise UserError(f"{gone} held by the controller, and sacct is not on PATH to look further back")
        out = subprocess.run(["sacct", "-n", "-X", "-P", "--name", name, "-S", f"now-{ACCOUNTING_DAYS}days",
                              "-o", "JobID,State,ExitCode"], capture_output=True, text=True)
        if out.returncode != 0:
            why = _last_line(out)
            if _NO_ACCOUNTING.search(why):
                raise UserError(f"{gone} held by the controller (it lets finished jobs go after MinJobAge), and "
                                "this cluster keeps no accounting to look further back")
            raise SlurmUnreachable(f"the Slurm controller holds no job named {name!r} and sacct could not read "
                                   f"accounting ({why}); check that slurmdbd runs")
        rows = [r.split("|") for r in out.stdout.splitlines() if r.strip()]
        if not rows:
            raise UserError(f"{gone} in the controller or in accounting's last {ACCOUNTING_DAYS} days "
                            "(see `fsdpkit job list --backend slurm`)")
        job_id, state, exit_code = rows[-1][:3]
        return JobStatus(name, self.name, _STATES.get(state.split()[0], "Unknown"), f"{state} exit {exit_code}",
                         details={"job_id": job_id})

    def jobs(self) -> Listing:
        return Listing([self._status_of(j) for j in self._jobs()], {})

    def cancel(self, name: str, delete_storage: bool = False,
               dry_run: bool = False) -> list[str]:
        """scancel: Slurm sends SIGTERM to every step, and SIGKILL only after KillWait. The shared
        storage is the cluster's: `delete_storage` removes nothing here."""
        st = self.status(name)
        self._need("scancel")
        if not st.finished and not dry_run:
            subprocess.run(["scancel", "--name", name], check=False)
        return [f"slurm/{name} (job {st.details['job_id']})"]

    def network(self, name: str) -> NetworkVerdict | None:
        """The network the trainer reported before its first step, from the start of the job's log."""
        return network_verdict(list(itertools.islice(self.logs(name), NETWORK_LINES)))

    def logs(self, name: str, follow: bool = False, replica: str | None = None,
             previous: bool = False, wait: float = 600, poll: float = 2.0) -> Iterator[str]:
        st = self.status(name)
        if not st.details.get("stdout"):
            raise UserError(f"cannot find the output file of Slurm job {st.details['job_id']} (the controller no "
                            "longer holds it; its --output is set in the spec's slurm.output)")
        yield from read_lines(Path(st.details["stdout"]), follow, lambda: self.status(name).finished, poll)

    def resubmit(self, name: str) -> bool:
        """Slurm requeues a job itself after a node failure or preemption (`--requeue` in the script, from
        `resubmits:`); fsdpkit starts nothing again."""
        return False
