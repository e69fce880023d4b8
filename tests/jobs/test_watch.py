"""Health detection: nccl-tests output (EFA and socket fallback), and `fsdpkit job watch` on scripted
pod states and log streams: stall, OOMKilled, crash loop, pending with its reason, NCCL timeout,
a tiered checkpoint off its memory tier."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from fsdpkit.cluster.nccl import parse_all_reduce, verdict
from fsdpkit.hardware.instances import INSTANCES

from conftest import ROOT, run_cli
from job_specs import job_cli, set_conditions, stamp, write_spec

DATA = ROOT / "tests" / "data" / "nccl"


def test_nccl_efa_run_parses_and_passes():
    res = parse_all_reduce((DATA / "p5-2node-efa.log").read_text())
    assert res.network == "efa" and res.hosts == 2 and res.wrong == 0
    assert [r["size"] for r in res.rows] == [8, 1024, 1048576, 134217728, 1073741824, 17179869184]
    assert res.rows[-1]["busbw"] == 284.03 and res.peak_busbw == 284.31 and res.avg_busbw == 118.762
    status, why = verdict(res, INSTANCES["p5.48xlarge"], nodes=2)
    assert status == "pass" and "71% of p5.48xlarge's 3200 Gbit/s" in why


def test_nccl_socket_fallback_is_named():
    res = parse_all_reduce((DATA / "p5-2node-socket.log").read_text())
    assert res.network == "socket" and res.peak_busbw == 4.78
    status, why = verdict(res, INSTANCES["p5.48xlarge"], nodes=2)
    assert status == "fail" and why.startswith("EFA not used: NCCL fell back to sockets")


def test_nccl_wrong_data_and_empty_log_fail():
    text = (DATA / "p5-2node-efa.log").read_text().replace("284.03      0", "284.03      3")
    assert verdict(parse_all_reduce(text), INSTANCES["p5.48xlarge"], 2)[0] == "fail"
    assert verdict(parse_all_reduce("NCCL WARN something"), None, 2)[0] == "fail"


def pod(kube, name, status, index=0, rtype="master"):
    kube.create("/api/v1/namespaces/default/pods", {
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": name, "namespace": "default", "labels": {
            "training.kubeflow.org/job-name": "llama-tiny", "training.kubeflow.org/replica-type": rtype,
            "training.kubeflow.org/replica-index": str(index)}},
        "spec": {"containers": [{"name": "pytorch", "image": "x"}]}, "status": status})


def log_reads(kube) -> list[str]:
    """Paths (with queries) of the pod-log reads the API server saw, in order."""
    return [p for m, p, _ in kube.requests() if p.split("?")[0].endswith("/log")]


def watch(kube, *extra):
    r = job_cli(kube, "watch", "llama-tiny", "--once", "--json", *extra)
    assert r.stdout, r.stderr[-3000:]
    return r.returncode, json.loads(r.stdout)["data"]


@pytest.fixture
def running_job(kube, tmp_path):
    assert job_cli(kube, "submit", str(write_spec(tmp_path))).returncode == 0
    set_conditions(kube, "llama-tiny", "Created", "Running")
    return kube


def test_healthy_job_shows_progress_and_no_findings(running_job):
    kube = running_job
    pod(kube, "llama-tiny-master-0", {"phase": "Running", "containerStatuses": [
        {"name": "pytorch", "restartCount": 0, "state": {"running": {}}}]})
    kube.route("get /api/v1/namespaces/default/pods/llama-tiny-master-0/log",
               f"{stamp(71)} fsdpkit: network: efa (NCCL 2.21.5+cuda12.4, aws-ofi-nccl 1.14.0, provider efa, "
               f"32 NICs)\n"
               f"{stamp(70)} fsdpkit: tiny (0.82M params), 16 x cuda\n"
               f"{stamp(40)} Batch 10 Loss: 4.10000, Speed: 1.0 samples/sec, lr: 0.0003, grad_norm: 1.0, "
               f"tokens/s: 81234, tokens/s/device: 5077\n"
               f"{stamp(5)} Batch 20 Loss: 3.50000, Speed: 1.0 samples/sec, lr: 0.0003, grad_norm: 1.0, "
               f"tokens/s: 82000, tokens/s/device: 5125\n".encode())
    code, snap = watch(kube, "--stall-after", "60")
    assert code == 0, snap
    assert snap["state"] == "Running" and snap["findings"] == []
    assert snap["progress"]["step"] == 20 and snap["progress"]["loss"] == 3.5
    assert snap["progress"]["tokens_per_s"] == 82000 and snap["progress"]["last_step_age_s"] < 30
    assert "timestamps=True" in log_reads(kube)[-1] and "tailLines=500" in log_reads(kube)[-1]
    # The network the trainer reported, found in the same read.
    assert (snap["network"]["transport"], snap["network"]["nics"], snap["network"]["plugin"]) == ("efa", 32, "1.14.0")
    human = run_cli("job", "watch", "llama-tiny", "--once", "--stall-after", "60", env=kube.env)
    assert "| network efa (32 NICs, provider efa) |" in human.stdout


def test_job_status_shows_the_network_verdict_from_the_start_of_rank0s_log(running_job):
    kube = running_job
    pod(kube, "llama-tiny-master-0", {"phase": "Running"})
    kube.route("get /api/v1/namespaces/default/pods/llama-tiny-master-0/log",
               b"fsdpkit: network: socket (NCCL 2.21.5+cuda12.4, 1 NICs, TCP sockets; net plugin libnccl-net.so "
               b"not found)\nBatch 10 Loss: 4.1, Speed: 1.0 samples/sec, lr: 0.1, tokens/s: 9\n")
    r = job_cli(kube, "status", "llama-tiny", "--json")
    assert r.returncode == 0, r.stderr
    net = json.loads(r.stdout)["data"]["details"]["network"]
    assert net["transport"] == "socket" and "libnccl-net.so not found" in net["detail"]
    assert "limitBytes=262144" in log_reads(kube)[-1]
    human = job_cli(kube, "status", "llama-tiny")
    assert "  network: socket (1 NICs, TCP sockets; net plugin libnccl-net.so not found)" in human.stdout


def test_stall_nccl_timeout_and_a_tiered_fallback_are_found_in_the_log(running_job):
    kube = running_job
    pod(kube, "llama-tiny-master-0", {"phase": "Running"})
    kube.route("get /api/v1/namespaces/default/pods/llama-tiny-master-0/log",
               f"{stamp(2000)} Batch 10 Loss: 4.1, Speed: 1.0 samples/sec, lr: 0.1, tokens/s: 9\n"
               f"{stamp(300)} [rank3]:[E1122 10:00:00.000 ProcessGroupNCCL.cpp:616] [Rank 3] Watchdog caught "
               f"collective operation timeout: WorkNCCL(SeqNum=812, OpType=ALLREDUCE) ran for 600000 ms\n"
               f"{stamp(200)} warning: checkpoint.tiered: the in-memory store (job-1a2b3c4d) failed saving step 10 "
               f"(ConnectionError: refused); using shared storage\n".encode())
    code, snap = watch(kube, "--stall-after", "900")
    assert code == 1
    kinds = {f["kind"]: f for f in snap["findings"]}
    assert set(kinds) == {"stall", "nccl_timeout", "tiered_off"}
    assert kinds["tiered_off"]["detail"].startswith("warning: checkpoint.tiered: the in-memory store")
    assert kinds["stall"]["detail"].startswith("no new step for 2")
    assert "Watchdog caught collective operation timeout" in kinds["nccl_timeout"]["detail"]


def test_oom_crashloop_and_pending_reasons(running_job):
    kube = running_job
    pod(kube, "llama-tiny-master-0", {"phase": "Running", "containerStatuses": [
        {"name": "pytorch", "restartCount": 3, "state": {"waiting": {"reason": "CrashLoopBackOff"}},
         "lastState": {"terminated": {"reason": "OOMKilled", "exitCode": 137}}}]})
    pod(kube, "llama-tiny-worker-0", {"phase": "Pending", "conditions": [
        {"type": "PodScheduled", "status": "False", "reason": "Unschedulable",
         "message": "0/4 nodes are available: 2 Insufficient nvidia.com/gpu, 2 node(s) had untolerated taint "
                    "{dedicated: ml}. preemption: 0/4 nodes are available."}]}, rtype="worker")
    pod(kube, "llama-tiny-worker-1", {"phase": "Pending", "conditions": [
        {"type": "PodScheduled", "status": "False", "reason": "Unschedulable",
         "message": "0/4 nodes are available: 4 Insufficient vpc.amazonaws.com/efa."}]}, index=1, rtype="worker")
    kube.route("get /api/v1/namespaces/default/pods/llama-tiny-master-0/log", b"")
    code, snap = watch(kube)
    assert code == 1
    got = sorted((f["kind"], f["pod"]) for f in snap["findings"])
    assert got == [("crashloop", "llama-tiny-master-0"), ("oom", "llama-tiny-master-0"),
                   ("pending", "llama-tiny-worker-0"), ("pending", "llama-tiny-worker-1")]
    pending = {f["pod"]: f for f in snap["findings"] if f["kind"] == "pending"}
    assert pending["llama-tiny-worker-0"]["detail"].startswith("not enough free GPUs")
    assert pending["llama-tiny-worker-1"]["detail"].startswith("not enough free EFA devices")
    assert {p["name"]: (p["phase"], p["restarts"], p["reason"]) for p in snap["pods"]}["llama-tiny-master-0"] == \
        ("Running", 3, "CrashLoopBackOff")
    human = run_cli("job", "watch", "llama-tiny", "--once", env=kube.env)
    assert "! oom llama-tiny-master-0: container pytorch was OOMKilled (restarts 3)" in human.stdout


def test_watch_resubmits_a_failed_job_within_its_budget(kube, tmp_path):
    assert job_cli(kube, "submit", str(write_spec(tmp_path, resubmits=1))).returncode == 0
    set_conditions(kube, "llama-tiny", "Created", "Running", "Failed")
    proc = subprocess.Popen([sys.executable, "-m", "fsdpkit", "job", "watch", "llama-tiny", "--resubmit",
                             "--poll", "0.2"], cwd=ROOT, env={**os.environ, **kube.env},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    def attempt() -> str | None:
        job = kube.get_job("llama-tiny")
        return None if job is None else job["metadata"]["annotations"]["fsdpkit.dev/attempt"]

    deadline = time.monotonic() + 60
    while attempt() != "1":
        assert time.monotonic() < deadline and proc.poll() is None, proc.communicate()
        time.sleep(0.2)
    set_conditions(kube, "llama-tiny", "Created", "Running", "Succeeded")
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    assert "resubmitting, attempt 1 of 1" in err and "llama-tiny: Succeeded" in out
