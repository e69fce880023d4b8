"""Kubeflow Trainer v2: what a spec renders to (TrainJob, fsdpkit's ClusterTrainingRuntime, and the
JobSet Trainer makes of them) against the real CRD schemas, and the trainjob backend over a
Kubernetes API (kmock, the official client on our side) with the test playing Trainer's controller:
the JobSet's pods appear, conditions move, a failure is resubmitted within its budget."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest
import yaml

from fsdpkit.cluster import trainer
from fsdpkit.jobs import trainjob
from fsdpkit.jobs.resolved import load_job

from conftest import ROOT, run_cli
from job_specs import TOKEN, job_cli, write_spec, writes
from kube_objects import trainer_v2
from manifest_schemas import IMAGE, SCHEMAS, crd_validator, jobset_of, pod_of, validate_builtin

PLURAL = "trainjobs"
UPSTREAM = SCHEMAS / "examples" / "kubeflow-trainer_torch_distributed_runtime.yaml"


def spec_for(nodes="2", instance="p5.48xlarge", **extra):
    doc = {"name": "t1", "backend": "trainjob", "image": IMAGE, "nodes": nodes, "instance_type": instance,
           "storage": {"claim": "fsx-claim"}, "hf_token_env": "HF_TOKEN", "queue": "team-a",
           "secrets": [{"env": "WANDB_API_KEY", "secret": "wandb", "key": "api-key"}],
           "priority_class": "high", "train": {"preset": "tiny", "checkpoint_freq": 50}, **extra}
    return load_job(None, list(doc.items()))


def _errors(validator, obj):
    return [f"{list(e.absolute_path)}: {e.message}" for e in validator.iter_errors(obj)]


@pytest.mark.parametrize("nodes", ["1", "4"], ids=["single-node", "multi-node"])
def test_trainjob_runtime_and_jobset_validate_against_the_real_schemas(nodes):
    jobs, runtimes = crd_validator("trainer.kubeflow.org_trainjobs.yaml"), crd_validator(
        "trainer.kubeflow.org_clustertrainingruntimes.yaml")
    jobsets = crd_validator("jobset.x-k8s.io_jobsets.yaml")
    ours = trainer.runtime_manifest(IMAGE)
    assert not _errors(runtimes, ours)
    upstream = yaml.safe_load(UPSTREAM.read_text())
    for instance in ("p5.48xlarge", "p4d.24xlarge", "g5.xlarge", "g6e.12xlarge", "trn1.32xlarge"):
        for runtime in (upstream, ours):
            spec = spec_for(nodes, instance, trainjob={"runtime": runtime["metadata"]["name"]})
            objs = trainjob.render(spec)
            assert [o["kind"] for o in objs] == ["Secret", "TrainJob"]
            job = objs[-1]
            assert not _errors(jobs, job), instance
            validate_builtin(objs[0])
            jobset = jobset_of(job, runtime)
            assert not _errors(jobsets, jobset), instance
            validate_builtin(pod_of(jobset["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]))


def test_a_trainjob_carries_the_job_in_trainer_fields_and_one_patch():
    job = trainjob.trainjob_manifest(spec_for("4", resubmits=2, trainjob={"runtime": "fsdpkit-torch"}))
    t = job["spec"]["trainer"]
    assert job["spec"]["runtimeRef"] == {"name": "fsdpkit-torch", "kind": "ClusterTrainingRuntime",
                                         "apiGroup": "trainer.kubeflow.org"}
    assert (t["numNodes"], t["numProcPerNode"], t["image"]) == (4, 8, IMAGE)
    assert t["resourcesPerNode"]["limits"] == {"nvidia.com/gpu": 8, "vpc.amazonaws.com/efa": 32}
    # torchrun under fsdpkit's supervisor, rendezvous on the first pod by the name JobSet gives it.
    assert t["command"][:6] == ["fsdpkit-torchrun", "--nnodes=4", "--nproc-per-node=8", "--rdzv-backend=c10d",
                                "--rdzv-endpoint=t1-node-0-0.t1.default.svc.cluster.local:29500", "--rdzv-id=t1"]
    assert t["command"][t["command"].index("--resume-from-checkpoint") + 1] == "auto"
    env = {e["name"]: e for e in t["env"]}
    assert env["FI_PROVIDER"]["value"] == "efa"
    assert env["HF_TOKEN"]["valueFrom"]["secretKeyRef"] == {"name": "t1-hf-token", "key": "token"}
    assert not any(name.startswith("PET_") for name in env)  # Trainer's own, refused in trainer.env
    (patch,) = job["spec"]["runtimePatches"]
    pod = patch["trainingRuntimeSpec"]["template"]["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]
    assert pod["spec"]["terminationGracePeriodSeconds"] >= 60
    assert {v["name"] for v in pod["spec"]["volumes"]} == {"dshm", "checkpoints"}
    assert job["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] == "team-a"
    assert job["metadata"]["labels"]["kueue.x-k8s.io/priority-class"] == "high"
    assert job["metadata"]["annotations"]["fsdpkit.dev/max-resubmits"] == "2"
    assert TOKEN not in json.dumps(job)


def test_elastic_nodes_are_refused_for_a_trainjob():
    r = run_cli("job", "render", "--set", "name=t", "--set", "backend=trainjob", "--set", f"image={IMAGE}",
                "--set", "nodes=2:4")
    assert r.returncode == 2
    assert r.stderr.strip().splitlines() == [
        "error: nodes: elastic ranges need the pytorchjob or hyperpod backend, not trainjob (a TrainJob runs a fixed "
        "number of nodes)"]


def test_a_v1_spec_becomes_its_v2_equivalent():
    r = run_cli("job", "render", str(ROOT / "examples" / "jobs" / "eks-p5.yaml"), "--set", "backend=trainjob",
                "--json")
    assert r.returncode == 0, r.stderr
    v2 = json.loads(r.stdout)["data"]["manifests"][-1]
    assert v2["kind"] == "TrainJob" and not _errors(crd_validator("trainer.kubeflow.org_trainjobs.yaml"), v2)
    v1 = json.loads(run_cli("job", "render", str(ROOT / "examples" / "jobs" / "eks-p5.yaml"), "--json").stdout)
    master = v1["data"]["manifests"][-1]["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]
    # The same program and environment on the same nodes: only the rendezvous address differs.
    strip = [a for a in master["containers"][0]["command"] if not a.startswith("--rdzv-endpoint")]
    assert [a for a in v2["spec"]["trainer"]["command"] if not a.startswith("--rdzv-endpoint")] == strip
    assert v2["spec"]["trainer"]["env"] == master["containers"][0]["env"]


# -- the backend over kmock -------------------------------------------------------------------------------
def set_status(kube, name, status):
    """Play Trainer v2's controller: it writes the TrainJob's status subresource."""
    from kubernetes import client

    client.CustomObjectsApi(kube.api()).patch_namespaced_custom_object_status(
        trainer.GROUP, trainer.VERSION, "default", PLURAL, name, {"status": status})


def condition(kind, message=""):
    return {"type": kind, "status": "True", "reason": kind, "message": message,
            "lastTransitionTime": "2026-11-24T10:00:00Z"}


def make_pod(kube, job, index, phase="Running"):
    """Play JobSet and the kubelet: pod `index` of the job's node replicated job."""
    from kubernetes import client

    name = f"{job}-node-0-{index}-abcde"
    client.CoreV1Api(kube.api()).create_namespaced_pod("default", {
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": name, "namespace": "default", "labels": {
            trainer.JOBSET_NAME: job, "jobset.sigs.k8s.io/replicatedjob-name": trainer.NODE,
            trainer.COMPLETION_INDEX: str(index), trainer.ANCESTOR: "trainer"}},
        "spec": {"containers": [{"name": trainer.NODE, "image": "x"}]}, "status": {"phase": phase}})
    return name


