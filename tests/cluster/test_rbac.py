"""The Role `fsdpkit cluster rbac` renders, held against every job verb as a shared cluster runs them:
a user bound to exactly that Role in its namespace and to nothing cluster-wide, the API server
answering as kube-apiserver does (tests/kube_access.py: RBAC's 403 Status bodies, access reviews).
With the whole Role every verb works, for each Kubernetes backend; with any one permission taken
away, each verb that needs it fails in one line naming it and creates nothing, each that does not
still works, and no permission of the Role goes unused."""

from __future__ import annotations

import json

import pytest

from fsdpkit.cli import cluster as cluster_cli
from fsdpkit.cli import job as job_cli
from fsdpkit.cluster import rbac
from fsdpkit.jobs.backends import get_backend
from fsdpkit.jobs.backends.kube_api import KINDS, SUPPORT
from fsdpkit.jobs.resolved import load_job

from conftest import require
from job_specs import TOKEN, write_spec
from manifest_schemas import validate_builtin

require("kmock")
require("kubernetes")

USER = "system:serviceaccount:default:team-user"
BACKENDS = {k.backend: k for k in KINDS.values()}


def run(monkeypatch, capsys, env, *argv, verb=job_cli):
    """A command in this process (hundreds of them run here), as the user of `env`."""
    monkeypatch.setenv("KUBECONFIG", env["KUBECONFIG"])
    monkeypatch.setenv("FSDPKIT_HOME", env.get("FSDPKIT_HOME", "/nonexistent-fsdpkit-home"))
    monkeypatch.setenv("MY_HF_TOKEN", TOKEN)
    code = verb.main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def role(monkeypatch, capsys, env, backend):
    code, out, _ = run(monkeypatch, capsys, env, "rbac", "--namespace", "default", "--backend", backend,
                       "--service-account", "team-user", "--json", verb=cluster_cli)
    assert code == 0
    return json.loads(out)["data"]["manifests"]


def play_operator(kube, backend, name):
    """The operator's side: the job's rank-0 pod, with the labels its operator sets (its log is
    routed once per test: each route kmock holds is matched against every request)."""
    from kubernetes import client

    labels = {"pytorchjob": {"training.kubeflow.org/job-name": name, "training.kubeflow.org/replica-type": "master",
                             "training.kubeflow.org/replica-index": "0"},
              "hyperpod": {"fsdpkit.dev/job": name, "training.kubeflow.org/replica-type": "master",
                           "training.kubeflow.org/replica-index": "0"},
              "trainjob": {"jobset.sigs.k8s.io/jobset-name": name, "batch.kubernetes.io/job-completion-index": "0"}}
    pod = f"{name}-rank0"
    client.CoreV1Api(kube.api()).create_namespaced_pod("default", {
        "apiVersion": "v1", "kind": "Pod", "metadata": {"name": pod, "namespace": "default",
                                                       "labels": labels[backend]},
        "spec": {"containers": [{"name": KINDS_OF[backend].container, "image": "x"}]}, "status": {"phase": "Running"}})


KINDS_OF = BACKENDS


def finish(kube, backend, name):
    """The operator marks the job done, as each kind says it."""
    from kubernetes import client

    k = BACKENDS[backend]
    done = {"trainjob": "Complete", "pytorchjob": "Succeeded", "hyperpod": "Completed"}[backend]
    client.CustomObjectsApi(kube.api()).patch_namespaced_custom_object_status(
        k.group, k.version, "default", k.plural, name, {"status": {"conditions": [
            {"type": done, "status": "True", "reason": done, "message": "done",
             "lastTransitionTime": "2026-11-27T10:00:00Z"}]}})


def spec_for(tmp_path, backend):
    extra = {"instance_type": "ml.p5.48xlarge"} if backend == "hyperpod" else {}
    return str(write_spec(tmp_path, backend=backend, **extra))


# Each verb as the user runs it, and the state it runs in: "absent" (no job of that name), "present"
# (the job running, its rank-0 pod and log), "finished" (the same, ended). Its needs are the
# library's own declaration, which the Role is made from; the test holds what the verb does to it.
VERBS = [
    ("job status", "present", lambda spec: ["status", "llama-tiny"]),
    ("job logs", "present", lambda spec: ["logs", "llama-tiny"]),
    ("job watch", "present", lambda spec: ["watch", "llama-tiny", "--once", "--no-sample"]),
    ("job list", "present", lambda spec: ["list"]),
    ("job submit --replace", "present", lambda spec: ["submit", spec, "--replace"]),
    ("job delete", "present", lambda spec: ["delete", "llama-tiny"]),
    ("job wait", "finished", lambda spec: ["wait", "llama-tiny", "--poll", "0.1"]),
    ("job delete --delete-storage", "finished", lambda spec: ["delete", "llama-tiny", "--delete-storage", "--yes"]),
    ("job submit --dry-run=server", "absent", lambda spec: ["submit", spec, "--dry-run=server"]),
    ("job submit", "absent", lambda spec: ["submit", spec]),
]
# The verbs that change what exists when they work.
CHANGES = {"job submit --replace", "job delete", "job delete --delete-storage", "job submit"}


def set_state(kube, monkeypatch, capsys, backend, spec, state):
    """As the cluster's admin: the job absent, or present with its pod (running, or finished)."""
    from kubernetes import client

    k = BACKENDS[backend]
    if kube.get_job("llama-tiny", k.plural, k.group, k.version) is not None:
        assert run(monkeypatch, capsys, kube.env, "delete", "llama-tiny", "--delete-storage", "--yes")[0] == 0
    core = client.CoreV1Api(kube.api())
    for pod in core.list_namespaced_pod("default").items:   # the operator's garbage collection
        core.delete_namespaced_pod(pod.metadata.name, "default")
    if state != "absent":
        assert run(monkeypatch, capsys, kube.env, "submit", spec)[0] == 0
        play_operator(kube, backend, "llama-tiny")
        if state == "finished":
            finish(kube, backend, "llama-tiny")


def real_writes(kube, since=0):
    """What was stored (from the `since`-th request on): creates, deletes and patches; server dry
    runs (they store nothing) left out."""
    return [(m, p) for m, p, _ in kube.requests(since) if m in ("POST", "PATCH", "PUT", "DELETE")
            and "dryRun=All" not in p]


