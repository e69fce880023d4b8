"""A real Slurm on this machine, for the Slurm tests: munged, slurmctld and two slurmd "nodes"
(n1, n2) on 127.0.0.1, from Debian's slurm-wlm and munge. Its configuration lives in a temp folder
reached through SLURM_CONF, so nothing under /etc/slurm changes; it needs root (slurmd runs jobs as
their user). Each cluster has its own ports and its own munged (a socket in its folder), so two test
processes (pytest-xdist workers, make mutation's children) can each run one at once. With
`accounting`, it also keeps accounting as a production cluster does: slurmdbd over its own MariaDB
(Debian's slurmdbd and mariadb-server), so `sacct` answers for jobs the controller has let go."""

from __future__ import annotations

import ctypes
import os
import re
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

from ports import free_port

DAEMONS = ("munged", "slurmctld", "slurmd", "sbatch", "srun", "squeue", "scontrol", "scancel", "sinfo")
ACCOUNTING = ("slurmdbd", "sacct", "mariadbd", "mariadb-install-db")
NODES = ("n1", "n2")


def why_not(accounting: bool = False) -> str | None:
    """Why this machine cannot run the Slurm tests (with accounting, those that need it), or None."""
    needed, packages = (DAEMONS + ACCOUNTING, "slurm-wlm munge slurmdbd mariadb-server") if accounting else (
        DAEMONS, "slurm-wlm munge")
    missing = [d for d in needed if shutil.which(d) is None and not Path(f"/usr/sbin/{d}").exists()]
    if missing:
        return f"Slurm is not installed here ({', '.join(missing)} missing): apt-get install {packages}"
    if os.geteuid() != 0:
        return "the Slurm tests start slurmd, which must run as root"
    return None


def _conf(root: Path, ctld_port: int, node_ports: dict[str, int], dbd_port: int | None) -> str:
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
{_storage(root, dbd_port)}
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


def _storage(root: Path, dbd_port: int | None) -> str:
    if dbd_port is None:
        return "AccountingStorageType=accounting_storage/none"
    # AccountingStoragePass names the munge socket for the slurmdbd connection (AuthInfo is not read there).
    return (f"AccountingStorageType=accounting_storage/slurmdbd\nAccountingStorageHost=127.0.0.1\n"
            f"AccountingStoragePort={dbd_port}\nAccountingStoragePass={root}/munge.socket")


def _dbd_conf(root: Path, dbd_port: int, db_port: int) -> str:
    """slurmdbd's configuration (beside slurm.conf, where slurmdbd looks for it); MariaDB's root
    over TCP without a password, as the database was made for this cluster alone."""
    return f"""AuthType=auth/munge
AuthInfo=socket={root}/munge.socket
DbdHost={socket.gethostname().split(".")[0]}
DbdAddr=127.0.0.1
DbdPort={dbd_port}
SlurmUser=root
PidFile={root}/slurmdbd.pid
LogFile={root}/slurmdbd.log
StorageType=accounting_storage/mysql
StorageHost=127.0.0.1
StoragePort={db_port}
StorageUser=root
StorageLoc=slurm_acct_db
"""


