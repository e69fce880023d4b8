"""`fsdpkit job` against a Kubernetes API (kmock over HTTP, the official client on our side): what
submit creates, status through the operator's condition changes, logs from the right pods, delete,
duplicates, rollback, resubmission, and that no secret value leaks."""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
import time

import pytest
import yaml

from fsdpkit.cluster.rbac import role_rules

from conftest import ROOT, require, run_cli
from job_specs import GROUP, PLURAL, TOKEN, VERSION, Kueue, job_cli, set_conditions, write_spec, writes
from kube_admission import PodAdmission

require("kmock")
require("kubernetes")


def make_pod(kube, job, rtype, index, phase="Running"):
    """Play the operator and kubelet: a pod of the job with the labels the operator sets."""
    from kubernetes import client

    name = f"{job}-{rtype.lower()}-{index}"
    client.CoreV1Api(kube.api()).create_namespaced_pod("default", {
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": name, "namespace": "default", "labels": {
            "training.kubeflow.org/job-name": job, "training.kubeflow.org/replica-type": rtype.lower(),
            "training.kubeflow.org/replica-index": str(index)}},
        "spec": {"containers": [{"name": "pytorch", "image": "x"}]}, "status": {"phase": phase}})
    return name


def test_submit_creates_exactly_secret_pvc_and_job_and_no_secret_value_leaks(kube, tmp_path):
    spec = write_spec(tmp_path)
    r = job_cli(kube, "submit", str(spec), "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)["data"]
    assert out["created"] == ["Secret/llama-tiny-hf-token", "PersistentVolumeClaim/llama-tiny-ckpt",
                              "PyTorchJob/llama-tiny"]
    posts = [(p, body) for m, p, body in kube.requests() if m == "POST"]
    assert [p for p, _ in posts] == [f"{path}?fieldValidation=Strict" for path in (
        "/api/v1/namespaces/default/secrets", "/api/v1/namespaces/default/persistentvolumeclaims",
        "/apis/kubeflow.org/v1/namespaces/default/pytorchjobs")]
    secret, pvc, job = (b for _, b in posts)
    # The token travels only inside the Secret ...
    assert secret["stringData"] == {"token": TOKEN}
    assert pvc["spec"]["resources"]["requests"]["storage"] == "1200Gi"
    container = job["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]["containers"][0]
    assert {"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "llama-tiny-hf-token", "key": "token"}}} \
        in container["env"]
    # ... and nowhere else: not in the job, nor anything the CLI printed (render, submit, status, list).
    assert TOKEN not in json.dumps(job)
    printed = r.stdout + r.stderr
    for args in (["render", str(spec)], ["render", str(spec), "--json"], ["status", "llama-tiny", "--json"],
                 ["status", "llama-tiny"], ["list", "--backend", "pytorchjob", "--json"]):
        rr = job_cli(kube, *args)
        assert rr.returncode == 0, (args, rr.stderr)
        printed += rr.stdout + rr.stderr
    assert TOKEN not in printed


def test_status_follows_the_operator_conditions(kube, tmp_path):
    spec = write_spec(tmp_path)
    assert job_cli(kube, "submit", str(spec)).returncode == 0
    seen = []
    for conds in (["Created"], ["Created", "Running"], ["Created", "Running", "Restarting"],
                  ["Created", "Restarting", "Running"], ["Created", "Running", "Succeeded"]):
        set_conditions(kube, "llama-tiny", *conds)
        r = job_cli(kube, "status", "llama-tiny", "--json")
        assert r.returncode == 0, r.stderr
        seen.append(json.loads(r.stdout)["data"]["state"])
    assert seen == ["Created", "Running", "Restarting", "Running", "Succeeded"]
    r = job_cli(kube, "wait", "llama-tiny", "--poll", "0.1")
    assert r.returncode == 0 and "Succeeded" in r.stdout

    set_conditions(kube, "llama-tiny", "Created", "Running")
    r = job_cli(kube, "wait", "llama-tiny", "--poll", "0.1", "--timeout", "0.3", "--json")
    envelope = json.loads(r.stdout)  # ok exactly when the exit code is 0; the status is still in data
    assert r.returncode == 124 and envelope["ok"] is False and envelope["data"]["state"] == "Running"
    assert envelope["error"]["code"] == "timeout" and "still Running" in envelope["error"]["message"]

    set_conditions(kube, "llama-tiny", "Created", "Running", "Failed")
    r = job_cli(kube, "wait", "llama-tiny", "--poll", "0.1", "--json")
    envelope = json.loads(r.stdout)
    assert r.returncode == 1 and envelope["ok"] is False and envelope["data"]["state"] == "Failed"
    assert envelope["error"]["code"] == "failed" and "job logs llama-tiny --previous" in envelope["error"]["hint"]

    r = job_cli(kube, "submit", str(spec), "--json")  # the name is taken
    error = json.loads(r.stdout)["error"]
    assert r.returncode == 2 and error["code"] == "conflict" and "--replace" in error["hint"]


def test_logs_wait_for_pods_and_stream_from_the_chosen_replica(kube, tmp_path):
    assert job_cli(kube, "submit", str(write_spec(tmp_path))).returncode == 0
    for pod, text in (("llama-tiny-master-0", b"rank0 step 1\nrank0 step 2\n"),
                      ("llama-tiny-worker-0", b"rank8 step 1\n"),
                      ("other-master-0", b"not this job\n")):
        kube.route(f"get /api/v1/namespaces/default/pods/{pod}/log", text)
    # Start following before any pod exists: the command must wait for them, then stream.
    def pod_lists() -> int:
        return sum(1 for m, p, _ in kube.requests() if m == "GET" and p.split("?")[0].endswith("/pods"))

    before = pod_lists()
    proc = subprocess.Popen([sys.executable, "-m", "fsdpkit", "job", "logs", "llama-tiny", "-f"], cwd=ROOT,
                            env={**os.environ, **kube.env}, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    while pod_lists() == before and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.2)  # until it has looked once and found no pod (a loaded machine imports slowly)
    assert proc.poll() is None, proc.communicate()
    make_pod(kube, "other", "Master", 0)  # another job's pod: never read
    make_pod(kube, "llama-tiny", "Master", 0)
    make_pod(kube, "llama-tiny", "Worker", 0)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    assert "waiting for the pods of llama-tiny" in err
    assert out.splitlines() == ["rank0 step 1", "rank0 step 2"]

    r = job_cli(kube, "logs", "llama-tiny", "--replica", "worker-0")
    assert r.returncode == 0 and r.stdout.splitlines() == ["rank8 step 1"]
    r = job_cli(kube, "logs", "llama-tiny", "--replica", "all")
    assert r.stdout.splitlines() == ["[master-0] rank0 step 1", "[master-0] rank0 step 2", "[worker-0] rank8 step 1"]
    r = job_cli(kube, "logs", "llama-tiny", "--replica", "worker-7")
    assert r.returncode == 2 and "worker-7" in r.stderr and "master-0, worker-0" in r.stderr

    log_reads = [p for m, p, _ in kube.requests() if m == "GET" and p.split("?")[0].endswith("/log")]
    assert log_reads and all("/pods/llama-tiny-" in p for p in log_reads)
    assert all("container=pytorch" in p for p in log_reads)
    assert any("follow=true" in p.lower() for p in log_reads)
    # The pod listing asked the server for this job's pods by the operator's label.
    assert any("labelSelector=training.kubeflow.org%2Fjob-name%3Dllama-tiny" in p
               for m, p, _ in kube.requests() if p.startswith("/api/v1/namespaces/default/pods?"))


def test_logs_of_a_finished_or_deleted_job_say_so_at_once_and_a_timeout_exits_124(kube, tmp_path):
    """No pods and nothing to wait for is one line at once; a job that never gets pods is waited for
    as long as --timeout says, with progress, and ends with the code `job wait --timeout` uses."""
    assert job_cli(kube, "submit", str(write_spec(tmp_path))).returncode == 0
    start = time.monotonic()
    r = job_cli(kube, "logs", "llama-tiny", "--timeout", "5s")
    took = time.monotonic() - start
    assert r.returncode == 124 and 5 <= took < 25, (r.returncode, took, r.stderr)
    lines = r.stderr.strip().splitlines()
    assert lines[0] == "waiting for the pods of llama-tiny (job Pending, 0 s of 5) ..."
    assert lines[-1].startswith("error: job 'llama-tiny' has no pods after 5 s (job Pending); see `fsdpkit job status")
    envelope = json.loads(job_cli(kube, "logs", "llama-tiny", "--timeout", "1s", "--json").stdout)
    assert envelope["ok"] is False and envelope["error"]["code"] == "timeout"
    r = job_cli(kube, "wait", "llama-tiny", "--timeout", "1s", "--poll", "0.2")
    assert r.returncode == 124   # the same code for the same thing

    # The operator finished the job and its pods went (cleanPodPolicy, TTL): nothing to wait for.
    set_conditions(kube, "llama-tiny", "Created", "Running", "Succeeded")
    start = time.monotonic()
    r = job_cli(kube, "logs", "llama-tiny", "-f")
    assert r.returncode == 2 and time.monotonic() - start < 15
    assert r.stderr.strip().splitlines() == [
        "error: job 'llama-tiny' ended Succeeded and its pods are gone, so are their logs; what it wrote is on its "
        "storage (see `fsdpkit ckpt list` and its run directory)"]
    assert json.loads(job_cli(kube, "logs", "llama-tiny", "--json").stdout)["error"]["code"] == "not_found"

    # Deleted: one line at once, also while the deletion is still going on (its pods going with it).
    kube.call(lambda: kube.handler.objects[
        ("kubeflow.org", "v1", "pytorchjobs"), "default", "llama-tiny"].patch(
        {"metadata": {"deletionTimestamp": "2026-11-27T10:00:00Z"}}))
    r = job_cli(kube, "logs", "llama-tiny", "-f")
    assert r.returncode == 2 and r.stderr.strip().splitlines() == [
        "error: job 'llama-tiny' is being deleted (since 2026-11-27T10:00:00Z); it has no logs to follow"]
    assert job_cli(kube, "delete", "llama-tiny").returncode == 0
    start = time.monotonic()
    r = job_cli(kube, "logs", "llama-tiny", "-f")
    assert r.returncode == 2 and time.monotonic() - start < 15
    assert r.stderr.strip().splitlines() == [
        "error: job 'llama-tiny' not found in namespace default (see `fsdpkit job list`)"]


def test_delete_removes_job_and_secret_and_keeps_storage_unless_asked(kube, tmp_path):
    assert job_cli(kube, "submit", str(write_spec(tmp_path))).returncode == 0
    r = job_cli(kube, "delete", "llama-tiny")
    assert r.returncode == 0, r.stderr
    assert "storage is kept" in r.stdout
    deletes = [p for m, p in writes(kube) if m == "DELETE"]
    assert deletes == ["/apis/kubeflow.org/v1/namespaces/default/pytorchjobs/llama-tiny",
                       "/api/v1/namespaces/default/secrets/llama-tiny-hf-token"]
    r = job_cli(kube, "status", "llama-tiny")
    assert r.returncode == 2 and "not found" in r.stderr

    # Submitting again reuses the job's PVC (its checkpoints), then --delete-storage removes it.
    r = job_cli(kube, "submit", str(write_spec(tmp_path)), "--json")
    assert json.loads(r.stdout)["data"]["reused"] == ["PersistentVolumeClaim/llama-tiny-ckpt"]
    before = writes(kube)
    r = job_cli(kube, "delete", "llama-tiny", "--delete-storage", "--dry-run", "--json")
    assert json.loads(r.stdout)["data"]["would_delete"] == [
        "PyTorchJob/llama-tiny", "Secret/llama-tiny-hf-token", "PersistentVolumeClaim/llama-tiny-ckpt"]
    # The checkpoints go with the volume: asked first; nobody at a terminal and no --yes is a refusal.
    r = job_cli(kube, "delete", "llama-tiny", "--delete-storage", "--json")
    assert r.returncode == 2 and json.loads(r.stdout)["error"]["message"] == (
        "delete: removes PyTorchJob/llama-tiny, Secret/llama-tiny-hf-token, PersistentVolumeClaim/llama-tiny-ckpt; "
        "add --yes to confirm")
    assert writes(kube) == before
    r = job_cli(kube, "delete", "llama-tiny", "--delete-storage", "--yes", "--json")
    assert "PersistentVolumeClaim/llama-tiny-ckpt" in json.loads(r.stdout)["data"]["deleted"]
    assert writes(kube)[-1] == ("DELETE", "/api/v1/namespaces/default/persistentvolumeclaims/llama-tiny-ckpt")


def test_duplicate_name_is_refused_and_nothing_is_created(kube, tmp_path):
    spec = write_spec(tmp_path)
    assert job_cli(kube, "submit", str(spec)).returncode == 0
    before = writes(kube)
    r = job_cli(kube, "submit", str(spec))
    assert r.returncode == 2
    assert r.stderr.strip().splitlines() == [
        "error: job 'llama-tiny' already exists in namespace default; pick another name, or pass --replace to "
        "delete it and submit again (checkpoints on its storage are kept)"]
    assert writes(kube) == before
    # --replace deletes the old job, then creates it again.
    r = job_cli(kube, "submit", str(spec), "--replace")
    assert r.returncode == 0, r.stderr
    assert [w for w in writes(kube)[len(before):] if "pytorchjobs" in w[1]] == [
        ("DELETE", "/apis/kubeflow.org/v1/namespaces/default/pytorchjobs/llama-tiny"),
        ("POST", "/apis/kubeflow.org/v1/namespaces/default/pytorchjobs")]


def test_a_failed_create_rolls_back_what_was_created(kube, tmp_path):
    kube.route("post /apis/kubeflow.org/v1/namespaces/default/pytorchjobs",
               lambda: (_ for _ in ()).throw(RuntimeError("admission webhook denied the request")))
    r = job_cli(kube, "submit", str(write_spec(tmp_path)))
    assert r.returncode == 3
    assert len(r.stderr.strip().splitlines()) == 3  # two roll-back notices and the one-line error
    assert "creating PyTorchJob/llama-tiny: 500" in r.stderr
    assert [w for w in writes(kube) if w[0] == "DELETE"] == [
        ("DELETE", "/api/v1/namespaces/default/persistentvolumeclaims/llama-tiny-ckpt"),
        ("DELETE", "/api/v1/namespaces/default/secrets/llama-tiny-hf-token")]


def test_failed_job_is_resubmitted_within_its_budget_and_resumes(kube, tmp_path):
    assert job_cli(kube, "submit", str(write_spec(tmp_path, resubmits=1))).returncode == 0
    waiter = subprocess.Popen([sys.executable, "-m", "fsdpkit", "job", "wait", "llama-tiny", "--poll", "0.2"],
                              cwd=ROOT, env={**os.environ, **kube.env}, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True)
    set_conditions(kube, "llama-tiny", "Created", "Running", "Failed")

    def attempt():
        obj = kube.get_job("llama-tiny", PLURAL, GROUP, VERSION)
        return (None, None) if obj is None else (obj["metadata"]["annotations"]["fsdpkit.dev/attempt"],
                                                 obj.get("status"))

    deadline = time.monotonic() + 60
    while attempt()[0] != "1":
        assert time.monotonic() < deadline and waiter.poll() is None, waiter.communicate()
        time.sleep(0.2)
    assert attempt()[1] is None  # a fresh job, not the failed one patched
    job = [b for m, p, b in kube.requests() if m == "POST" and p.split("?")[0].endswith("/pytorchjobs")][-1]
    command = job["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]["containers"][0]["command"]
    assert command[command.index("--resume-from-checkpoint") + 1] == "auto"
    set_conditions(kube, "llama-tiny", "Created", "Running", "Failed")  # fails again: budget spent
    out, err = waiter.communicate(timeout=60)
    assert waiter.returncode == 1, err
    assert "resubmitting, attempt 1 of 1" in err
    assert "Failed, resubmission 1" in out


def test_unreachable_cluster_is_one_line(tmp_path):
    cfg = tmp_path / "kubeconfig"
    cfg.write_text("apiVersion: v1\nkind: Config\ncurrent-context: c\n"
                   "clusters: [{name: c, cluster: {server: 'http://127.0.0.1:9'}}]\n"
                   "contexts: [{name: c, context: {cluster: c, user: u}}]\nusers: [{name: u, user: {}}]\n")
    r = run_cli("job", "status", "nope", "--backend", "pytorchjob", env={"KUBECONFIG": str(cfg)}, timeout=120)
    assert r.returncode == 3
    assert r.stderr.startswith("error: finding which job kinds the cluster serves: cannot reach the Kubernetes API "
                               "at http://127.0.0.1:9")
    assert len(r.stderr.strip().splitlines()) == 1


def test_hyperpod_job_on_the_kubeflow_operator_carries_health_affinity_and_auto_resume(kube, tmp_path):
    spec = write_spec(tmp_path, backend="hyperpod", instance_type="ml.p5.48xlarge", namespace="kubeflow",
                      hyperpod={"operator": "kubeflow", "instance_group": "gpu-workers", "max_retry": 5})
    r = job_cli(kube, "submit", str(spec))
    assert r.returncode == 0, r.stderr
    job = [b for m, p, b in kube.requests() if m == "POST" and p.split("?")[0].endswith("/pytorchjobs")][-1]
    ann = job["metadata"]["annotations"]
    assert ann["sagemaker.amazonaws.com/enable-job-auto-resume"] == "true"
    assert ann["sagemaker.amazonaws.com/job-max-retry-count"] == "5"
    pod = job["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]
    required = pod["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    assert {"key": "sagemaker.amazonaws.com/node-health-status", "operator": "In", "values": ["Schedulable"]} \
        in required["nodeSelectorTerms"][0]["matchExpressions"]
    preferred = pod["affinity"]["nodeAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"]
    deep = preferred[0]["preference"]["matchExpressions"][0]
    assert deep["key"] == "sagemaker.amazonaws.com/deep-health-check-status"
    assert pod["nodeSelector"] == {"node.kubernetes.io/instance-type": "ml.p5.48xlarge",
                                   "sagemaker.amazonaws.com/instance-group-name": "gpu-workers"}
    r = job_cli(kube, "status", "llama-tiny", "-n", "kubeflow", "--json")
    assert json.loads(r.stdout)["data"]["backend"] == "pytorchjob"  # read back as the PyTorchJob it is


def test_hyperpod_training_operator_job_submit_status_logs_and_wait(kube, tmp_path):
    """The HyperPodPyTorchJob path: what is sent, and the operator's side played here (its pods carry
    fsdpkit's job label and HPJob; its conditions end in Completed)."""
    from kubernetes import client

    spec = write_spec(tmp_path, backend="hyperpod", instance_type="ml.p5.48xlarge", hyperpod={"max_retry": 5})
    r = job_cli(kube, "submit", str(spec), "--json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["data"]["created"][-1] == "HyperPodPyTorchJob/llama-tiny"
    job = [b for m, p, b in kube.requests() if m == "POST" and p.split("?")[0].endswith("/hyperpodpytorchjobs")][-1]
    policy = job["spec"]["runPolicy"]
    assert policy["jobMaxRetryCount"] == 5 and policy["restartPolicy"]["numRestartBeforeFullJobRestart"] == 3
    assert [rule["name"] for rule in policy["logMonitoringConfiguration"]] == [
        "fsdpkit-started", "fsdpkit-progress", "fsdpkit-loss"]
    assert job["spec"]["replicaSpecs"][0]["template"]["spec"]["containers"][0]["command"][0] == "hyperpodrun"
    api = client.CustomObjectsApi(kube.api())

    def conditions(*types):
        api.patch_namespaced_custom_object_status(
            "sagemaker.amazonaws.com", "v1", "default", "hyperpodpytorchjobs", "llama-tiny",
            {"status": {"conditions": [{"type": t, "status": "True", "lastTransitionTime": f"2026-11-24T10:00:0{i}Z"}
                                       for i, t in enumerate(types)]}})
    conditions("Created", "Running")
    r = job_cli(kube, "status", "llama-tiny", "--json")
    assert json.loads(r.stdout)["data"]["state"] == "Running" and json.loads(r.stdout)["data"]["backend"] == "hyperpod"
    for i in range(2):
        client.CoreV1Api(kube.api()).create_namespaced_pod("default", {
            "apiVersion": "v1", "kind": "Pod", "metadata": {
                "name": f"llama-tiny-pod-{i}", "namespace": "default",
                "labels": {"fsdpkit.dev/job": "llama-tiny", "HPJob": "llama-tiny"}},
            "spec": {"containers": [{"name": "pytorch", "image": "x"}]}, "status": {"phase": "Running"}})
        kube.route(f"get /api/v1/namespaces/default/pods/llama-tiny-pod-{i}/log", f"pod {i} line\n".encode())
    r = job_cli(kube, "logs", "llama-tiny")
    assert r.returncode == 0 and r.stdout.splitlines() == ["pod 0 line"]
    conditions("Created", "Running", "Completed")
    r = job_cli(kube, "wait", "llama-tiny", "--poll", "0.1", "--json")
    assert r.returncode == 0 and json.loads(r.stdout)["data"]["state"] == "Succeeded"


def test_network_check_reads_nccl_lines_from_the_logs(kube, tmp_path):
    assert job_cli(kube, "submit", str(write_spec(tmp_path, diagnose_network=True))).returncode == 0
    job = [b for m, p, b in kube.requests() if m == "POST" and p.split("?")[0].endswith("/pytorchjobs")][-1]
    env = job["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]["containers"][0]["env"]
    assert {"name": "NCCL_DEBUG", "value": "INFO"} in env
    make_pod(kube, "llama-tiny", "Master", 0)
    make_pod(kube, "llama-tiny", "Worker", 0)
    kube.route("get /api/v1/namespaces/default/pods/llama-tiny-master-0/log",
               b"NCCL INFO NET/OFI Selected provider is efa, fabric is efa-direct (found 32 nics)\n")
    kube.route("get /api/v1/namespaces/default/pods/llama-tiny-worker-0/log",
               b"NCCL INFO NET/Socket : Using [0]eth0:10.0.0.2<0>\n")
    r = job_cli(kube, "logs", "llama-tiny", "--check-network")
    assert r.returncode == 0 and "network check: pass" in r.stderr
    r = job_cli(kube, "logs", "llama-tiny", "--check-network", "--json")
    data = json.loads(r.stdout)["data"]
    assert data["network_check"]["verdict"] == "pass" and data["lines"][0].startswith("NCCL INFO NET/OFI")
    r = job_cli(kube, "logs", "llama-tiny", "--replica", "worker-0", "--check-network")
    assert r.returncode == 1 and "network check: fail: NCCL fell back to TCP sockets" in r.stderr


@pytest.mark.parametrize(("log", "code", "said"), [
    ("p5-efa.log", 0, "network check: pass: NCCL is using EFA through aws-ofi-nccl"),
    ("p5-ofi-tcp.log", 1, "network check: fail: NCCL went through aws-ofi-nccl over libfabric's tcp provider, not "
                          "efa: EFA is not in use"),
    ("p5-ofi-sockets.log", 1, "network check: fail: NCCL went through aws-ofi-nccl over libfabric's sockets provider"),
])
def test_the_network_check_passes_only_libfabric_s_efa_provider(kube, tmp_path, log, code, said):
    """NCCL says "Using network Libfabric" over any libfabric provider: only `efa` is EFA."""
    assert job_cli(kube, "submit", str(write_spec(tmp_path, diagnose_network=True))).returncode == 0
    make_pod(kube, "llama-tiny", "Master", 0)
    kube.route("get /api/v1/namespaces/default/pods/llama-tiny-master-0/log",
               (ROOT / "tests" / "data" / "nccl" / log).read_bytes())
    r = job_cli(kube, "logs", "llama-tiny", "--check-network")
    assert r.returncode == code and said in r.stderr, r.stderr
    r = job_cli(kube, "logs", "llama-tiny", "--check-network", "--json")
    envelope = json.loads(r.stdout)
    assert envelope["ok"] is (code == 0) and r.returncode == code
    assert envelope["data"]["network_check"]["verdict"] == ("pass" if code == 0 else "fail")


@pytest.mark.parametrize("dry_run", [False, True], ids=["submit", "dry-run"])
def test_a_gated_tokenizer_without_a_token_fails_at_submit(kube, tmp_path, dry_run):
    gated = {"preset": "tiny", "tokenizer": "meta-llama/Llama-3.1-8B", "vocab_size": 128256}
    spec = write_spec(tmp_path, hf_token_env=None, train=gated)
    r = job_cli(kube, "submit", str(spec), *(["--dry-run"] if dry_run else []))
    assert r.returncode == 2 and r.stderr.strip().splitlines() == [r.stderr.strip()]
    assert "'meta-llama/Llama-3.1-8B' is gated on the Hugging Face hub" in r.stderr
    assert "set hf_token_env: HF_TOKEN in the spec and export HF_TOKEN" in r.stderr
    assert "hf-internal-testing/Llama-3.1-8B-Instruct" in r.stderr   # the ungated copy, suggested
    assert writes(kube) == []
    # With the token exported in the submitting shell, the job goes ahead.
    spec = write_spec(tmp_path, train=gated)
    assert job_cli(kube, "submit", str(spec), "--dry-run").returncode == 0
    r = job_cli(kube, "submit", str(spec), "--dry-run", env={"MY_HF_TOKEN": ""})
    assert r.returncode == 2 and "export MY_HF_TOKEN in this shell" in r.stderr


def test_dry_run_and_a_missing_token_create_nothing(kube, tmp_path):
    spec = write_spec(tmp_path)
    r = job_cli(kube, "submit", str(spec), "--dry-run", "--json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["data"]["objects"] == ["Secret/llama-tiny-hf-token",
                                                       "PersistentVolumeClaim/llama-tiny-ckpt", "PyTorchJob/llama-tiny"]
    r = run_cli("job", "submit", str(spec), env=kube.env)  # MY_HF_TOKEN is not exported here
    assert r.returncode == 2
    assert r.stderr.strip() == ("error: hf_token_env: $MY_HF_TOKEN is not set in this shell; export it, or drop "
                                "hf_token_env for public models")
    assert writes(kube) == []


def test_missing_operator_crd_is_one_line_and_rolled_back(kube, tmp_path):
    kube.route("post /apis/kubeflow.org/v1/namespaces/default/pytorchjobs", 404)
    r = job_cli(kube, "submit", str(write_spec(tmp_path)))
    assert r.returncode == 3
    assert r.stderr.strip().splitlines()[-1].startswith(
        "error: creating PyTorchJob/llama-tiny: the API server does not know it")
    assert "Kubeflow training operator" in r.stderr
    assert [m for m, _ in writes(kube)].count("DELETE") == 2  # the Secret and the PVC it had created


JOBS_PATH = "/apis/kubeflow.org/v1/namespaces/default/pytorchjobs"
UNKNOWN_FIELD = 'PyTorchJob in version "v1" cannot be handled as a PyTorchJob: strict decoding error: unknown ' \
    'field "spec.runPolicy.ttlSecondsAfterFinished"'


def test_every_create_is_strict_and_an_unknown_field_is_named(kube, tmp_path):
    """A real API server prunes a field its CRD does not know unless the create asks for strict
    field validation; fsdpkit always asks, so an older operator refuses instead of running a job
    without what it was told."""
    import kmock

    assert job_cli(kube, "submit", str(write_spec(tmp_path))).returncode == 0
    posts = [p for m, p, _ in kube.requests() if m == "POST"]
    assert len(posts) == 3 and all("fieldValidation=Strict" in p for p in posts), posts

    # What an API server with an older PyTorchJob CRD answers.
    older_crd = kmock.KubernetesError(status=400, reason="BadRequest", message=UNKNOWN_FIELD)
    kube.route(("post " + JOBS_PATH, kmock.params(fieldValidation="Strict")), older_crd)
    r = job_cli(kube, "submit", str(write_spec(tmp_path, name="other")))
    assert r.returncode == 3
    assert r.stderr.strip().splitlines()[-1] == f"error: creating PyTorchJob/other: 400 {UNKNOWN_FIELD}"
    # What this submit made before the job was refused is gone again.
    assert [w for w in writes(kube) if w[0] == "DELETE"] == [
        ("DELETE", "/api/v1/namespaces/default/persistentvolumeclaims/other-ckpt"),
        ("DELETE", "/api/v1/namespaces/default/secrets/other-hf-token")]


def test_a_submit_waits_out_a_claim_still_being_deleted_instead_of_reusing_it(kube, tmp_path):
    """Right after a rolled-back submit its PVC is Terminating (pvc-protection holds it until no pod
    uses it): reused, it would vanish under the job. The submit waits, saying so, and creates it anew."""
    import threading

    from kubernetes import client

    kube.create("/api/v1/namespaces/default/persistentvolumeclaims", {
        "apiVersion": "v1", "kind": "PersistentVolumeClaim",
        "metadata": {"name": "llama-tiny-ckpt", "namespace": "default", "deletionTimestamp": "2026-11-27T10:00:00Z",
                     "finalizers": ["kubernetes.io/pvc-protection"],
                     "labels": {"app.kubernetes.io/managed-by": "fsdpkit", "fsdpkit.dev/job": "llama-tiny"}},
        "spec": {"accessModes": ["ReadWriteMany"], "resources": {"requests": {"storage": "1200Gi"}}}})
    # The pvc-protection controller drops its finalizer once the last pod is gone, 2.5 s from now, and
    # the API server removes the claim.
    gone = threading.Timer(2.5, lambda: client.CoreV1Api(kube.api()).patch_namespaced_persistent_volume_claim(
        "llama-tiny-ckpt", "default", {"metadata": {"finalizers": None}}))
    gone.start()
    r = job_cli(kube, "submit", str(write_spec(tmp_path)), "--json")
    gone.join()
    assert r.returncode == 0, r.stdout
    data = json.loads(r.stdout)["data"]
    assert data["created"][1] == "PersistentVolumeClaim/llama-tiny-ckpt" and data["reused"] == []
    waits = [line for line in r.stderr.splitlines() if line.startswith("waiting for PersistentVolumeClaim")]
    assert waits == ["waiting for PersistentVolumeClaim/llama-tiny-ckpt to finish deleting (0 s of 120); a claim "
                     "being deleted cannot hold this job's checkpoints"]
    claim = client.CoreV1Api(kube.api()).read_namespaced_persistent_volume_claim("llama-tiny-ckpt", "default")
    assert claim.metadata.deletion_timestamp is None


def test_a_server_dry_run_has_the_api_server_check_every_object_and_stores_nothing(kube, tmp_path):
    spec = write_spec(tmp_path)
    r = job_cli(kube, "submit", str(spec), "--dry-run=server", "--json")
    assert r.returncode == 0, r.stderr
    data = json.loads(r.stdout)["data"]
    kinds = ["Secret/llama-tiny-hf-token", "PersistentVolumeClaim/llama-tiny-ckpt", "PyTorchJob/llama-tiny"]
    pods = ["Pod/llama-tiny-master-0", "Pod/llama-tiny-worker-0"]   # one of each replica type, after the job
    assert data["dry_run"] == "server" and data["accepted"] == kinds + pods
    assert [p for p, _ in kube.dry_runs] == [
        "/api/v1/namespaces/default/secrets?dryRun=All&fieldValidation=Strict",
        "/api/v1/namespaces/default/persistentvolumeclaims?dryRun=All&fieldValidation=Strict",
        JOBS_PATH + "?dryRun=All&fieldValidation=Strict",
        *["/api/v1/namespaces/default/pods?dryRun=All&fieldValidation=Strict"] * 2]
    assert TOKEN not in json.dumps(kube.dry_runs) and TOKEN not in r.stdout   # the Secret went with its placeholder
    assert writes(kube) == [] and kube.get_job("llama-tiny") is None
    # The server refuses a field its CRD does not know: one line, exit 3, nothing made.
    kube.refuse = lambda path, body: UNKNOWN_FIELD if path == JOBS_PATH else None
    r = job_cli(kube, "submit", str(spec), "--dry-run=server")
    assert (r.returncode, r.stderr) == (3, f"error: server dry run of PyTorchJob/llama-tiny: 400 {UNKNOWN_FIELD}\n")
    assert writes(kube) == []
    # A client dry run asks no server; `-o yaml` prints what would be created, as kubectl would read it.
    r = job_cli(kube, "submit", str(spec), "--dry-run", "-o", "yaml")
    assert r.returncode == 0, r.stderr
    assert [f"{o['kind']}/{o['metadata']['name']}" for o in yaml.safe_load_all(r.stdout)] == kinds
    assert len(kube.dry_runs) == 8 and writes(kube) == []   # 5 and 3 from the two server dry runs
    # No API server behind the local backend to ask.
    # What a submit would reuse or replace is not sent; a job that exists is refused as a real submit refuses it.
    kube.refuse = None
    assert job_cli(kube, "submit", str(spec)).returncode == 0
    r = job_cli(kube, "submit", str(spec), "--dry-run=server", "--json")
    assert r.returncode == 2 and json.loads(r.stdout)["error"]["code"] == "conflict"
    r = job_cli(kube, "submit", str(spec), "--dry-run=server", "--replace", "--json")
    data = json.loads(r.stdout)["data"]
    assert r.returncode == 0 and data["existing"] == kinds and data["accepted"] == pods
    r = job_cli(kube, "submit", str(spec), "--set", "backend=local", "--set", "nodes=1", "--set",
                "instance_type=", "--dry-run=server")
    assert (r.returncode, r.stderr) == (2, "error: --dry-run=server: the local backend has no API server to ask; "
                                           "use --dry-run\n")


FIRST_POD = {"pytorchjob": ("PyTorchJob", "master"), "trainjob": ("TrainJob", "node"),
             "hyperpod": ("HyperPodPyTorchJob", "pod")}


@pytest.mark.parametrize("backend", ["pytorchjob", "trainjob", "hyperpod"])
def test_a_server_dry_run_sends_the_operator_s_pods_through_admission_and_stores_nothing(kube, tmp_path, backend):
    """The job object passes admission that its pods do not: a server dry run also creates one Pod of
    each kind the operator will make (dryRun=All), so a PriorityClass that does not exist and a
    namespace that enforces Pod Security's restricted level refuse now, in one line naming the pod,
    the admission and its rule, with nothing stored. `security: restricted` pods pass."""
    kind, replica = FIRST_POD[backend]
    pod = f"llama-tiny-{replica}-0"
    instance = "ml.p5.48xlarge" if backend == "hyperpod" else "p5.48xlarge"
    where = {"pytorchjob": "Master", "trainjob": "node", "hyperpod": "pod"}[backend]
    prefix = f"error: server dry run of Pod/{pod} (a pod of {kind} llama-tiny: {where}): refused by "
    kube.pod_admission = PodAdmission(priority_classes={"training"})
    if backend != "trainjob":  # a TrainJob's pods take no priorityClassName (Kueue's label orders it)
        spec = write_spec(tmp_path, backend=backend, instance_type=instance, priority_class="high")
        r = job_cli(kube, "submit", str(spec), "--dry-run=server")
        assert (r.returncode, r.stderr) == (3, prefix + "the Priority admission plugin: priorityClassName high: no "
                                            "such PriorityClass; pick one of `kubectl get priorityclasses`, or drop "
                                            "priority_class; with a queue, priority_class names a Kueue "
                                            "WorkloadPriorityClass\n")
    # The namespace enforces restricted; fsdpkit's default pods meet baseline only.
    kube.pod_admission.enforce["default"] = "restricted"
    spec = write_spec(tmp_path, backend=backend, instance_type=instance, priority_class="training")
    r = job_cli(kube, "submit", str(spec), "--dry-run=server", "--json")
    assert r.returncode == 3
    error = json.loads(r.stdout)["error"]
    container = {"pytorchjob": "pytorch", "trainjob": "node", "hyperpod": "pytorch"}[backend]
    assert error["code"] == "refused"
    assert "error: " + error["message"] + "\n" == prefix + (
        'Pod Security admission (the namespace enforces "restricted:latest"): unrestricted capabilities (container '
        f'"{container}" must set securityContext.capabilities.drop=["ALL"]), runAsNonRoot != true (pod or container '
        f'"{container}" must set securityContext.runAsNonRoot=true), seccompProfile (pod or container "{container}" '
        'must set securityContext.seccompProfile.type to "RuntimeDefault" or "Localhost"); set `security: '
        "restricted` in the spec (an image that runs as a user other than root), or ask the cluster's admin for a "
        "namespace at the baseline level\n")
    # At the restricted level every pod of the job is admitted; the objects were checked first, and
    # nothing of either run was stored.
    spec = write_spec(tmp_path, backend=backend, instance_type=instance, priority_class="training",
                      security="restricted")
    r = job_cli(kube, "submit", str(spec), "--dry-run=server", "--json")
    assert r.returncode == 0, r.stdout
    accepted = json.loads(r.stdout)["data"]["accepted"]
    pods = {"pytorchjob": [pod, "llama-tiny-worker-0"]}.get(backend, [pod])
    assert accepted == ["Secret/llama-tiny-hf-token", "PersistentVolumeClaim/llama-tiny-ckpt", f"{kind}/llama-tiny",
                        *(f"Pod/{p}" for p in pods)]
    sent = [(path, body) for path, body in kube.dry_runs if path.startswith("/api/v1/namespaces/default/pods?")]
    assert [b["metadata"]["name"] for _, b in sent][-len(pods):] == pods
    assert all(path == "/api/v1/namespaces/default/pods?dryRun=All&fieldValidation=Strict" for path, _ in sent)
    assert writes(kube) == [] and kube.get_job("llama-tiny") is None
    from kubernetes import client

    assert client.CoreV1Api(kube.api()).list_namespaced_pod("default").items == []


# Each admission a pod meets, set up as the cluster's admin would, and the words of its refusal.
REFUSING = {
    "priority": (lambda a: a.priority_classes.clear(), {"priority_class": "high"},
                 "refused by the Priority admission plugin: priorityClassName high: no such PriorityClass"),
    "pod-security": (lambda a: a.enforce.update(default="restricted"), {},
                     'refused by Pod Security admission (the namespace enforces "restricted:latest"): '),
    "quota-limits": (lambda a: a.quotas.update(default={"team": {"limits.cpu": "1000"}}), {},
                     "refused by ResourceQuota admission: failed quota: team: must specify limits.cpu for: pytorch; "
                     "ask the cluster's admin for a LimitRange default CPU limit"),
    "limit-range": (lambda a: a.default_limits.update(default={"cpu": "4"}), {"cpu": "96"},
                    'refused by LimitRange admission (its default limit): resources.requests: Invalid value: "96": '
                    "must be less than or equal to cpu limit of 4; the namespace's LimitRange gives containers "
                    "without a cpu limit a default one below this request"),
}


@pytest.mark.parametrize("admission", list(REFUSING))
def test_a_real_submit_sends_the_pods_through_admission_first_and_creates_nothing_it_refuses(kube, tmp_path,
                                                                                             admission):
    """A real submit, not only --dry-run=server: each pod the operator will make meets the cluster's
    admission (dryRun=All) before the job exists. Refused, it is one line naming the admission and
    its rule, exit 3, with nothing created (the operator would otherwise be left unable to make the
    pods, saying so only in events on a job said to be submitted)."""
    setup, fields, says = REFUSING[admission]
    kube.pod_admission = PodAdmission()
    setup(kube.pod_admission)
    spec = write_spec(tmp_path, **fields)
    r = job_cli(kube, "submit", str(spec))
    assert r.returncode == 3 and r.stdout == "", r.stdout
    [line] = r.stderr.splitlines()
    assert line.startswith("error: server dry run of Pod/llama-tiny-master-0 (a pod of PyTorchJob llama-tiny: "
                           f"Master): {says}"), line
    assert writes(kube) == [] and kube.get_job("llama-tiny") is None
    kube.pod_admission = PodAdmission(priority_classes={"high"})   # admitted: the same submit creates the job
    r = job_cli(kube, "submit", str(spec))
    assert r.returncode == 0, r.stderr
    assert kube.get_job("llama-tiny") is not None


def quota(kube, hard, used):
    """A ResourceQuota as the quota controller keeps it: its hard limits, and in its status what the
    namespace's pods use."""
    kube.create("/api/v1/namespaces/default/resourcequotas", {
        "apiVersion": "v1", "kind": "ResourceQuota", "metadata": {"name": "gpus", "namespace": "default"},
        "spec": {"hard": hard}, "status": {"hard": hard, "used": used}})
    kube.pod_admission = PodAdmission(quotas={"default": {"gpus": hard}}, used={"default": {"gpus": used}})


@pytest.mark.parametrize("dry_run", [[], ["--dry-run=server"]], ids=["submit", "dry-run-server"])
def test_a_job_over_its_quota_in_total_is_refused_before_anything_is_created(kube, tmp_path, dry_run):
    """4 pods of 8 GPUs against a quota of 16: each pod alone passes the quota's admission (8 of 16),
    so a dry run of one pod of each kind once said yes; the job's pods in all are held to it first."""
    quota(kube, {"requests.nvidia.com/gpu": "16"}, {"requests.nvidia.com/gpu": "0"})
    spec = write_spec(tmp_path, nodes=4)
    r = job_cli(kube, "submit", str(spec), *dry_run)
    assert (r.returncode, r.stdout) == (3, "")
    assert r.stderr.splitlines() == [
        "error: ResourceQuota gpus: the job's 4 pods ask for requests.nvidia.com/gpu 32 in all, over its hard limit "
        "of 16: it can never run in this namespace; ask for less (nodes, gpus_per_node) or for the quota to be "
        "raised; nothing was created"]
    # A TrainJob's pods are its numNodes, each its trainer's resources.
    r = job_cli(kube, "submit", str(write_spec(tmp_path, nodes=4, backend="trainjob")), *dry_run)
    assert r.returncode == 3 and r.stderr.startswith(
        "error: ResourceQuota gpus: the job's 4 pods ask for requests.nvidia.com/gpu 32 in all, over its hard limit "
        "of 16"), r.stderr
    # Two nodes fit the quota, but not beside what other pods use now.
    spec = write_spec(tmp_path, nodes=2)
    from kubernetes import client

    client.CoreV1Api(kube.api()).patch_namespaced_resource_quota_status(
        "gpus", "default", {"status": {"used": {"requests.nvidia.com/gpu": "12"}}})
    r = job_cli(kube, "submit", str(spec), *dry_run)
    assert r.returncode == 3 and r.stderr.splitlines() == [
        "error: ResourceQuota gpus: the job's 2 pods ask for requests.nvidia.com/gpu 16 in all, and 4 of 16 is left "
        "(12 in use); ask for less (nodes, gpus_per_node) or for the quota to be raised; nothing was created"]
    # Nothing of the job sent, not even as a dry run: only the quota controller's own writes.
    assert [w for w in writes(kube) if "/resourcequotas" not in w[1]] == [], writes(kube)
    assert kube.dry_runs == [] and kube.get_job("llama-tiny") is None


LOCALQUEUES = "/apis/kueue.x-k8s.io/v1beta2/namespaces/default/localqueues"


def test_a_named_queue_must_exist_and_orders_the_job_by_kueue_s_priority_label(kube, tmp_path):
    """A job on a LocalQueue that does not exist is created and never admitted; fsdpkit refuses it
    first, in one line, with nothing made. On a queue that exists, the priority is Kueue's label (a
    WorkloadPriorityClass), never a priorityClassName the Priority plugin would refuse. A user who may
    not read LocalQueues is told the queue went unchecked; a cluster without Kueue is named."""
    kube.pod_admission = PodAdmission()   # no PriorityClass "urgent": only Kueue's label may carry it
    spec = write_spec(tmp_path, queue="team-a", priority_class="urgent")
    # A cluster without Kueue.
    kube.forget("kueue.x-k8s.io/v1beta2/localqueues")
    r = job_cli(kube, "submit", str(spec), "--dry-run=server")
    assert (r.returncode, r.stderr) == (3, "error: queue: team-a: this cluster has no Kueue (no kueue.x-k8s.io "
                                           "API); install Kueue, or drop queue\n")
    kube.serve("kueue.x-k8s.io/v1beta2/localqueues")
    for args in ([], ["--dry-run=server"]):
        r = job_cli(kube, "submit", str(spec), *args)
        assert (r.returncode, r.stderr) == (3, "error: queue: no Kueue LocalQueue 'team-a' in namespace default; pick "
                                               "one of `kubectl get localqueues -n default`\n")
    assert writes(kube) == []
    kube.create(LOCALQUEUES, {"apiVersion": "kueue.x-k8s.io/v1beta2", "kind": "LocalQueue",
                              "metadata": {"name": "team-a", "namespace": "default"},
                              "spec": {"clusterQueue": "cluster-queue"}})
    r = job_cli(kube, "submit", str(spec), "--dry-run=server", "--json")
    assert r.returncode == 0, r.stdout
    kueue = Kueue(kube, lambda job: (True, "QuotaReserved", "Quota reserved in ClusterQueue cluster-queue"))
    r = job_cli(kube, "submit", str(spec))
    assert r.returncode == 0, r.stderr
    job = kube.get_job("llama-tiny")
    labels = {k: v for k, v in job["metadata"]["labels"].items() if k.startswith("kueue.")}
    assert labels == {"kueue.x-k8s.io/queue-name": "team-a", "kueue.x-k8s.io/priority-class": "urgent"}
    pods = [r["template"]["spec"] for r in job["spec"]["pytorchReplicaSpecs"].values()]
    assert [p.get("priorityClassName") for p in pods] == [None, None]
    assert "schedulingPolicy" not in job["spec"]["runPolicy"]
    # A namespace user bound to the Role `fsdpkit cluster rbac` renders: it grants reading LocalQueues,
    # so the queue is checked; a Role without that read is told the queue went unchecked.
    assert job_cli(kube, "delete", "llama-tiny", "--yes").returncode == 0
    rules = role_rules([("kubeflow.org", "pytorchjobs")])
    r = job_cli(kube, "submit", str(spec), env=kube.user("team-a-ci", rules))
    assert r.returncode == 0 and "not checked" not in r.stderr, r.stderr
    assert job_cli(kube, "delete", "llama-tiny", "--yes").returncode == 0
    without = [rule for rule in rules if rule["resources"] != ["localqueues"]]
    r = job_cli(kube, "submit", str(spec), env=kube.user("team-a-ci", without))
    assert r.returncode == 0, r.stderr
    assert ("warning: queue 'team-a' not checked: localqueues.kueue.x-k8s.io \"team-a\" is forbidden: User "
            '"team-a-ci" cannot get resource "localqueues" in API group "kueue.x-k8s.io" in the namespace '
            '"default"') in r.stderr
    kueue.close()


PT_ROLE = [{"apiGroups": ["kubeflow.org"], "resources": ["pytorchjobs"], "verbs": ["get", "list"]},
           {"apiGroups": [""], "resources": ["pods", "pods/log"], "verbs": ["get", "list"]}]


def test_job_list_never_says_no_jobs_for_an_error(kube, tmp_path):
    """Unreachable, or every kind refused: exit 3, ok false, the local jobs still listed. One kind
    refused and another readable: those jobs, the refused kind named, exit 0. No kubeconfig: a note."""
    home = {"FSDPKIT_HOME": str(tmp_path / "home")}
    local = tmp_path / "home" / "jobs" / "local-one"   # a finished local job, as `job submit` leaves it
    local.mkdir(parents=True)
    (local / "spec.json").write_text(json.dumps({"name": "local-one", "backend": "local"}))
    (local / "rc").write_text("0")
    assert job_cli(kube, "submit", str(write_spec(tmp_path))).returncode == 0

    down = tmp_path / "down"
    down.write_text(kube.kubeconfig.read_text().replace(kube.url, "http://127.0.0.1:9"))
    for env, why in (({"KUBECONFIG": str(down)}, "cannot reach the Kubernetes API at http://127.0.0.1:9"),
                     (kube.user("system:serviceaccount:default:nobody", []), "every job kind it serves was refused")):
        r = job_cli(kube, "list", env={**env, **home})
        assert r.returncode == 3 and "no jobs" not in r.stdout
        assert r.stdout.split()[0] == "local-one" and why in r.stderr
        envelope = json.loads(job_cli(kube, "list", "--json", env={**env, **home}).stdout)
        assert envelope["ok"] is False and why in envelope["error"]["message"]
        assert envelope["error"]["code"] == ("unreachable" if "reach" in why else "access_denied")
        assert [j["name"] for j in envelope["data"]["jobs"]] == ["local-one"]

    env = {**kube.user("system:serviceaccount:default:pt-user", PT_ROLE), **home}
    r = job_cli(kube, "list", env=env)
    assert r.returncode == 0 and [line.split()[0] for line in r.stdout.splitlines()] == ["local-one", "llama-tiny"]
    assert ('warning: trainjobs.trainer.kubeflow.org not listed: trainjobs.trainer.kubeflow.org is forbidden: User '
            '"system:serviceaccount:default:pt-user" cannot list resource "trainjobs" in API group '
            '"trainer.kubeflow.org" in the namespace "default"') in r.stderr.splitlines()
    envelope = json.loads(job_cli(kube, "list", "--json", env=env).stdout)
    assert envelope["ok"] is True and sorted(envelope["data"]["unread"]) == [
        "hyperpodpytorchjobs.sagemaker.amazonaws.com", "trainjobs.trainer.kubeflow.org"]
    # The same user reads its PyTorchJob with every read verb: the kinds it may not read are not the job's.
    assert job_cli(kube, "status", "llama-tiny", env=env).returncode == 0
    assert job_cli(kube, "wait", "llama-tiny", "--timeout", "0.1", env=env).returncode == 124

    no_config = {"KUBECONFIG": str(tmp_path / "absent"), **home}
    r = job_cli(kube, "list", env=no_config)
    assert r.returncode == 0 and r.stdout.split()[0] == "local-one" and "note: cluster jobs not listed" in r.stderr


def test_a_node_that_stopped_answering_is_named_and_the_rest_of_the_status_kept(kube, tmp_path):
    """The pod still Running on a node whose kubelet no longer answers: the API server answers its
    log with the kubelet's dial error (500), the node's Ready condition is Unknown."""
    from kubernetes import client

    assert job_cli(kube, "submit", str(write_spec(tmp_path))).returncode == 0
    set_conditions(kube, "llama-tiny", "Created", "Running")
    core = client.CoreV1Api(kube.api())
    since = "2026-11-27T09:58:00Z"
    for node, ready in (("gpu-a", {"status": "True"}),
                        ("gpu-b", {"status": "Unknown", "reason": "NodeStatusUnknown",
                                   "message": "Kubelet stopped posting node status.", "lastTransitionTime": since})):
        kube.create("/api/v1/nodes", {"apiVersion": "v1", "kind": "Node", "metadata": {"name": node},
                                      "status": {"conditions": [{"type": "Ready", **ready}]}})
    for rtype, node in (("Master", "gpu-b"), ("Worker", "gpu-a")):
        name = make_pod(kube, "llama-tiny", rtype, 0)
        core.patch_namespaced_pod(name, "default", {"spec": {"nodeName": node}})
    dial = ('Get "https://10.0.1.5:10250/containerLogs/default/llama-tiny-master-0/pytorch": dial tcp '
            '10.0.1.5:10250: connect: connection refused')
    kube.route("get /api/v1/namespaces/default/pods/llama-tiny-master-0/log",
               kmock_status(500, dial))
    for args in (["status", "llama-tiny"], ["watch", "llama-tiny", "--once", "--no-sample"]):
        r = job_cli(kube, *args)
        assert r.returncode == 0, r.stderr
        node_line = ("  node gpu-b since 2026-11-27T09:58:00Z: not ready (Ready=Unknown: Kubelet stopped posting "
                     "node status.); its pods: llama-tiny-master-0")
        assert node_line in r.stdout.splitlines(), r.stdout
        assert "llama-tiny-worker-0 Running on gpu-a" in r.stdout
    r = job_cli(kube, "status", "llama-tiny", "--json")
    data = json.loads(r.stdout)["data"]
    assert r.returncode == 0 and data["state"] == "Running"
    assert data["details"]["unreachable"] == [{"node": "gpu-b", "since": since, "pods": ["llama-tiny-master-0"],
                                               "detail": "not ready (Ready=Unknown: Kubelet stopped posting node "
                                                         "status.)"}]
    assert [(p["name"], p["phase"], p["node"]) for p in data["details"]["pods"]] == [
        ("llama-tiny-master-0", "Running", "gpu-b"), ("llama-tiny-worker-0", "Running", "gpu-a")]

    # A user who may not read nodes (cluster-scoped) still hears of it: from the kubelet's silence.
    env = kube.user("system:serviceaccount:default:pt-user", PT_ROLE)
    r = job_cli(kube, "status", "llama-tiny", "--json", env=env)
    data = json.loads(r.stdout)["data"]
    assert r.returncode == 0 and data["details"]["unreachable"] == [
        {"node": "gpu-b", "since": None, "pods": ["llama-tiny-master-0"], "detail": f"kubelet unreachable: {dial}"}]
    assert 'cannot get resource "nodes" in API group "" at the cluster scope' in data["details"]["gaps"]["nodes"]


def kmock_status(code, message):
    """A payload kmock answers with: the API server's Status body for a failure it relays."""
    import kmock

    return kmock.Response(status=code, payload={"kind": "Status", "apiVersion": "v1", "metadata": {},
                                               "status": "Failure", "message": message, "code": code})


# Llama 3.1 8B's projections per layer: q and o 4096 x 4096, k and v 1024 x 4096, three 14336 x 4096.
PROJECTION_ELEMENTS = 2 * 4096 * 4096 + 2 * 1024 * 4096 + 3 * 14336 * 4096


@pytest.mark.parametrize("adapters", ["", "lora", "qlora"], ids=["full", "lora", "qlora"])
def test_a_dpo_job_renders_plans_its_reference_and_submits_as_a_dry_run(kube, tmp_path, adapters):
    """A preference-tuning job as a cluster runs it: the pods' command carries the objective, the plan
    counts the reference (a frozen copy without LoRA, nothing with it) and submit's dry run passes.
    With QLoRA the plan holds the base's projections at NF4's bytes."""
    lora = bool(adapters)
    train = {"preset": "llama3_1_8b", "max_steps": 50, "seq_len": 4096, "train_batch_size": 1,
             "activation_checkpointing": "full", "dataset": "/fsx/prefs",
             **({"lora": True, "init_from_hf": "/fsx/llama"} if lora else {}),
             **({"base_dtype": "nf4"} if adapters == "qlora" else {})}
    sft = write_spec(tmp_path, train=train)
    sft_plan = json.loads(run_cli("plan", str(sft), "--json").stdout)["data"]
    spec = write_spec(tmp_path, train={**train, "objective": "dpo", "data_format": "preference", "dpo_beta": 0.2})
    render = run_cli("job", "render", str(spec))
    assert render.returncode == 0, render.stderr
    pod = next(d for d in yaml.safe_load_all(render.stdout) if d["kind"] == "PyTorchJob")
    command = pod["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]["containers"][0]["command"]
    flags = dict(itertools.pairwise(command))
    assert (flags["--objective"], flags["--data-format"], flags["--dpo-beta"]) == ("dpo", "preference", "0.2")
    assert flags.get("--base-dtype") == ("nf4" if adapters == "qlora" else None)
    plan = json.loads(run_cli("plan", str(spec), "--json").stdout)["data"]
    memory, before = plan["memory_gib"], sft_plan["memory_gib"]
    assert plan["objective"]["name"] == "dpo" and plan["objective"]["beta"] == 0.2
    if lora:
        assert memory["params"] == before["params"]
        assert plan["objective"]["reference"] == "the base with its LoRA adapters off (no copy)"
    else:
        assert memory["params"] == pytest.approx(2 * before["params"], abs=0.01)
        assert plan["objective"]["reference"] == "a frozen copy of the model (its shards count in params)"
    # Full activation checkpointing: 4/3 of a step's FLOPs; the reference's forward a third more.
    assert plan["activation_checkpointing"] == "full"
    assert plan["compute_s"] == pytest.approx(sft_plan["compute_s"] * 5 / 4, abs=1e-3)
    r = job_cli(kube, "submit", str(spec), "--dry-run")
    assert r.returncode == 0, r.stderr
    assert writes(kube) == []
    if adapters == "qlora":
        # Against the same job with LoRA over an fp32 base: each rank's share of the 32 layers'
        # projections (16 ranks) at 0.516 bytes instead of 4.
        lora_plan = json.loads(run_cli("plan", str(write_spec(tmp_path, train={
            **train, "base_dtype": "auto", "objective": "dpo", "data_format": "preference"})), "--json").stdout)["data"]
        saved = 32 * PROJECTION_ELEMENTS // 16 * (4 - (0.5 + 1 / 64 + 4 / 16384)) / 2**30
        assert saved == pytest.approx(1.4154, abs=1e-4)
        assert memory["params"] == pytest.approx(lora_plan["memory_gib"]["params"] - saved, abs=0.01)
        assert plan["adapters"]["base_dtype"] == "nf4" and "projections in nf4 (0.516 bytes a parameter)" in \
            plan["adapters"]["explanation"]


DEVICECLASSES = "/apis/resource.k8s.io/v1/deviceclasses"


def test_submit_asks_the_cluster_for_dra_and_claims_gpus_with_their_efa_where_it_has_the_drivers(kube, tmp_path):
    """devices auto: a cluster without DRA's API, or without the drivers' DeviceClasses, gets
    extended resources, said in one line; once NVIDIA's and AWS's EFA DRA drivers have installed
    theirs, the same spec's pods claim their devices from a ResourceClaimTemplate created before the
    job, which `job delete` removes with it. A namespace user, who may not read the cluster-scoped
    DeviceClasses, is told so and gets extended resources."""
    from kubernetes import client

    spec = write_spec(tmp_path, hf_token_env=None, storage={"claim": "fsx-claim"})
    kube.forget("resource.k8s.io/v1/deviceclasses")
    r = job_cli(kube, "submit", str(spec))
    assert r.returncode == 0, r.stderr
    assert "devices:" not in r.stderr   # nothing to choose: extended resources, as on every cluster before DRA
    assert "nvidia.com/gpu" in kube.get_job("llama-tiny")["spec"]["pytorchReplicaSpecs"]["Master"]["template"][
        "spec"]["containers"][0]["resources"]["limits"]
    assert job_cli(kube, "delete", "llama-tiny", "--yes").returncode == 0
    for resource in ("deviceclasses", "resourceclaimtemplates"):
        kube.serve(f"resource.k8s.io/v1/{resource}")
    kube.create(DEVICECLASSES, {"apiVersion": "resource.k8s.io/v1", "kind": "DeviceClass",
                                "metadata": {"name": "gpu.nvidia.com"},
                                "spec": {"selectors": [{"cel": {"expression": "device.driver == 'gpu.nvidia.com'"}}]}})
    r = job_cli(kube, "submit", str(spec))
    assert "devices: extended resources (it has no DeviceClass efa.networking.k8s.aws (AWS's EFA DRA driver, " \
           "aws-dranet installs it))" in r.stderr
    assert job_cli(kube, "delete", "llama-tiny", "--yes").returncode == 0
    kube.create(DEVICECLASSES, {"apiVersion": "resource.k8s.io/v1", "kind": "DeviceClass",
                                "metadata": {"name": "efa.networking.k8s.aws"},
                                "spec": {"selectors": [{"cel": {"expression": "device.driver == 'dra.net'"}}]}})
    since = kube.request_count()
    r = job_cli(kube, "submit", str(spec))
    assert r.returncode == 0, r.stderr
    assert "devices: DRA claims (the cluster serves resource.k8s.io/v1 with DeviceClass gpu.nvidia.com and " \
           "efa.networking.k8s.aws)" in r.stderr
    posts = [(p.split("?")[0], body) for m, p, body in kube.requests(since) if m == "POST"]
    assert [p for p, _ in posts] == ["/apis/resource.k8s.io/v1/namespaces/default/resourceclaimtemplates",
                                     "/apis/kubeflow.org/v1/namespaces/default/pytorchjobs"]
    template, job = posts[0][1], posts[1][1]
    assert template["metadata"]["name"] == "llama-tiny-devices"
    assert len(template["spec"]["spec"]["devices"]["constraints"]) == 8
    for replica in job["spec"]["pytorchReplicaSpecs"].values():
        pod = replica["template"]["spec"]
        assert pod["resourceClaims"] == [{"name": "devices", "resourceClaimTemplateName": "llama-tiny-devices"}]
        assert "nvidia.com/gpu" not in pod["containers"][0]["resources"].get("limits", {})
    r = job_cli(kube, "delete", "llama-tiny", "--yes")
    assert r.returncode == 0, r.stderr
    assert [p for m, p in writes(kube) if m == "DELETE"][-2:] == [
        "/apis/kubeflow.org/v1/namespaces/default/pytorchjobs/llama-tiny",
        "/apis/resource.k8s.io/v1/namespaces/default/resourceclaimtemplates/llama-tiny-devices"]
    assert client.CustomObjectsApi(kube.api()).list_namespaced_custom_object(
        "resource.k8s.io", "v1", "default", "resourceclaimtemplates")["items"] == []
    # A team's user, bound to the Role `fsdpkit cluster rbac` renders: no cluster-wide reads.
    user = kube.user("team-a-ci", role_rules([("kubeflow.org", "pytorchjobs")]))
    r = job_cli(kube, "submit", str(spec), env=user)
    assert r.returncode == 0, r.stderr
    refusal = ('its DeviceClasses could not be read (deviceclasses.resource.k8s.io is forbidden: User "team-a-ci" '
               'cannot list resource "deviceclasses" in API group "resource.k8s.io" at the cluster scope)')
    assert f"devices: extended resources ({refusal}; set devices: dra where the cluster has the drivers)" in r.stderr
    # ... who knows the drivers are there says devices: dra, and the Role lets it make the claim template.
    r = job_cli(kube, "submit", str(write_spec(tmp_path, name="other", devices="dra", storage={"claim": "c"})),
                env=user)
    assert r.returncode == 0, r.stderr
    assert f"devices: DRA claims (given (devices: dra); not checked: {refusal})" in r.stderr
    assert writes(kube)[-2:] == [("POST", "/apis/resource.k8s.io/v1/namespaces/default/resourceclaimtemplates"),
                                 ("POST", "/apis/kubeflow.org/v1/namespaces/default/pytorchjobs")]
    r = job_cli(kube, "delete", "other", "--yes", env=user)
    assert r.returncode == 0, r.stderr
    assert writes(kube)[-3:] == [
        ("DELETE", "/apis/kubeflow.org/v1/namespaces/default/pytorchjobs/other"),
        ("DELETE", "/apis/resource.k8s.io/v1/namespaces/default/resourceclaimtemplates/other-devices"),
        ("DELETE", "/api/v1/namespaces/default/secrets/other-hf-token")]
    # devices: dra on a cluster that has no DRA at all is refused before anything is made.
    kube.forget("resource.k8s.io/v1/deviceclasses")
    before = writes(kube)
    r = job_cli(kube, "submit", str(write_spec(tmp_path, name="other", devices="dra", storage={"claim": "c"})))
    assert (r.returncode, r.stderr) == (2, "error: devices: dra, but the cluster does not serve resource.k8s.io/v1 "
                                           "(Kubernetes 1.34 or later); install it, or set devices: extended\n")
    assert writes(kube) == before


def test_a_job_over_its_team_s_quota_is_told_so_at_submit_in_kueue_s_words(kube, tmp_path):
    """Submit on a LocalQueue reads Kueue's verdict from the job's Workload (kmock playing Kueue's
    controller, its conditions as Kueue writes them): a job over what its ClusterQueue could ever
    have (nominal plus borrowing) is refused in one line naming the queue, the ClusterQueue, the
    resource, the flavor and the amounts, and the job is taken back; one waiting for quota in use is
    kept and said; an admitted one is quiet. Pinned: the verdict is Kueue's message, not a guess."""
    kube.create(LOCALQUEUES, {"apiVersion": "kueue.x-k8s.io/v1beta2", "kind": "LocalQueue",
                              "metadata": {"name": "hyperpod-ns-team-a-localqueue", "namespace": "default"},
                              "spec": {"clusterQueue": "hyperpod-ns-team-a-clusterqueue"}})
    spec = write_spec(tmp_path, hf_token_env=None, queue="hyperpod-ns-team-a-localqueue")
    never = ("couldn't assign flavors to pod set worker: insufficient quota for nvidia.com/gpu in flavor p5-reserved, "
             "previously considered podsets requests (8) + current podset request (8) > maximum capacity (8)")
    kueue = Kueue(kube, lambda job: (False, "Pending", never))
    try:
        r = job_cli(kube, "submit", str(spec))
    finally:
        kueue.close()
    assert r.returncode == 3
    assert r.stderr.splitlines() == [
        "error: queue hyperpod-ns-team-a-localqueue (ClusterQueue hyperpod-ns-team-a-clusterqueue): Kueue will never "
        f"admit job llama-tiny: {never}; ask for less (nodes, gpus_per_node) or for the team's quota to be raised; "
        "nothing was left behind"]
    assert kube.get_job("llama-tiny") is None
    assert [p for m, p in writes(kube) if m == "DELETE" and "workloads" not in p] == [   # not the GC's
        "/apis/kubeflow.org/v1/namespaces/default/pytorchjobs/llama-tiny",
        "/api/v1/namespaces/default/persistentvolumeclaims/llama-tiny-ckpt"]

    waiting = ("couldn't assign flavors to pod set worker: insufficient unused quota for nvidia.com/gpu in flavor "
               "p5-reserved, 8 more needed")
    kueue = Kueue(kube, lambda job: (False, "Pending", waiting))
    try:
        r = job_cli(kube, "submit", str(spec), "--json")
    finally:
        kueue.close()
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["data"]["admission"] == {"state": "queued", "message": waiting,
                                                         "workload": "pytorchjob-llama-tiny-00000"}
    assert ("warning: job llama-tiny is queued in queue hyperpod-ns-team-a-localqueue (ClusterQueue "
            f"hyperpod-ns-team-a-clusterqueue), not admitted: {waiting}; it starts when quota frees (kubectl -n "
            "default get workloads)") in r.stderr.splitlines()
    assert kube.get_job("llama-tiny") is not None
    assert job_cli(kube, "delete", "llama-tiny", "--yes").returncode == 0

    kueue = Kueue(kube, lambda job: (True, "QuotaReserved", "Quota reserved in ClusterQueue "
                                                           "hyperpod-ns-team-a-clusterqueue"))
    try:
        r = job_cli(kube, "submit", str(spec), "--json")
    finally:
        kueue.close()
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["data"]["admission"]["state"] == "admitted"
    assert "warning" not in r.stderr
