"""KubeRay: RayCluster and RayJob manifests against the real CRD schemas; `ray create` twice makes one
cluster, a different spec under the same name is refused, and the head's readiness is awaited."""

from __future__ import annotations

import json
import threading
import time

import pytest
import yaml
from ports import free_port

from fsdpkit.jobs.ray import raycluster_manifest, rayjob_manifest
from fsdpkit.jobs.resolved import load_job

from conftest import cli_here, require
from kube_admission import PodAdmission
from manifest_schemas import IMAGE, crd_validator, pod_of, validate_builtin

require("kmock")


def spec(**extra):
    doc = {"name": "verl", "backend": "pytorchjob", "image": IMAGE, "instance_type": "p5.48xlarge", "nodes": 2,
           "storage": {"claim": "fsx-claim"}, "command": ["unused"], **extra}
    return load_job(None, list(doc.items()))


@pytest.mark.parametrize("nodes", ["1", "2", "2:4"])
def test_raycluster_and_rayjob_validate_against_kuberay_schemas(nodes):
    cluster = raycluster_manifest(spec(nodes=nodes))
    errors = [f"{list(e.absolute_path)}: {e.message}" for e in crd_validator("ray.io_rayclusters.yaml")
              .iter_errors(cluster)]
    assert not errors, errors[:5]
    head, group = cluster["spec"]["headGroupSpec"], cluster["spec"]["workerGroupSpecs"][0]
    # Every rayStartParams value is a string (KubeRay rejects ints such as metrics-export-port: 8080).
    assert all(isinstance(v, str) for v in {**head["rayStartParams"], **group["rayStartParams"]}.values())
    assert group["rayStartParams"]["num-gpus"] == "8"
    worker = group["template"]["spec"]
    assert worker["containers"][0]["resources"]["limits"] == {"nvidia.com/gpu": 8, "vpc.amazonaws.com/efa": 32}
    assert {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": "64Gi"}} in worker["volumes"]
    assert "resources" not in head["template"]["spec"]["containers"][0] or \
        "nvidia.com/gpu" not in head["template"]["spec"]["containers"][0]["resources"].get("limits", {})
    for template in (head["template"], group["template"]):
        validate_builtin(pod_of(template))
    job = rayjob_manifest(spec(nodes=nodes).spec, "python -m verl.trainer.main_ppo", "grpo-1", entrypoint_gpus=1)
    assert not list(crd_validator("ray.io_rayjobs.yaml").iter_errors(job))
    assert job["spec"]["entrypointNumGpus"] == 1 and job["spec"]["clusterSelector"] == {"ray.io/cluster": "verl"}


def test_a_raycluster_on_hyperpod_schedules_like_hyperpods_jobs(tmp_path):
    """From a HyperPod spec: healthy nodes only, deep-health-checked ones preferred, the workers in
    the spec's instance group (the CPU head anywhere), and the `ml.` instance type as HyperPod labels it."""
    path = write(tmp_path, backend="hyperpod", hyperpod={"instance_group": "gpu-workers"})
    r = cli_here("ray", "create", str(path), "--dry-run", "--json")
    assert r.returncode == 0, r.stderr
    cluster = json.loads(r.stdout)["data"]["manifest"]
    assert not list(crd_validator("ray.io_rayclusters.yaml").iter_errors(cluster))
    head = cluster["spec"]["headGroupSpec"]["template"]["spec"]
    worker = cluster["spec"]["workerGroupSpecs"][0]["template"]["spec"]
    for pod in (head, worker):
        node = pod["affinity"]["nodeAffinity"]
        required = node["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"][0]["matchExpressions"]
        assert {"key": "sagemaker.amazonaws.com/node-health-status", "operator": "In",
                "values": ["Schedulable"]} in required
        preferred = node["preferredDuringSchedulingIgnoredDuringExecution"][0]["preference"]["matchExpressions"]
        assert preferred == [{"key": "sagemaker.amazonaws.com/deep-health-check-status", "operator": "In",
                              "values": ["Passed"]}]
    assert worker["nodeSelector"] == {"node.kubernetes.io/instance-type": "ml.p5.48xlarge",
                                      "sagemaker.amazonaws.com/instance-group-name": "gpu-workers"}
    assert "sagemaker.amazonaws.com/instance-group-name" not in head.get("nodeSelector", {})
    # Any other spec's RayCluster has no HyperPod rules.
    plain = raycluster_manifest(spec())
    assert "affinity" not in plain["spec"]["workerGroupSpecs"][0]["template"]["spec"]


def write(tmp_path, **extra):
    doc = {"name": "verl", "image": IMAGE, "instance_type": "p5.48xlarge", "nodes": 2, **extra}
    path = tmp_path / "ray.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


def test_ray_up_twice_makes_one_cluster_and_waits_for_the_head(kube, tmp_path):
    path = write(tmp_path)
    from kubernetes import client

    api = client.CustomObjectsApi(kube.api())

    def operator():  # KubeRay marks the cluster ready once the head pod runs, a moment after it exists
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                api.get_namespaced_custom_object("ray.io", "v1", "default", "rayclusters", "verl")
                time.sleep(1.5)
                api.patch_namespaced_custom_object_status("ray.io", "v1", "default", "rayclusters", "verl",
                                                          {"status": {"state": "ready"}})
                return
            except client.ApiException:
                time.sleep(0.3)
    t = threading.Thread(target=operator)
    t.start()
    r = cli_here("ray", "create", str(path), "--timeout", "1m", "--poll", "0.2", "--json", env=kube.env)
    t.join()
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["data"] == {"name": "verl", "namespace": "default", "action": "created",
                                            "state": "ready"}
    assert r.stderr.splitlines() == ["waiting for RayCluster verl to be ready (state pending, 0 s of 60)"]
    r = cli_here("ray", "create", str(path), "--json", env=kube.env)
    assert r.returncode == 0 and json.loads(r.stdout)["data"]["action"] == "reused"
    posts = [p for m, p, _ in kube.requests() if m == "POST"]
    assert posts == ["/apis/ray.io/v1/namespaces/default/rayclusters?fieldValidation=Strict"]

    r = cli_here("ray", "create", str(write(tmp_path, nodes=4)), env=kube.env)
    assert r.returncode == 2
    assert "RayCluster 'verl' already exists in default with a different spec" in r.stderr
    assert [p for m, p, _ in kube.requests() if m == "POST"] == posts

    # VERL's resource pool against the cluster's workers (2 x 8 GPUs): 4 nodes of 8 would wait for ever,
    # 16 a node fit no worker; refused before a RayJob is made. Fewer than the workers hold: a warning.
    verl = ["python", "-m", "verl.trainer.main_ppo", "trainer.n_gpus_per_node=8"]
    for extra, says in ((["trainer.nnodes=4"], "VERL asks 4 x 8 = 32 GPUs, and RayCluster verl's workers hold 16: "
                                               "it would wait for them for ever; set trainer.nnodes and "
                                               "trainer.n_gpus_per_node to fit RayCluster verl's workers (2 "
                                               "worker(s) x 8 GPUs)"),
                        (["trainer.n_gpus_per_node=16"], "VERL asks trainer.n_gpus_per_node=16, and no worker of "
                                                         "RayCluster verl has more than 8 GPUs")):
        r = cli_here("ray", "submit", str(path), "--job-name", "grpo", "--", *verl, *extra, env=kube.env)
        assert r.returncode == 2 and r.stderr.startswith(f"error: ray submit: {says}"), r.stderr
        assert r.stderr.count("\n") == 1
    assert not [p for m, p, _ in kube.requests() if m == "POST" and "rayjobs" in p]
    # The dry run asks no cluster: the workers `ray create` makes of the spec (2 p5 nodes) stand for its.
    r = cli_here("ray", "submit", str(write(tmp_path)), "--job-name", "one-node", "--dry-run", "--", *verl,
                 "trainer.nnodes=1")
    assert r.returncode == 0 and r.stderr == ("warning: ray submit: VERL uses 8 of the 16 GPUs of RayCluster verl's "
                                              "workers\n")
    r = cli_here("ray", "submit", str(path), "--job-name", "grpo", "--entrypoint-gpus", "1", "--json", "--",
                 "python", "-m", "verl.trainer.main_ppo", env=kube.env)
    assert r.returncode == 0, r.stderr
    job = next(b for m, p, b in kube.requests() if m == "POST" and p.split("?")[0].endswith("/rayjobs"))
    assert job["spec"]["entrypoint"] == "python -m verl.trainer.main_ppo" and job["spec"]["entrypointNumGpus"] == 1

    # Another cluster's RayJob (kmock ignores label selectors: the labels and clusterSelector are checked too).
    kube.create("/apis/ray.io/v1/namespaces/default/rayjobs", {
        "apiVersion": "ray.io/v1", "kind": "RayJob", "metadata": {"name": "theirs", "labels": job["metadata"][
            "labels"]}, "spec": {"entrypoint": "x", "clusterSelector": {"ray.io/cluster": "other"}}})
    r = cli_here("ray", "delete", "verl", "--dry-run", "--json", env=kube.env)
    assert r.returncode == 0 and json.loads(r.stdout)["data"]["would_delete"] == ["RayJob/grpo", "RayCluster/verl"]
    r = cli_here("ray", "delete", "verl", env=kube.env)   # nobody at a terminal to ask, and no --yes
    assert (r.returncode, r.stderr) == (2, "error: delete: removes RayJob/grpo, RayCluster/verl; add --yes to "
                                           "confirm\n")
    assert not [p for m, p, _ in kube.requests() if m == "DELETE"]
    r = cli_here("ray", "delete", "verl", "--yes", "--json", env=kube.env)
    assert r.returncode == 0 and json.loads(r.stdout)["data"]["deleted"] == ["RayJob/grpo", "RayCluster/verl"]
    assert [p for m, p, _ in kube.requests() if m == "DELETE"] == [
        "/apis/ray.io/v1/namespaces/default/rayjobs/grpo", "/apis/ray.io/v1/namespaces/default/rayclusters/verl"]
    assert cli_here("ray", "status", "verl", env=kube.env).returncode == 2


def test_ray_create_names_its_cluster_and_exec_on_a_missing_one_says_so(kube, tmp_path):
    """`--name` makes a second cluster from the same spec (the spec's name is the default); `ray exec`
    on a cluster that does not exist says it does not exist, not that its head is not up yet."""
    path = write(tmp_path)
    r = cli_here("ray", "create", str(path), "--name", "verl-b", "--dry-run", "--json", env=kube.env)
    assert r.returncode == 0 and json.loads(r.stdout)["data"]["manifest"]["metadata"]["name"] == "verl-b"
    r = cli_here("ray", "create", str(path), "--name", "verl-b", "--json", env=kube.env)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["data"]["name"] == "verl-b"
    assert [p for m, p, b in kube.requests() if m == "POST" and b["metadata"]["name"] == "verl-b"] == [
        "/apis/ray.io/v1/namespaces/default/rayclusters?fieldValidation=Strict"]
    r = cli_here("ray", "submit", str(path), "--name", "verl-b", "--dry-run", "--json", "--", "python", "x.py",
                 env=kube.env)
    assert json.loads(r.stdout)["data"]["manifest"]["spec"]["clusterSelector"] == {"ray.io/cluster": "verl-b"}
    r = cli_here("ray", "exec", "nope", "--", "ray", "status", env=kube.env)
    assert (r.returncode, r.stderr) == (2, "error: RayCluster 'nope' not found in namespace default; create it with "
                                           "`fsdpkit ray create SPEC`, or see `kubectl get rayclusters -A`\n")
    r = cli_here("ray", "exec", "verl-b", "--", "ray", "status", env=kube.env)   # made, its head not up yet
    assert (r.returncode, r.stderr) == (2, "error: RayCluster 'verl-b' has no head pod yet (fsdpkit ray status "
                                           "verl-b)\n")


def test_ray_create_server_dry_run_sends_the_head_and_each_group_s_pod_through_admission(kube, tmp_path):
    """KubeRay's pods meet admission the RayCluster never meets: a namespace enforcing Pod Security's
    restricted refuses the head's pod in one line; restricted pods pass; nothing is stored."""
    from kubernetes import client

    kube.pod_admission = PodAdmission(enforce={"default": "restricted"})
    path = write(tmp_path)
    r = cli_here("ray", "create", str(path), "--dry-run=server", env=kube.env)
    assert r.returncode == 3
    assert r.stderr.startswith('error: server dry run of Pod/verl-head-0 (a pod of RayCluster verl: head): refused by '
                               'Pod Security admission (the namespace enforces "restricted:latest"): unrestricted '
                               'capabilities (container "ray-head" must set')
    r = cli_here("ray", "create", str(path), "--dry-run=server", "--set", "security=restricted", "--json", env=kube.env)
    assert r.returncode == 0, r.stdout
    assert json.loads(r.stdout)["data"]["accepted"] == ["RayCluster/verl", "Pod/verl-head-0", "Pod/verl-gpu-0"]
    assert [p for p, _ in kube.dry_runs] == [
        "/apis/ray.io/v1/namespaces/default/rayclusters?dryRun=All&fieldValidation=Strict",
        "/apis/ray.io/v1/namespaces/default/rayclusters?dryRun=All&fieldValidation=Strict",
        "/api/v1/namespaces/default/pods?dryRun=All&fieldValidation=Strict",
        "/api/v1/namespaces/default/pods?dryRun=All&fieldValidation=Strict"]
    assert [m for m, _, _ in kube.requests() if m != "GET"] == []
    assert client.CustomObjectsApi(kube.api()).list_namespaced_custom_object(
        "ray.io", "v1", "default", "rayclusters")["items"] == []


def test_ray_submit_dry_run_prints_the_rayjob_without_a_cluster(tmp_path):
    path = write(tmp_path)
    r = cli_here("ray", "submit", str(path), "--job-name", "grpo", "--dry-run", "--", "python3", "-m", "verl.x",
                 "trainer.logger=['console']", env={"KUBECONFIG": str(tmp_path / "none")})
    assert r.returncode == 0, r.stderr
    (job,) = yaml.safe_load_all(r.stdout)
    assert not list(crd_validator("ray.io_rayjobs.yaml").iter_errors(job))
    assert job["metadata"]["name"] == "grpo" and job["spec"]["clusterSelector"] == {"ray.io/cluster": "verl"}
    assert job["spec"]["entrypoint"] == "python3 -m verl.x 'trainer.logger=['\"'\"'console'\"'\"']'"


def refused(user: str, verb: str, resource: str, name: str = "") -> str:
    """The API server's 403, as the ray verbs pass it on after naming their call."""
    what = f'{resource}.ray.io "{name}"' if name else f"{resource}.ray.io"
    return (f'the cluster refused (403 Forbidden): {what} is forbidden: User "{user}" cannot {verb} resource '
            f'"{resource}" in API group "ray.io" in the namespace "default"; check your kubeconfig credentials and '
            "RBAC permissions\n")


def test_each_ray_verb_says_which_call_the_cluster_refused_or_could_not_answer(kube, tmp_path):
    """On a shared cluster, as a namespace's Role allows: each verb names the call that failed and
    passes on the API server's words; a cluster that does not answer is named by its address; a
    cluster without KubeRay's CRD, a RayCluster that is not there, say so."""
    path = write(tmp_path)
    pods_only = kube.user("alice", [{"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list"]}])
    r = cli_here("ray", "status", "verl", env=pods_only)
    assert (r.returncode, r.stderr) == (3, "error: reading rayclusters/verl: " + refused("alice", "get", "rayclusters",
                                                                                       "verl"))
    r = cli_here("ray", "create", str(path), "--dry-run=server", env=pods_only)
    assert (r.returncode, r.stderr) == (3, "error: server dry run of RayCluster/verl: " + refused(
        "alice", "create", "rayclusters"))
    reader = kube.user("bob", [{"apiGroups": ["ray.io"], "resources": ["rayclusters"], "verbs": ["get", "delete"]}])
    r = cli_here("ray", "create", str(path), env=reader)
    assert (r.returncode, r.stderr) == (3, "error: creating RayCluster/verl: " + refused("bob", "create",
                                                                                        "rayclusters"))
    assert cli_here("ray", "create", str(path), env=kube.env).returncode == 0
    r = cli_here("ray", "delete", "verl", "--yes", env=reader)
    assert (r.returncode, r.stderr) == (3, "error: listing RayJobs: " + refused("bob", "list", "rayjobs"))
    lister = kube.user("carol", [{"apiGroups": ["ray.io"], "resources": ["rayclusters"], "verbs": ["get"]},
                                 {"apiGroups": ["ray.io"], "resources": ["rayjobs"], "verbs": ["list"]}])
    r = cli_here("ray", "delete", "verl", "--yes", env=lister)
    assert (r.returncode, r.stderr) == (3, "error: deleting rayclusters/verl: " + refused("carol", "delete",
                                                                                         "rayclusters", "verl"))
    port = free_port()
    dead = tmp_path / "dead-kubeconfig"
    dead.write_text(kube.kubeconfig.read_text().replace(kube.url, f"http://127.0.0.1:{port}"))
    for argv in (("ray", "status", "verl"), ("ray", "delete", "verl", "--yes")):
        r = cli_here(*argv, env={"KUBECONFIG": str(dead)})
        assert (r.returncode, r.stderr) == (3, f"error: reading rayclusters/verl: cannot reach the Kubernetes API at "
                                               f"http://127.0.0.1:{port} (MaxRetryError); check the kubeconfig context "
                                               "and your network or VPN\n")
    r = cli_here("ray", "delete", "gone", "--yes", env=kube.env)
    assert (r.returncode, r.stderr) == (2, "error: RayCluster 'gone' not found in namespace default\n")
    r = cli_here("ray", "submit", str(write(tmp_path, name="gone")), "--", "python", "x.py", env=kube.env)
    assert (r.returncode, r.stderr) == (2, "error: RayCluster 'gone' not found in namespace default; start it with "
                                           "`fsdpkit ray create`\n")
    kube.forget("ray.io/v1/rayclusters")
    r = cli_here("ray", "create", str(path), env=kube.env)
    assert (r.returncode, r.stderr) == (3, "error: creating RayCluster: the ray.io/v1 CRD is not installed; install "
                                           "the KubeRay operator (see `fsdpkit cluster check`)\n")