def tj_spec(tmp_path, **fields):
    return write_spec(tmp_path, backend="trainjob", instance_type="p5.48xlarge", **fields)


@pytest.mark.parametrize(("tag", "code"), [("v2.1.0", 3), ("v2.3.0", 0), ("v2.4.1", 0), ("latest", 0)])
def test_a_trainjob_needs_trainer_2_3_and_an_older_controller_is_refused_before_anything_is_made(kube, tmp_path,
                                                                                              tag, code):
    """runtimePatches carrying the pod's grace period need Trainer 2.3: the render says so, and a
    submit (or server dry run) against an older controller, read from its image's tag, is refused in
    one line with nothing made. A tag that names no release is said, and the submit goes on."""
    trainer_v2(kube, version=tag)
    spec = tj_spec(tmp_path)
    r = job_cli(kube, "render", str(spec), "--json")
    assert json.loads(r.stdout)["data"]["needs"] == trainer.NEEDS == (
        "Kubeflow Trainer >= v2.3.0 (runtimePatches with the pod's grace period)")
    assert f"note: these manifests need {trainer.NEEDS}" in job_cli(kube, "render", str(spec)).stderr
    for args in (["--dry-run=server"], []):
        r = job_cli(kube, "submit", str(spec), *args)
        assert r.returncode == code, r.stderr
        if code:
            assert r.stderr == ("error: TrainJob: this cluster runs Kubeflow Trainer v2.1.0; this job needs Kubeflow "
                                "Trainer >= v2.3.0 (runtimePatches with the pod's grace period); upgrade it: fsdpkit "
                                "cluster addons install --only trainer, or submit with --set backend=pytorchjob\n")
    made = [p for m, p in writes(kube) if m == "POST" and "customresourcedefinitions" not in p
            and "/deployments" not in p and "clustertrainingruntimes" not in p]
    assert (made == []) is (code == 3)
    if tag == "latest":
        assert ("warning: Kubeflow Trainer's release not known from its image "
                "(ghcr.io/kubeflow/trainer/trainer-controller-manager:latest)") in r.stderr