@pytest.mark.parametrize("backend", ["pytorchjob", "trainjob", "hyperpod"])
def test_every_verb_works_with_the_role_and_fails_naming_each_permission_it_lacks(kube, tmp_path, monkeypatch,
                                                                                    capsys, backend):
    objs = role(monkeypatch, capsys, kube.env, backend)
    for obj in objs:
        validate_builtin(obj)   # a Role and RoleBinding the API server accepts
    binding = objs[1]
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "team-user", "namespace": "default"}]
    rules = objs[0]["rules"]
    k = BACKENDS[backend]
    spec = spec_for(tmp_path, backend)
    permissions = [(g, r, v) for rule in rules for g in rule["apiGroups"] for r in rule["resources"]
                   for v in rule["verbs"]]
    assert (k.group, k.plural, "create") in permissions and not any(r == "nodes" for _, r, _ in permissions)
    # A TrainJob's own runtime is granted with TrainJobs only; every backend's submit reads its queue,
    # the namespace's quotas and, in status and wait, the job's events.
    assert any(r == "trainingruntimes" for _, r, _ in permissions) == (backend == "trainjob")
    assert {("kueue.x-k8s.io", "localqueues", "get"), ("", "resourcequotas", "list"), ("", "events", "list"),
            ("", "pods", "create")} <= set(permissions)

    kube.route("get /api/v1/namespaces/default/pods/llama-tiny-rank0/log", b"Batch 1 Loss: 3.1\n")
    # The whole Role: every verb works.
    user = kube.user(USER, rules)
    now = None
    for verb, state, argv in VERBS:
        if state != now:
            set_state(kube, monkeypatch, capsys, backend, spec, state)
        code, _, err = run(monkeypatch, capsys, user, *argv(spec))
        assert code == 0, (verb, err)
        now = None if verb in CHANGES else state

    # One permission taken away at a time, each from a user of its own on the same API server (every
    # verb starts from the state it needs: set_state). A permission for an object this job does not
    # make (a DRA claim template, a TrainJob's own runtime) is needed by no verb here: taking it away
    # is not tried.
    made = {o["kind"] for o in get_backend(backend).render(load_job(spec, [])).objects()}
    unmade = {plural for kind, (_, _, plural) in SUPPORT.items() if kind not in made}
    used = set()
    for group, resource, allowed in permissions:
        if resource in unmade:
            continue
        less = [{**rule, "verbs": [v for v in rule["verbs"] if not (rule["apiGroups"] == [group] and
                                                                  rule["resources"] == [resource] and v == allowed)]}
                for rule in rules]
        user = kube.user(f"{USER}-without-{allowed}-{resource}", [r for r in less if r["verbs"]])
        taken = rbac.Permission(allowed, group, resource)
        now = None
        for verb, state, argv in VERBS:
            if state != now:
                set_state(kube, monkeypatch, capsys, backend, spec, state)
            now = state
            before = kube.request_count()
            code, _, err = run(monkeypatch, capsys, user, *argv(spec))
            if code == 0 and verb in CHANGES:
                now = None
            required = [p for p in rbac.needs(verb, k.group, k.plural) if not p.optional and p.resource not in unmade]
            if taken in required:
                used.add(taken)
                lines = err.strip().splitlines()
                assert code == 3 and len(lines) == 1, (verb, taken, code, err)
                named = (f"may not {taken}" in lines[0] or
                         f'cannot {allowed} resource "{resource}" in API group "{group}" in the namespace '
                         f'"default"' in lines[0])
                assert named and "namespace" in lines[0], (verb, taken, lines[0])
                assert real_writes(kube, before) == [], (verb, taken)   # nothing created, nothing deleted
            else:
                assert code == 0, (verb, taken, err)
                if verb == "job status" and taken == rbac.Permission("get", "", "pods/log", optional=True).of("", ""):
                    used.add(taken)   # optional: status answers and names what it could not read
                    assert 'cannot get resource "pods/log"' in err and "network not read" in err
    # Every permission of the Role is used by some verb (the sampling exec by `job watch`'s default),
    # but those for what a job with DRA claims makes (tests/jobs/test_jobs_kube.py uses them).
    # The job is on no Kueue queue: Kueue's verdict is not read (tests/jobs/test_jobs_kube.py reads it).
    exec_ = {rbac.Permission(v, "", "pods/exec") for v in ("get", "create")}
    verdict = {rbac.Permission("list", "kueue.x-k8s.io", "workloads")}
    # Without reading quotas, a submit still holds each pod to them (its dry run): said, not failed.
    # Nor, on a job that runs, do status and wait need its events (they say why a job waits).
    quotas = {rbac.Permission("list", "", "resourcequotas"), rbac.Permission("list", "", "events"),
              rbac.Permission("get", "kueue.x-k8s.io", "localqueues")}   # (no queue here: none read)
    assert {rbac.Permission(v, g, r) for g, r, v in permissions if r not in unmade} - used == exec_ | verdict | quotas


def test_a_missing_permission_stops_submit_before_anything_is_created(kube, tmp_path, monkeypatch, capsys):
    """The preflight's one line, exactly: each missing verb and resource, the namespace, the Role."""
    rules = role(monkeypatch, capsys, kube.env, "pytorchjob")[0]["rules"]
    no_pvc = [{**r, "verbs": [v for v in r["verbs"] if v != "create"]} if r["resources"] == ["persistentvolumeclaims"]
              else r for r in rules]
    user = kube.user(USER, no_pvc)
    code, out, err = run(monkeypatch, capsys, user, "submit", spec_for(tmp_path, "pytorchjob"))
    assert code == 3 and err.strip().splitlines() == [
        "error: job submit: this user may not create persistentvolumeclaims in namespace default; ask the cluster's "
        "admin to bind the Role `fsdpkit cluster rbac --namespace default --backend pytorchjob` renders"]
    assert real_writes(kube) == []
    code, out, _ = run(monkeypatch, capsys, user, "submit", spec_for(tmp_path, "pytorchjob"), "--json")
    envelope = json.loads(out)
    assert code == 3 and envelope["error"]["code"] == "access_denied"
    assert envelope["error"]["hint"].startswith("ask the cluster's admin to bind the Role")
    # What the API server was asked: one review per permission, in the job's namespace.
    reviews = kube.reviews
    asked = {(r["spec"]["resourceAttributes"]["verb"], r["spec"]["resourceAttributes"]["resource"]) for r in reviews}
    assert ("create", "persistentvolumeclaims") in asked and ("create", "pytorchjobs") in asked
    assert {r["spec"]["resourceAttributes"]["namespace"] for r in reviews} == {"default"}
