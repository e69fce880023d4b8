"""`fsdpkit deploy` against kmock: check -> storage -> secret -> submit -> watch to success, and an
injected failure at each step leaves exactly what the earlier steps made; running it again
continues from the failed step."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from conftest import ROOT, require
from job_specs import TOKEN, set_conditions, write_spec, writes
from kube_objects import crd, deployment, healthy_eks, namespace_user, trainer_v2

require("kmock")

SECRETS = "/api/v1/namespaces/default/secrets"
PVCS = "/api/v1/namespaces/default/persistentvolumeclaims"
JOBS = "/apis/kubeflow.org/v1/namespaces/default/pytorchjobs"


def deploy(kube, tmp_path, *args, operator=None, spec=None, user=None):
    """Run `fsdpkit deploy` as a user would (`user`: a namespace user's environment); `operator(kube)`
    plays the training operator meanwhile."""
    env = {**os.environ, **kube.env, **(user or {}), "MY_HF_TOKEN": TOKEN, "FSDPKIT_HOME": str(tmp_path / "home")}
    seen = job_posts(kube)
    spec = spec or write_spec(tmp_path)
    proc = subprocess.Popen([sys.executable, "-m", "fsdpkit", "deploy", str(spec), "--poll", "0.2", *args], cwd=ROOT,
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    if operator:
        operator(kube, proc, seen)
    out, err = proc.communicate(timeout=120)
    return proc.returncode, out, err


def job_posts(kube):
    return sum(1 for m, p in writes(kube) if m == "POST" and p == JOBS)


def succeed_when_created(kube, proc, seen):
    deadline = time.monotonic() + 60
    while job_posts(kube) == seen:
        assert time.monotonic() < deadline and proc.poll() is None, proc.communicate()
        time.sleep(0.1)
    set_conditions(kube, "llama-tiny", "Created", "Running")
    time.sleep(0.5)
    set_conditions(kube, "llama-tiny", "Created", "Running", "Succeeded")


def created(kube):
    """What deploy created (the scripted cluster state, posted by the test, is left out)."""
    return [p for m, p in writes(kube) if m == "POST" and p in (PVCS, SECRETS, JOBS)]


def test_deploy_creates_and_watches_to_success(kube, tmp_path):
    healthy_eks(kube)
    code, out, err = deploy(kube, tmp_path, operator=succeed_when_created)
    assert code == 0, err
    assert created(kube) == [PVCS, SECRETS, JOBS]
    assert "llama-tiny: Running" in out and "llama-tiny: Succeeded" in out
    assert out.strip().endswith("deployed llama-tiny: check passed, storage ok, secret ok, submit ok, watch Succeeded")
    assert TOKEN not in out + err
    assert not (tmp_path / "home" / "deploy" / "default-llama-tiny.json").exists()


def test_deploy_json_is_one_envelope_and_progress_goes_to_stderr(kube, tmp_path):
    healthy_eks(kube)
    code, out, err = deploy(kube, tmp_path, "--json", operator=succeed_when_created)
    assert code == 0, err
    envelope = json.loads(out)
    assert envelope["ok"] is True and envelope["error"] is None and envelope["data"]
    assert "llama-tiny: Succeeded" in err and TOKEN not in out + err


def test_failed_check_creates_nothing(kube, tmp_path):
    healthy_eks(kube, operator=False)
    code, out, err = deploy(kube, tmp_path)
    assert code == 1
    # No job operator at all: the one this pytorchjob spec needs fails the check.
    assert "FAIL Kubeflow training operator: CRD pytorchjobs.kubeflow.org not installed" in out
    assert "Trainer v2" not in out.split("[storage]")[0].split("FAIL", 1)[1]   # not this job's concern
    assert "deploy step check: cluster check failed" in err and "left in the cluster: nothing" in err
    assert created(kube) == []


def test_deploy_runs_a_trainjob_where_trainer_v2_runs(kube, tmp_path):
    """The same steps for Kubeflow Trainer v2: its operator is checked before the submit step, and
    the TrainJob's status (its JobSet's jobs, then Complete) drives the watch."""
    from kubernetes import client

    healthy_eks(kube, operator=False)
    trainer_v2(kube)
    api = client.CustomObjectsApi(kube.api())
    trainjobs = "/apis/trainer.kubeflow.org/v1alpha1/namespaces/default/trainjobs"

    def trainer_plays(kube, proc, seen):
        deadline = time.monotonic() + 60
        while not any(m == "POST" and p == trainjobs for m, p in writes(kube)):
            assert time.monotonic() < deadline and proc.poll() is None, proc.communicate()
            time.sleep(0.1)
        for status in ({"jobsStatus": [{"name": "node", "active": 2}]},
                       {"conditions": [{"type": "Complete", "status": "True", "reason": "Complete",
                                        "message": "done", "lastTransitionTime": "2026-11-24T10:00:00Z"}]}):
            api.patch_namespaced_custom_object_status("trainer.kubeflow.org", "v1alpha1", "default", "trainjobs",
                                                      "llama-tiny", {"status": status})
            time.sleep(0.5)
    spec = write_spec(tmp_path, backend="trainjob")
    code, out, err = deploy(kube, tmp_path, spec=spec, operator=trainer_plays)
    assert code == 0, err
    assert "llama-tiny: Running" in out and "llama-tiny: Succeeded" in out
    assert [p for m, p in writes(kube) if m == "POST" and p in (PVCS, SECRETS, trainjobs)] == [
        PVCS, SECRETS, trainjobs]


def test_another_backend_s_operator_left_without_its_controller_is_a_note(kube, tmp_path):
    """What an add-on left behind: HyperPod's CRD and a controller that no longer runs, Kueue's CRDs
    without its controller, fail `cluster check`, but a trainjob deploy on no queue passes [check]
    with a note for each and runs."""
    from kubernetes import client

    healthy_eks(kube, operator=False)
    trainer_v2(kube)
    kube.create("/apis/apiextensions.k8s.io/v1/customresourcedefinitions",
                crd("hyperpodpytorchjobs.sagemaker.amazonaws.com"))
    kube.create("/apis/apps/v1/namespaces/aws-hyperpod/deployments",
                deployment("hp-training-operator-hp-training-controller-manager", "aws-hyperpod",
                           {"hp-training-control-plane": "hp-training-controller-manager"}, available=0))
    # Kueue's CRDs without its controller: a job on no queue does not use it.
    kube.create("/apis/apiextensions.k8s.io/v1/customresourcedefinitions", crd("clusterqueues.kueue.x-k8s.io"))
    r = subprocess.run([sys.executable, "-m", "fsdpkit", "cluster", "check"], cwd=ROOT, capture_output=True,
                       text=True, env={**os.environ, **kube.env}, timeout=120)
    failed = "HyperPod training operator: aws-hyperpod/hp-training-operator-hp-training-controller-manager: " \
        "controller not available (0 replicas ready)"
    assert r.returncode == 1 and f"FAIL  {failed}" in r.stdout, r.stdout
    api = client.CustomObjectsApi(kube.api())

    def trainer_plays(kube, proc, seen):
        deadline = time.monotonic() + 60
        while not api.list_namespaced_custom_object("trainer.kubeflow.org", "v1alpha1", "default",
                                                    "trainjobs")["items"]:
            assert time.monotonic() < deadline and proc.poll() is None, proc.communicate()
            time.sleep(0.1)
        done = {"type": "Complete", "status": "True", "reason": "Complete", "message": "done",
                "lastTransitionTime": "2026-11-24T10:00:00Z"}
        api.patch_namespaced_custom_object_status("trainer.kubeflow.org", "v1alpha1", "default", "trainjobs",
                                                  "llama-tiny", {"status": {"conditions": [done]}})
    code, out, err = deploy(kube, tmp_path, spec=write_spec(tmp_path, backend="trainjob"), operator=trainer_plays)
    assert code == 0, err
    check = out.split("[storage]")[0]
    assert "FAIL" not in check
    assert f"  note: {failed} (not used by this trainjob job)" in check.splitlines()
    assert [line for line in check.splitlines() if line.startswith("  note: Kueue: ")
            and line.endswith("(not used by this trainjob job)")], check
    assert "check passed" in out


def test_a_namespace_user_deploys_with_what_it_cannot_read_named(kube, tmp_path):
    """A team's user bound to the Role `fsdpkit cluster rbac` renders: the cluster-wide reads of
    [check] are notes naming the refusal, the job's API is found by discovery, and the deploy goes
    through to the end."""
    healthy_eks(kube)
    code, out, err = deploy(kube, tmp_path, operator=succeed_when_created, user=namespace_user(kube))
    assert code == 0, err
    assert created(kube) == [PVCS, SECRETS, JOBS]
    notes = [line for line in (out + err).splitlines() if line.startswith("  note: ")]
    assert [n.split(":")[1].strip() for n in notes] == ["nodes", "NVIDIA device plugin", "EFA device plugin",
                                                        "Kubeflow training operator", "FSx for Lustre"]
    assert out.strip().endswith("deployed llama-tiny: check passed, storage ok, secret ok, submit ok, watch Succeeded")


def test_a_job_the_planner_says_cannot_fit_warns_and_strict_stops_at_check(kube, tmp_path):
    healthy_eks(kube)
    spec = write_spec(tmp_path, nodes=1, train={"preset": "llama3_1_70b", "seq_len": 4096, "train_batch_size": 1,
                                                "checkpoint_freq": 10})
    code, out, err = deploy(kube, tmp_path, "--strict", spec=spec)
    assert code == 1 and "deploy step check: plan: does not fit" in err and "left in the cluster: nothing" in err
    assert created(kube) == []
    code, out, err = deploy(kube, tmp_path, "--fresh", spec=spec, operator=succeed_when_created)
    assert code == 0, err
    assert "WARN plan: does not fit: needs" in out and created(kube) == [PVCS, SECRETS, JOBS]


@pytest.mark.parametrize(("step", "route", "left"), [
    ("storage", PVCS, []),
    ("secret", SECRETS, [PVCS]),
    ("submit", JOBS, [PVCS, SECRETS]),
])
def test_failure_at_a_step_keeps_earlier_steps_and_resumes_there(kube, tmp_path, step, route, left):
    healthy_eks(kube)
    broken = {"on": True}

    def admission(request):  # a webhook that denies, until the test "fixes" it
        if broken["on"]:
            raise RuntimeError("admission webhook denied the request")
        return {}
    kube.route(f"post {route}", admission)
    code, _, err = deploy(kube, tmp_path, "--skip", "check")
    assert code == 3, err
    assert f"deploy step {step}: creating" in err and f"run deploy again to continue from {step}" in err
    names = {PVCS: "PersistentVolumeClaim/llama-tiny-ckpt", SECRETS: "Secret/llama-tiny-hf-token"}
    assert f"left in the cluster: {', '.join(names[p] for p in left) or 'nothing'}" in err
    # What the earlier steps created is still there; nothing was deleted.
    assert [p for p in created(kube) if p != route] == left
    assert [w for w in writes(kube) if w[0] == "DELETE"] == []

    # kmock stores the object of a create even when a reaction answers 500; a real API server does
    # not. Remove that stray copy as the test's own step, so the cluster is what a real one would be.
    from kubernetes import client

    api = kube.api()
    try:
        if route == PVCS:
            client.CoreV1Api(api).delete_namespaced_persistent_volume_claim("llama-tiny-ckpt", "default")
        elif route == SECRETS:
            client.CoreV1Api(api).delete_namespaced_secret("llama-tiny-hf-token", "default")
        else:
            client.CustomObjectsApi(api).delete_namespaced_custom_object("kubeflow.org", "v1", "default",
                                                                         "pytorchjobs", "llama-tiny")
    except client.ApiException as e:
        assert e.status == 404

    broken["on"] = False
    before = len(created(kube))
    code, out, err = deploy(kube, tmp_path, "--skip", "check", operator=succeed_when_created)
    assert code == 0, err
    assert ("resuming: already done: " in out) == bool(left)
    # Only the failed step and the ones after it ran again.
    again = created(kube)[before:]
    assert again == [p for p in (PVCS, SECRETS, JOBS) if p not in left]


def test_a_job_that_fails_fails_the_deploy(kube, tmp_path):
    healthy_eks(kube)

    def fail(kube, proc, seen):
        deadline = time.monotonic() + 60
        while job_posts(kube) == seen:
            assert time.monotonic() < deadline
            time.sleep(0.1)
        set_conditions(kube, "llama-tiny", "Created", "Running", "Failed")
    code, out, _ = deploy(kube, tmp_path, "--json", operator=fail)
    assert code == 1
    assert json.loads(out)["error"]["message"].startswith("deploy step watch: job llama-tiny ended Failed")
    assert json.loads((tmp_path / "home" / "deploy" / "default-llama-tiny.json").read_text())["done"] == [
        "check", "storage", "secret", "submit"]