class SlurmCluster:
    def __init__(self, root: Path, accounting: bool = False):
        self.root = root
        self.accounting = accounting
        self.conf = root / "slurm.conf"
        self.env = {"SLURM_CONF": str(self.conf)}
        self._procs: list[subprocess.Popen] = []

    def start(self) -> None:
        (self.root / "state").mkdir(parents=True, exist_ok=True)
        dbd_port = free_port() if self.accounting else None
        self.conf.write_text(_conf(self.root, free_port(), {n: free_port() for n in NODES}, dbd_port))
        self._start_munge()
        env = {**os.environ, **self.env}
        if dbd_port is not None:
            self._start_accounting(dbd_port, env)
        for argv in (["slurmctld", "-D"], *(["slurmd", "-D", "-N", n] for n in NODES)):
            self._procs.append(self._daemon(argv, env))
        self._wait_idle(env)

    @staticmethod
    def _daemon(argv: list[str], env: dict[str, str]) -> subprocess.Popen:
        return subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                preexec_fn=_die_with_parent)

    def _wait_idle(self, env: dict[str, str]) -> None:
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

    def _start_accounting(self, dbd_port: int, env: dict[str, str]) -> None:
        """MariaDB in this cluster's folder (small logs and buffers: a test's few jobs), then slurmdbd
        on it; slurmctld, started after, registers the cluster itself."""
        data, db_port = self.root / "db", free_port()
        small = ["--innodb-log-file-size=4M", "--innodb-buffer-pool-size=16M"]
        made = subprocess.run(["mariadb-install-db", "--no-defaults", f"--datadir={data}", "--user=root",
                               "--auth-root-authentication-method=normal", "--skip-test-db", *small],
                              capture_output=True, text=True)
        if made.returncode != 0:
            raise RuntimeError(f"mariadb-install-db failed: {made.stderr.strip()[-500:]}")
        self._procs.append(subprocess.Popen(
            ["mariadbd", "--no-defaults", f"--datadir={data}", "--user=root", f"--socket={self.root}/db.socket",
             f"--port={db_port}", "--bind-address=127.0.0.1", "--skip-name-resolve", *small,
             f"--log-error={self.root}/mariadb.log"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, preexec_fn=_die_with_parent))
        self._wait_for_port(db_port, "mariadbd", "mariadb.log")
        dbd_conf = self.root / "slurmdbd.conf"
        dbd_conf.write_text(_dbd_conf(self.root, dbd_port, db_port))
        dbd_conf.chmod(0o600)   # slurmdbd refuses a configuration others can read: it holds the database login
        self._procs.append(subprocess.Popen(["slurmdbd", "-D"], env=env, stdout=subprocess.DEVNULL,
                                            stderr=subprocess.DEVNULL, preexec_fn=_die_with_parent))
        self._wait_for_port(dbd_port, "slurmdbd", "slurmdbd.log")

    def _wait_for_port(self, port: int, daemon: str, log: str) -> None:
        deadline = time.monotonic() + 60
        while True:
            with socket.socket() as s:
                if s.connect_ex(("127.0.0.1", port)) == 0:
                    return
            if time.monotonic() > deadline or self._procs[-1].poll() is not None:
                self.stop()
                raise RuntimeError(f"{daemon} did not start: see {self.root}/{log}")
            time.sleep(0.1)

    def restart_controller(self) -> None:
        """slurmctld again with its saved state cleared (-c): it holds none of the jobs it ran before,
        as after MinJobAge; accounting still has them. Its job ids go on from 1000, so a new job
        never takes an id accounting already holds. First, accounting has every job the controller
        holds: the controller sends them to slurmdbd in the background, and what it has not sent
        when it stops is state that -c clears."""
        env = {**os.environ, **self.env}

        def ids(argv: list[str]) -> set[str]:
            out = subprocess.run(argv, env=env, capture_output=True, text=True, check=True).stdout
            return set(re.findall(r"^(?:JobId=)?(\d+)\b", out, re.M))

        deadline = time.monotonic() + 30
        while not ids(["scontrol", "show", "job", "-o"]) <= ids(["sacct", "-a", "-X", "-n", "-P", "-o", "JobID"]):
            assert time.monotonic() < deadline, "accounting did not get the controller's jobs"
            time.sleep(0.2)
        ctld = next(i for i, p in enumerate(self._procs) if p.args[0] == "slurmctld")
        self._procs[ctld].terminate()
        self._procs[ctld].wait(30)
        self.conf.write_text(self.conf.read_text().replace("ClusterName=", "FirstJobId=1000\nClusterName=", 1))
        self._procs[ctld] = self._daemon(["slurmctld", "-D", "-c"], env)
        self._wait_idle(env)

    def unreachable_conf(self, path: Path, port: str = "SlurmctldPort") -> Path:
        """This cluster's configuration with one of its daemons (by its port's key: the controller's,
        AccountingStoragePort for slurmdbd) on a port nobody listens on."""
        # A short MessageTimeout: the commands give up on the silent daemon in a second or two, not ten.
        path.write_text(self.conf.read_text().replace(f"{port}=", f"{port}={free_port()}\n# was: ")
                        + "MessageTimeout=2\n")
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