def test_submit_status_logs_and_delete_of_a_trainjob(kube, tmp_path):
    r = job_cli(kube, "submit", str(tj_spec(tmp_path)), "--json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["data"]["created"] == [
        "Secret/llama-tiny-hf-token", "PersistentVolumeClaim/llama-tiny-ckpt", "TrainJob/llama-tiny"]
    posts = [(p, b) for m, p, b in kube.requests() if m == "POST"]
    assert [p for p, _ in posts] == [f"{path}?fieldValidation=Strict" for path in (
        "/api/v1/namespaces/default/secrets", "/api/v1/namespaces/default/persistentvolumeclaims",
        "/apis/trainer.kubeflow.org/v1alpha1/namespaces/default/trainjobs")]
    assert TOKEN not in json.dumps(posts[-1][1])

    states = []
    for status in ({}, {"jobsStatus": [{"name": "node", "active": 0, "ready": 0, "succeeded": 0, "failed": 0}]},
                   {"jobsStatus": [{"name": "node", "active": 1, "ready": 1, "succeeded": 0, "failed": 0}]},
                   {"conditions": [condition("Complete", "TrainJob is completed")],
                    "jobsStatus": [{"name": "node", "active": 0, "ready": 0, "succeeded": 1, "failed": 0}]}):
        set_status(kube, "llama-tiny", status)
        r = job_cli(kube, "status", "llama-tiny", "--json")
        assert r.returncode == 0, r.stderr
        states.append(json.loads(r.stdout)["data"]["state"])
    assert states == ["Pending", "Created", "Running", "Succeeded"]
    data = json.loads(r.stdout)["data"]
    assert data["backend"] == "trainjob" and data["replicas"] == {"node": {"active": 0, "ready": 0, "succeeded": 1,
                                                                           "failed": 0}}
    assert job_cli(kube, "wait", "llama-tiny", "--poll", "0.1").returncode == 0

    for i, text in ((0, b"Batch 10 Loss: 2.00000, rank 0\n"), (1, b"Batch 10 Loss: 2.00000, node 1\n")):
        kube.route(f"get /api/v1/namespaces/default/pods/{make_pod(kube, 'llama-tiny', i)}/log", text)
    r = job_cli(kube, "logs", "llama-tiny")
    assert r.returncode == 0 and r.stdout.splitlines() == ["Batch 10 Loss: 2.00000, rank 0"]
    r = job_cli(kube, "logs", "llama-tiny", "--replica", "all")
    assert r.stdout.splitlines() == ["[node-0] Batch 10 Loss: 2.00000, rank 0",
                                     "[node-1] Batch 10 Loss: 2.00000, node 1"]
    reads = [p for m, p, _ in kube.requests() if m == "GET" and p.split("?")[0].endswith("/log")]
    assert reads and all("container=node" in p for p in reads)
    assert any("labelSelector=jobset.sigs.k8s.io%2Fjobset-name%3Dllama-tiny" in p
               for m, p, _ in kube.requests() if p.startswith("/api/v1/namespaces/default/pods?"))

    r = job_cli(kube, "list", "--backend", "trainjob", "--json")
    assert [j["name"] for j in json.loads(r.stdout)["data"]["jobs"]] == ["llama-tiny"]
    r = job_cli(kube, "delete", "llama-tiny")
    assert r.returncode == 0, r.stderr
    assert [p for m, p in writes(kube) if m == "DELETE"] == [
        "/apis/trainer.kubeflow.org/v1alpha1/namespaces/default/trainjobs/llama-tiny",
        "/api/v1/namespaces/default/secrets/llama-tiny-hf-token"]


