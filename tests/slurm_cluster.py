"""A real Slurm on this machine, for the Slurm tests: munged, slurmctld and two slurmd "nodes"
(n1, n2) on 127.0.0.1, from Debian's slurm-wlm and munge. Its configuration lives in a temp folder
reached through SLURM_CONF, so nothing under /etc/slurm changes; it needs root (slurmd runs jobs as
their user). Each cluster has its own ports and its own munged (a socket in its folder), so two test
processes (pytest-xdist workers, make mutation's children) can each run one at once."""

from __future__ import annotations

import ctypes
import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

from ports import free_port

DAEMONS = ("munged", "slurmctld", "slurmd", "sbatch", "srun", "squeue", "scontrol", "scancel", "sinfo")
NODES = ("n1", "n2")


def why_not() -> str | None:
    """Why this machine cannot run the Slurm tests, or None."""
    missing = [d for d in DAEMONS if shutil.which(d) is None and not Path(f"/usr/sbin/{d}").exists()]
    if missing:
        return f"Slurm is not installed here ({', '.join(missing)} missing): apt-get install slurm-wlm munge"
    if os.geteuid() != 0:
        return "the Slurm tests start slurmd, which must run as root"
    return None


def _conf(root: Path, ctld_port: int, node_ports: dict[str, int]) -> str:
    host = socket.gethostname().split(".")[0]
    nodes = "\n".join(f"NodeName={n} NodeHostname={host} NodeAddr=127.0.0.1 Port={p} CPUs=1 RealMemory=4000 "
                      "State=UNKNOWN" for n, p in node_ports.items())
    return f"""ClusterName=fsdpkit-test
SlurmctldHost={host}(127.0.0.1)
SlurmctldPort={ctld_port}
SlurmUser=root
AuthType=auth/munge
AuthInfo=socket={root}/munge.socket
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool-%n
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/slurmd-%n.pid
SlurmctldLogFile={root}/slurmctld.log
SlurmdLogFile={root}/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
ReturnToService=2
MpiDefault=none
MinJobAge=3600
{nodes}
PartitionName=debug Nodes={",".join(node_ports)} Default=YES MaxTime=INFINITE State=UP
"""


class SlurmCluster:
    def __init__(self, root: Path):
        self.root = root
        self.conf = root / "slurm.conf"
        self.env = {"SLURM_CONF": str(self.conf)}
        self._procs: list[subprocess.Popen] = []

    def start(self) -> None:
        (self.root / "state").mkdir(parents=True, exist_ok=True)
        self.conf.write_text(_conf(self.root, free_port(), {n: free_port() for n in NODES}))
        self._start_munge()
        env = {**os.environ, **self.env}
        for argv in (["slurmctld", "-D"], *(["slurmd", "-D", "-N", n] for n in NODES)):
            self._procs.append(subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                                preexec_fn=_die_with_parent))
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            r = subprocess.run(["sinfo", "-h", "-N", "-o", "%N %T"], env=env, capture_output=True, text=True)
            states = dict(line.split() for line in r.stdout.splitlines() if line.strip())
            if r.returncode == 0 and all(states.get(n) == "idle" for n in NODES):
                return
            for p in self._procs:
                if p.poll() is not None:
                    self.stop()
                    raise RuntimeError(f"a Slurm daemon exited ({p.args}): see {self.root}/*.log")
            time.sleep(0.5)
        self.stop()
        raise RuntimeError(f"Slurm nodes did not become idle: {r.stdout} {r.stderr}; see {self.root}/*.log")

    def _start_munge(self) -> None:
        """This cluster's munged, as root (--force: its files are in this root-owned folder), in the
        foreground so it is one of the processes `stop` ends."""
        self._procs.append(subprocess.Popen(
            ["munged", "--foreground", "--force", f"--socket={self.root}/munge.socket",
             f"--pid-file={self.root}/munged.pid", f"--log-file={self.root}/munged.log",
             f"--seed-file={self.root}/munged.seed"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, preexec_fn=_die_with_parent))
        deadline = time.monotonic() + 10
        while not (self.root / "munge.socket").exists():
            if time.monotonic() > deadline or self._procs[-1].poll() is not None:
                raise RuntimeError(f"munged did not start: see {self.root}/munged.log")
            time.sleep(0.05)

    def unreachable_conf(self, path: Path) -> Path:
        """This cluster's configuration with its controller on a port nobody listens on."""
        path.write_text(self.conf.read_text().replace("SlurmctldPort=", f"SlurmctldPort={free_port()}\n# was: "))
        return path

    def stop(self) -> None:
        """Every job cancelled (their slurmstepd would outlive slurmd), then every daemon this cluster
        started, by pid: first TERM, then KILL."""
        env = {**os.environ, **self.env}
        if any(p.poll() is None for p in self._procs):
            subprocess.run(["scancel", "--full", "--user", str(os.geteuid())], env=env, capture_output=True)
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline and subprocess.run(
                    ["squeue", "-h"], env=env, capture_output=True, text=True).stdout.strip():
                time.sleep(0.5)
        # The Slurm daemons first, munged (the first started) last: they sign their goodbyes with it.
        for p in reversed(self._procs):
            if p.poll() is None:
                p.terminate()
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(10)


def _die_with_parent() -> None:
    """In the daemon, before exec: SIGTERM when the test process ends, even by SIGKILL, so no
    slurmctld or slurmd outlives the session that started it."""
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG

