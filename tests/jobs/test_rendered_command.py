"""The command a Kubernetes pod runs, really run. The PyTorchJob a spec renders (and the TrainJob and
HyperPod job, through the same node command) is taken as rendered, and each replica's container
command runs as a local process with that replica's environment. What Kubernetes would provide, the
test provides: the pod and Service names resolve to 127.0.0.1 (a private /etc/hosts per "pod",
mounted in its own mount namespace), the operator's variables are set, and the shared checkpoint
volume is a temp dir. The pods must train together to the loss one process gets, and resume."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from ports import free_port

from fsdpkit.jobs import manifests, trainjob
from fsdpkit.jobs.resolved import load_job

from conftest import ROOT, losses, read_metrics

VENV_BIN = str(Path(sys.executable).parent)
TRAIN = {"preset": "tiny", "seq_len": 64, "validation_freq": 0, "progress": "off", "logging_freq": 2,
         "checkpoint_freq": 4, "train_batch_size": 4, "tensorboard": False}


def _can_namespace() -> str | None:
    if shutil.which("unshare") is None:
        return "unshare (util-linux) is not installed"
    r = subprocess.run(["unshare", "--mount", "true"], capture_output=True)
    return None if r.returncode == 0 else "this machine cannot make a mount namespace (unshare --mount)"


# torch: the pods' rendered command trains (tests/torch_pass.py cannot read a command the renderer makes).
pytestmark = [pytest.mark.slow, pytest.mark.torch,
              pytest.mark.skipif(_can_namespace() is not None, reason=str(_can_namespace()))]


def spec_for(tmp_path, nodes, backend="pytorchjob", **train):
    return load_job(None, [("name", "rc"), ("backend", backend), ("image", "x:1"), ("nodes", nodes),
                            ("procs_per_node", 1), ("rdzv_port", free_port()), ("max_restarts", 0),
                            ("storage", {"claim": "ckpt", "mount_path": str(tmp_path / "volume")}),
                            ("train", {**TRAIN, **train})])


def pytorchjob_pods(job):
    """(pod name, node rank, container) of every replica, as the operator names them."""
    pods, rank = [], 0
    for rtype in ("Master", "Worker"):
        replica = job["spec"]["pytorchReplicaSpecs"].get(rtype)
        for i in range((replica or {}).get("replicas", 0)):
            pods.append((f"{job['metadata']['name']}-{rtype.lower()}-{i}", rank,
                         replica["template"]["spec"]["containers"][0]))
            rank += 1
    return pods


def start_pod(tmp_path, name, rank, container, nnodes, master, hosts):
    """One pod: its container's command and environment as rendered, what the operator adds, and
    the cluster's names for the job's pods (and nothing else) resolving here."""
    env = {"PATH": f"{VENV_BIN}:{os.environ['PATH']}", "HOME": str(tmp_path), "HOSTNAME": name,
           "OMP_NUM_THREADS": "1",
           **{e["name"]: e["value"] for e in container["env"] if "value" in e},
           # the training operator's own variables (torchrun's flags in the command win over them)
           "MASTER_ADDR": master, "MASTER_PORT": "23456", "WORLD_SIZE": str(nnodes), "RANK": str(rank),
           "PET_NNODES": str(nnodes), "PET_NODE_RANK": str(rank)}
    log = open(tmp_path / f"{name}.log", "w")  # noqa: SIM115 (closed with the process)
    proc = subprocess.Popen(["unshare", "--mount", "sh", "-c", 'mount --bind "$0" /etc/hosts && exec "$@"',
                             str(hosts), *container["command"]], cwd=tmp_path, env=env, stdout=log,
                            stderr=subprocess.STDOUT)
    proc.log = log
    return proc


def finish(procs, timeout=240):
    deadline = time.monotonic() + timeout
    for p in procs:
        try:
            p.wait(max(1.0, deadline - time.monotonic()))
        finally:
            p.log.close()
    return [p.returncode for p in procs]


def run_pods(tmp_path, job, pods, delay=0.0, names=None):
    """Start the pods (`delay` seconds apart), wait for all; `names` resolve to them (default: the
    pod names, which the operator also gives each pod's Service)."""
    nnodes = len(pods)
    hosts = tmp_path / "hosts"
    hosts.write_text(Path("/etc/hosts").read_text() + f"\n127.0.0.1 {' '.join(names or [p[0] for p in pods])}\n")
    procs = []
    for name, rank, container in pods:
        procs.append(start_pod(tmp_path, name, rank, container, nnodes, pods[0][0], hosts))
        time.sleep(delay)
    try:
        codes = finish(procs)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    logs = {name: (tmp_path / f"{name}.log").read_text() for name, _, _ in pods}
    assert codes == [0] * nnodes, logs
    return logs


def one_process(tmp_path, container, batch):
    """The same trainer flags in one process with the pods' global batch: the reference loss."""
    flags = container["command"][container["command"].index("fsdpkit.train") + 1:]
    run = tmp_path / "single"
    r = subprocess.run([sys.executable, "-m", "fsdpkit.train", *flags, "--train_batch_size", str(batch),
                        "--run_dir", str(run), "--checkpoint_dir", str(tmp_path / "single-ckpt")],
                       cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    return losses(run)


def test_rendered_command_of_a_two_node_pytorchjob_trains_as_one_world_and_resumes(tmp_path):
    job = manifests.pytorchjob_manifest(spec_for(tmp_path, "2", max_steps=8))
    pods = pytorchjob_pods(job)
    assert [p[0] for p in pods] == ["rc-master-0", "rc-worker-0"]
    run_pods(tmp_path, job, pods)
    run = tmp_path / "volume" / "rc" / "run"
    assert read_metrics(run, "start")[0]["world_size"] == 2
    two = losses(run)
    assert len(two) == 4 and two[-1] < two[0]
    assert two == pytest.approx(one_process(tmp_path, pods[0][2], 2 * TRAIN["train_batch_size"]), abs=1e-4)
    ckpts = sorted(p.name for p in (tmp_path / "volume" / "rc" / "checkpoints").glob("step-*"))
    assert ckpts == ["step-00000004", "step-00000008"]
    # A longer run of the same job, rendered again: the pods resume from the volume's newest checkpoint.
    job = manifests.pytorchjob_manifest(spec_for(tmp_path, "2", max_steps=12))
    run_pods(tmp_path, job, pytorchjob_pods(job))
    assert read_metrics(run, "start")[-1]["step"] == 8 and read_metrics(run)[-1]["step"] == 12


def test_rendered_command_of_an_elastic_job_forms_as_its_second_pod_arrives(tmp_path):
    job = manifests.pytorchjob_manifest(spec_for(tmp_path, "1:2", max_steps=4))
    pods = pytorchjob_pods(job)
    assert [p[0] for p in pods] == ["rc-worker-0", "rc-worker-1"]
    assert "--nnodes=1:2" in pods[0][2]["command"]
    # One pod first; the second arrives while the first waits in rendezvous for more members.
    run_pods(tmp_path, job, pods, delay=3.0)
    run = tmp_path / "volume" / "rc" / "run"
    assert read_metrics(run, "start")[-1]["world_size"] == 2 and read_metrics(run)[-1]["step"] == 4


def test_rendered_command_of_a_trainjob_trains_across_its_two_nodes(tmp_path):
    """Trainer v2 runs `trainer.command` with `trainer.env` on every node of the JobSet; pod i of
    the node job is NAME-node-0-i, reached through the JobSet's Service NAME."""
    job = trainjob.trainjob_manifest(spec_for(tmp_path, "2", backend="trainjob", max_steps=4))
    t = job["spec"]["trainer"]
    container = {"command": t["command"], "env": t["env"]}
    pods = [(f"rc-node-0-{i}", i, container) for i in range(t["numNodes"])]
    run_pods(tmp_path, job, pods, names=[f"{name}.rc.default.svc.cluster.local" for name, _, _ in pods])
    assert read_metrics(tmp_path / "volume" / "rc" / "run", "start")[0]["world_size"] == 2


def test_a_trainjob_s_first_node_knows_it_hosts_the_rendezvous_before_dns_does(tmp_path):
    """torch's own check, in a pod as the kubelet makes it: hostname NAME-node-0-0 and an /etc/hosts
    naming it with its full name, and no cluster DNS yet. The rendered endpoint is this pod; the
    short headless name would not be (node 0 would wait as a client of a store nobody hosts)."""
    if subprocess.run(["unshare", "--uts", "--mount", "true"], capture_output=True).returncode:
        pytest.skip("this machine cannot make a UTS namespace (unshare --uts)")
    job = trainjob.trainjob_manifest(spec_for(tmp_path, "2", backend="trainjob"))
    command = job["spec"]["trainer"]["command"]
    host = next(a for a in command if a.startswith("--rdzv-endpoint=")).split("=", 1)[1].rsplit(":", 1)[0]
    assert host == "rc-node-0-0.rc.default.svc.cluster.local"
    (tmp_path / "hosts").write_text("127.0.0.1 localhost\n10.1.2.3 rc-node-0-0.rc.default.svc.cluster.local "
                                    "rc-node-0-0\n")
    (tmp_path / "resolv.conf").write_text("nameserver 127.0.0.1\n")   # a cluster DNS that does not answer yet
    check = ("import sys; from torch.distributed.elastic.rendezvous.utils import _matches_machine_hostname as m; "
             "print(*(m(h) for h in sys.argv[1:]))")
    r = subprocess.run(["unshare", "--uts", "--mount", "sh", "-c", 'hostname rc-node-0-0 && mount --bind "$0" '
                        '/etc/hosts && mount --bind "$1" /etc/resolv.conf && shift && exec "$@"',
                        str(tmp_path / "hosts"), str(tmp_path / "resolv.conf"), sys.executable, "-c", check, host,
                        "rc-node-0-0.rc"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["True", "False"]