def test_job_status_shows_the_progress_the_run_posted(kube, tmp_path):
    """The trainerStatus that rank 0 posts (made here by the trainer's own sink) and the controller
    writes to the TrainJob, as `job status` shows it; none before the first post."""
    from fsdpkit.train.observe.trainjob_status import TrainJobStatusSink

    assert job_cli(kube, "submit", str(tj_spec(tmp_path))).returncode == 0
    running = {"jobsStatus": [{"name": "node", "active": 2, "ready": 2, "succeeded": 0, "failed": 0}]}
    set_status(kube, "llama-tiny", running)
    assert json.loads(job_cli(kube, "status", "llama-tiny", "--json").stdout)["data"]["progress"] is None
    sink = TrainJobStatusSink("https://unused", None, "unused", total_steps=1000, clock=lambda: 3600.0)
    sink.start = (0, 0.0)
    sink.log("train", {"step": 450, "loss": 2.3125, "tokens_per_s": 912345.0, "mfu": 0.41})
    posted = sink.status(3600.0)
    set_status(kube, "llama-tiny", {**running, "trainerStatus": posted})
    r = job_cli(kube, "status", "llama-tiny", "--json")
    progress = json.loads(r.stdout)["data"]["progress"]
    assert progress == {"percent": 45, "remaining_s": 4400, "updated": posted["lastUpdatedTime"],
                        "metrics": {"step": "450", "total_steps": "1000", "loss": "2.3125",
                                    "tokens_per_s": "912345", "mfu": "0.41"}}
    r = job_cli(kube, "status", "llama-tiny")
    assert r.returncode == 0, r.stderr
    assert f"  progress: 45%, about 1h 13m left; step 450, total_steps 1000, loss 2.3125, tokens_per_s 912345, " \
        f"mfu 0.41 (posted {posted['lastUpdatedTime']})" in r.stdout.splitlines()


def test_a_failed_trainjob_is_resubmitted_within_its_budget(kube, tmp_path):
    assert job_cli(kube, "submit", str(tj_spec(tmp_path, resubmits=1))).returncode == 0
    waiter = subprocess.Popen([sys.executable, "-m", "fsdpkit", "job", "wait", "llama-tiny", "--poll", "0.2"],
                              cwd=ROOT, env={**os.environ, **kube.env}, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True)
    set_status(kube, "llama-tiny", {"conditions": [condition("Failed", "jobset failed")]})

    def attempt():
        obj = kube.get_job("llama-tiny", PLURAL, trainer.GROUP, trainer.VERSION)
        return None if obj is None else (obj["metadata"]["annotations"]["fsdpkit.dev/attempt"], obj.get("status"))

    deadline = time.monotonic() + 60
    while (attempt() or ("",))[0] != "1":
        assert time.monotonic() < deadline and waiter.poll() is None, waiter.communicate()
        time.sleep(0.2)
    assert attempt()[1] is None  # a fresh TrainJob, not the failed one patched
    set_status(kube, "llama-tiny", {"conditions": [condition("Failed", "jobset failed again")]})
    out, err = waiter.communicate(timeout=60)
    assert waiter.returncode == 1, err
    assert "resubmitting, attempt 1 of 1" in err and "Failed, resubmission 1: jobset failed again" in out


def test_watch_reads_a_trainjob_s_rank0_pod(kube, tmp_path):
    assert job_cli(kube, "submit", str(tj_spec(tmp_path))).returncode == 0
    set_status(kube, "llama-tiny", {"jobsStatus": [{"name": "node", "active": 2, "ready": 2}]})
    pod = make_pod(kube, "llama-tiny", 0)
    make_pod(kube, "llama-tiny", 1)
    kube.route(f"get /api/v1/namespaces/default/pods/{pod}/log",
               b"2026-11-24T10:00:00.000000000Z Batch 20 Loss: 3.50000, Speed: 1.0 samples/sec, tokens/s: 82000\n")
    r = job_cli(kube, "watch", "llama-tiny", "--once", "--json", "--stall-after", "1e9")
    data = json.loads(r.stdout)["data"]
    assert data["state"] == "Running" and data["progress"]["step"] == 20 and data["progress"]["loss"] == 3.5
    assert sorted(p["name"] for p in data["pods"]) == ["llama-tiny-node-0-0-abcde", "llama-tiny-node-0-1-abcde"]


def test_a_cluster_without_trainer_v2_is_told_before_anything_is_created(kube, tmp_path):
    kube.forget("trainer.kubeflow.org/v1alpha1/trainjobs")
    r = job_cli(kube, "submit", str(tj_spec(tmp_path)))
    assert r.returncode == 3
    assert r.stderr.strip().splitlines() == [
        "error: TrainJob: this cluster has no such API; install Kubeflow Trainer v2 (fsdpkit cluster addons install "
        "--only trainer), or submit with the backend it runs: pytorchjob (PyTorchJob), hyperpod (HyperPodPyTorchJob) "
        "(--set backend=...)"]
    assert [m for m, _ in writes(kube)] == []
