"""A Pending job says why (fsdpkit.jobs.events): each source of the reason, written as the component
that writes it would (kmock stores the Events): the training operator that cannot create a pod, JobSet's
Job controller that cannot create a TrainJob's, the scheduler that cannot place one, Kueue waiting
for quota. `job status` and `job watch` show the newest; `job wait` ends with exit 1 on a job whose
pods cannot be created, and keeps waiting, saying why, on one the scheduler cannot place yet. A job
being deleted is Deleting, not Pending."""

from __future__ import annotations

import json
import time

import pytest

from fsdpkit.jobs.events import about

from conftest import require
from job_specs import job_cli, write_spec


def event(kube, kind, name, reason, message, type_="Warning", count=1, api_version="v1"):
    """An Event as its component records it, about `kind`/`name` in namespace default."""
    stamp = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    kube.create("/api/v1/namespaces/default/events", {
        "apiVersion": "v1", "kind": "Event",
        "metadata": {"name": f"{name}.{abs(hash((reason, message))):x}"[:60], "namespace": "default"},
        "involvedObject": {"kind": kind, "name": name, "namespace": "default", "apiVersion": api_version},
        "reason": reason, "message": message, "type": type_, "count": count,
        "firstTimestamp": stamp, "lastTimestamp": stamp, "source": {"component": "test"}})


PRIORITY = 'Error creating: pods "llama-tiny-master-0" is forbidden: no PriorityClass with name high was found'
SCHEDULING = ("0/3 nodes are available: 3 Insufficient nvidia.com/gpu. preemption: 0/3 nodes are available: 3 No "
              "preemption victims found for incoming pod.")
QUOTA = ("couldn't assign flavors to pod set master: insufficient unused quota for nvidia.com/gpu in flavor p5, 16 "
         "more needed")

# Each source: the spec's backend, who writes (kind, name of the object it is about), the event.
SOURCES = {
    "training-operator": ("pytorchjob", ("PyTorchJob", "llama-tiny"), "FailedCreatePod", PRIORITY, "Warning", True),
    "jobset": ("trainjob", ("Job", "llama-tiny-node-0"), "FailedCreate", PRIORITY.replace("master-0", "node-0-0-x7k2p"),
               "Warning", True),
    "scheduler": ("pytorchjob", ("Pod", "llama-tiny-master-0"), "FailedScheduling", SCHEDULING, "Warning", False),
    "kueue": ("pytorchjob", ("Workload", "pytorchjob-llama-tiny-4f2a9"), "Pending", QUOTA, "Normal", False),
}


@pytest.mark.parametrize("source", list(SOURCES))
def test_a_pending_job_says_why_and_wait_ends_on_one_that_cannot_start(kube, tmp_path, source):
    require("kmock")
    backend, (kind, name), reason, message, type_, blocks = SOURCES[source]
    spec = write_spec(tmp_path, backend=backend)
    assert job_cli(kube, "submit", str(spec)).returncode == 0
    r = job_cli(kube, "status", "llama-tiny")
    assert (r.returncode, r.stdout) == (0, "llama-tiny (default): Pending\n")   # no event: nothing more to say
    # Another job's events say nothing of this one.
    event(kube, "Pod", "llama-tiny-2-master-0", "FailedScheduling", "not ours")
    event(kube, kind, name, reason, message, type_, count=3)
    r = job_cli(kube, "status", "llama-tiny", "--json")
    st = json.loads(r.stdout)["data"]
    assert st["state"] == "Pending" and st["details"]["event"]["reason"] == reason, st
    assert st["details"]["event"]["object"] == f"{kind}/{name}" and st["details"]["event"]["count"] == 3
    who = "the operator cannot create its pods" if blocks else f"{kind} {name}"
    assert st["message"] == f"{who}: {reason} (3 times): {message}"
    r = job_cli(kube, "status", "llama-tiny")
    assert f"llama-tiny (default): Pending: {who}: {reason}" in r.stdout, r.stdout
    # `job watch --once` says it where it would say "no pods yet"; a job that cannot start is its finding.
    r = job_cli(kube, "watch", "llama-tiny", "--once", "--no-sample")
    assert f"llama-tiny: Pending | no pods yet: {who}: {reason} (3 times): " in r.stdout, r.stdout
    assert r.returncode == (1 if blocks else 0), r.stdout + r.stderr
    r = job_cli(kube, "wait", "llama-tiny", "--poll", "0.1", "--timeout", "2")
    if blocks:   # it will not start as it is: wait ends now, with the reason
        assert r.returncode == 1, r.stderr
        said = f"error: job llama-tiny will not start: {who}: {reason} (3 times): {message}"
        assert r.stderr.strip().splitlines()[-1] == said
    else:        # the scheduler or Kueue may yet place it: wait goes on, saying why
        assert r.returncode == 124 and reason in r.stdout, (r.returncode, r.stdout, r.stderr)


def test_an_event_is_about_the_job_only_by_the_names_its_components_give():
    def ev(kind, name):
        return {"involvedObject": {"kind": kind, "name": name}}
    assert about(ev("PyTorchJob", "llama"), "llama", "PyTorchJob")
    assert about(ev("Pod", "llama-worker-3"), "llama", "PyTorchJob")
    assert about(ev("Pod", "llama-node-0-0-x7k2p"), "llama", "TrainJob")
    assert about(ev("Job", "llama-node-0"), "llama", "TrainJob")
    assert about(ev("Workload", "pytorchjob-llama-4f2a9"), "llama", "PyTorchJob")
    # Another job whose name begins with this one's, and what is not the job's at all.
    assert not about(ev("PyTorchJob", "llama-2"), "llama", "PyTorchJob")
    assert not about(ev("Pod", "llama-2-master-0"), "llama", "PyTorchJob")
    assert not about(ev("Job", "llama-2-node-0"), "llama", "TrainJob")
    assert not about(ev("Workload", "pytorchjob-llama-2-4f2a9"), "llama", "PyTorchJob")
    assert not about(ev("Node", "llama"), "llama", "PyTorchJob")


def test_a_job_being_deleted_is_deleting_and_deleting_it_again_says_so(kube, tmp_path):
    """The API server keeps a deleted object while finalizers hold it (the operator's): its
    deletionTimestamp is set. It is not Pending."""
    require("kmock")
    kube.create("/apis/kubeflow.org/v1/namespaces/default/pytorchjobs", {
        "apiVersion": "kubeflow.org/v1", "kind": "PyTorchJob",
        "metadata": {"name": "llama-tiny", "namespace": "default",
                     "labels": {"app.kubernetes.io/managed-by": "fsdpkit"},
                     "deletionTimestamp": "2026-12-01T10:00:00Z", "finalizers": ["kubeflow.org/pytorchjob"]},
        "spec": {"pytorchReplicaSpecs": {}}})
    r = job_cli(kube, "status", "llama-tiny")
    assert r.stdout.splitlines()[0] == ("llama-tiny (default): Deleting: being deleted since 2026-12-01T10:00:00Z "
                                        "(waiting on kubeflow.org/pytorchjob)"), r.stdout + r.stderr
    r = job_cli(kube, "delete", "llama-tiny", "--yes")
    assert r.returncode == 0, r.stderr
    assert "warning: job llama-tiny is already being deleted (since 2026-12-01T10:00:00Z)" in r.stderr, r.stderr
