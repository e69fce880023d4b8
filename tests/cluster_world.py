"""A cloud and a cluster for tests that run documented command lines end to end, as a user or an
agent would type them: moto in server mode for AWS, kmock as an EKS GPU cluster whose operators and
kubelet a thread plays, a Prometheus with recorded GPU series, `docker` as a stand-in that pushes
into moto's ECR, and `kubectl`/`helm` as stand-ins for the upstream installs (tests/fake_tools.py).

`operators=False` starts the cluster as EKS gives it: nodes and nothing else, so a job kind is
served only once a command installed its operator (kmock serves a CRD's API once it is created)."""

from __future__ import annotations

import os
import re
import shlex
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from fake_tools import FAKE_DOCKER, FAKE_INSTALLER

from conftest import ROOT, KubeMock, run_cli, start_moto, unavailable
from job_specs import GROUP, PLURAL, VERSION, set_conditions
from kube_objects import crd, daemonset, deployment, healthy_eks, hyperpod_operator, node, trainer_v2
from prometheus_server import RecordedPrometheus

IMAGE = "000000000000.dkr.ecr.us-west-2.amazonaws.com/fsdpkit:v1"
SCHEMAS = ROOT.parent / "shared" / "schemas"
# The resources each job operator serves: absent from a bare cluster until the operator is installed.
OPERATOR_RESOURCES = (
    "trainer.kubeflow.org/v1alpha1/trainjobs", "trainer.kubeflow.org/v1alpha1/clustertrainingruntimes",
    "jobset.x-k8s.io/v1alpha2/jobsets", "kubeflow.org/v1/pytorchjobs", "kubeflow.org/v2beta1/mpijobs",
    "sagemaker.amazonaws.com/v1/hyperpodpytorchjobs", "ray.io/v1/rayclusters", "ray.io/v1/rayjobs",
    "kueue.x-k8s.io/v1beta2/localqueues", "kueue.x-k8s.io/v1beta2/workloads", "kueue.x-k8s.io/v1beta2/clusterqueues")


# Lines that change cloud resources run as dry runs: an EKS cluster takes 20-40 min, a file system 10.
# A NodePool too: Karpenter launches GPU nodes from it (and eksctl, which installs Karpenter, runs dry).
DRY_RUN = re.compile(r"^fsdpkit (cluster (create|delete|nodepool)|storage fsx (create|delete|storage-class))\b")


def line_argv(line: str) -> list[str]:
    """A documented line's arguments after `fsdpkit`, with `--dry-run` where it creates cloud resources."""
    argv = shlex.split(line, comments=True)[1:]
    if DRY_RUN.match(line) and "--dry-run" not in argv:
        cut = argv.index("--") if "--" in argv else len(argv)
        argv.insert(cut, "--dry-run")
    return argv


@dataclass
class World:
    root: Path
    env: dict[str, str]
    kube: KubeMock
    volume: Path        # what `/ckpt/` holds, as a helper pod mounting the job's claim sees it
    acted: int = 0      # the requests the operators' thread has acted on (`settle`)
    failure: BaseException | None = None   # what stopped that thread, raised by `settle`

    def settle(self, timeout: float = 30) -> None:
        """Wait until the operators and the kubelet have acted on every request the API server has
        seen: a user's next command comes after the cluster reacted to the last one (a RayCluster's
        head pod is up, a job that ran is finished), as at a person's pace, not in the same
        millisecond as a command that returned in 40 ms."""
        wanted, deadline = self.kube.request_count(), time.monotonic() + timeout
        while self.acted < wanted and self.failure is None:
            assert time.monotonic() < deadline, f"the operators' thread acted on {self.acted} of {wanted} requests"
            time.sleep(0.02)
        if self.failure is not None:
            raise AssertionError("the operators' thread (tests/cluster_world.py) stopped") from self.failure

    def installs(self) -> list[str]:
        """The upstream install commands run so far (kubectl and helm lines), in order."""
        log = self.root / "installs.log"
        return log.read_text().splitlines() if log.exists() else []


@contextmanager
def cluster_world(root: Path, *, operators: bool = True) -> Iterator[World]:
    """The world, torn down on exit. With `operators`, every operator fsdpkit drives is installed
    and a finished two-node PyTorchJob `my-job` is there; without, the cluster is bare EKS."""
    if operators is False and not SCHEMAS.is_dir():
        unavailable(f"the operators' CRDs are in {SCHEMAS}, absent here (the installs create them)")
    server, url, aws_env = start_moto(root)
    prometheus = RecordedPrometheus()
    kube = KubeMock(root)
    # A kubeconfig with a second context of the same cluster, as `aws eks update-kubeconfig` adds.
    kube.kubeconfig.write_text(kube.kubeconfig.read_text().replace(
        "contexts: [", "contexts: [{name: my-eks, context: {cluster: kmock, user: tester}}, "))
    bin_dir = root / "bin"
    bin_dir.mkdir()
    (bin_dir / "docker").write_text(FAKE_DOCKER.format(python=sys.executable))
    for tool in ("kubectl", "helm"):  # the upstream installers `addons install` and `check --fix` run
        (bin_dir / tool).write_text(FAKE_INSTALLER.format(python=sys.executable, schemas=str(SCHEMAS)))
    for tool in ("docker", "kubectl", "helm"):
        (bin_dir / tool).chmod(0o755)
    env = {**aws_env, "HOME": str(root / "home"),
           "FSDPKIT_HOME": str(root / "fsdpkit-home"), "HF_HUB_OFFLINE": "1", "FSDPKIT_PROMETHEUS_URL": prometheus.url,
           "MLFLOW_TRACKING_URI": f"file:{root / 'mlruns'}", "FSDPKIT_TEST_INSTALLS": str(root / "installs.log"),
           "PATH": f"{bin_dir}:{os.path.dirname(sys.executable)}:/usr/bin:/bin", **kube.env}
    world = World(root, env, kube, root / "volume")
    world.volume.mkdir()
    if operators:
        _with_operators(kube)
    else:
        for resource in OPERATOR_RESOURCES:
            kube.forget(resource)
        kube.create("/api/v1/nodes", node("gpu-a", "p5.48xlarge", 8, 32))
        kube.create("/api/v1/nodes", node("gpu-b", "p5.48xlarge", 8, 32))
        kube.create("/api/v1/nodes", node("sys", "m5.xlarge", cpu="3920m", memory="15Gi"))
    kube.create("/api/v1/namespaces/default/persistentvolumeclaims",
                {"apiVersion": "v1", "kind": "PersistentVolumeClaim", "metadata": {"name": "fsx-claim"},
                 "spec": {"accessModes": ["ReadWriteMany"], "resources": {"requests": {"storage": "1200Gi"}}}})
    # EKS clusters the documents name, as DescribeCluster sees them.
    import boto3

    session = boto3.Session(aws_access_key_id="testing", aws_secret_access_key="testing", region_name="us-west-2")
    role = session.client("iam", endpoint_url=url).create_role(RoleName="eks", AssumeRolePolicyDocument="{}")
    for name in ("my-cluster", "llm"):
        session.client("eks", endpoint_url=url).create_cluster(
            name=name, roleArn=role["Role"]["Arn"], resourcesVpcConfig={"subnetIds": ["subnet-1"]})
    kube.serve_exec(_head_exec)
    stop = threading.Event()
    kubelet = threading.Thread(target=_kubelet, args=(world, stop), daemon=True)
    kubelet.start()
    if operators:
        _running_job(world)
    try:
        yield world
    finally:
        stop.set()
        kubelet.join(10)
        kube.close()
        prometheus.close()
        server.stop()


def _with_operators(kube: KubeMock) -> None:
    healthy_eks(kube)
    # The device plugins as `fsdpkit cluster addons install` names them, already running.
    kube.create("/apis/apps/v1/namespaces/kube-system/daemonsets",
                daemonset("nvidia-device-plugin-daemonset", "kube-system", {"name": "nvidia-device-plugin-ds"}))
    trainer_v2(kube)
    hyperpod_operator(kube)
    kube.create("/apis/apiextensions.k8s.io/v1/customresourcedefinitions", crd("rayclusters.ray.io"))
    kube.create("/apis/apps/v1/namespaces/kuberay/deployments",
                deployment("kuberay-operator", "kuberay", {"app.kubernetes.io/name": "kuberay-operator"}))


def _running_job(world: World) -> None:
    """`my-job`: a PyTorchJob of two nodes the operator ran to the end (its pods are the kubelet's)."""
    spec = world.root / "my-job.yaml"
    spec.write_text(f"name: my-job\nbackend: pytorchjob\nimage: {IMAGE}\ninstance_type: p5.48xlarge\nnodes: 2\n"
                    "storage: {claim: fsx-claim}\ntrain: {preset: tiny, max_steps: 100}\n")
    r = run_cli("job", "submit", str(spec), "--json", env=world.env, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    from kubernetes import client

    set_conditions(world.kube, "my-job", "Created", "Running", "Succeeded")
    client.CustomObjectsApi(world.kube.api()).patch_namespaced_custom_object_status(
        GROUP, VERSION, "default", PLURAL, "my-job",
        {"status": {"startTime": "2026-11-24T09:00:00Z", "completionTime": "2026-11-24T10:00:00Z"}})


# The condition each job operator sets on a job that finished well.
FINISHED = {"pytorchjobs": ("kubeflow.org", "v1", ["Created", "Running", "Succeeded"]),
            "trainjobs": ("trainer.kubeflow.org", "v1alpha1", ["Complete"]),
            "hyperpodpytorchjobs": ("sagemaker.amazonaws.com", "v1", ["Created", "Running", "Completed"])}
TRAINING_LOG = (b"fsdpkit: network: efa (NCCL 2.21.5, aws-ofi-nccl 1.14.0, provider efa, 32 NICs)\n"
                b"Batch 100 Loss: 2.10000, Speed: 1000.00 samples/sec, lr: 0.000300\n")


RAY_STATUS = (b"======== Autoscaler status ========\nActive:\n 1 head\n 2 worker\n"
              b"Usage:\n 0.0/384.0 CPU\n 0.0/16.0 GPU\n")


async def _head_exec(pod: str, container: str, command: list[str]) -> tuple[bytes, int]:
    """A Ray head's container answering `ray status`; any other command is not found there."""
    if container == "ray-head" and command == ["ray", "status"]:
        return RAY_STATUS, 0
    return f"sh: {command[0] if command else ''}: not found\n".encode(), 127


def _kubelet(world: World, stop: threading.Event) -> None:
    """Plays the job operators and the kubelet: a job that is created runs and succeeds (a
    PyTorchJob's pods with their logs); a helper pod of fsdpkit's (`ckpt ... --pvc`) runs its own
    `fsdpkit ckpt` command here, on `world.volume` standing in for the volume, and serves what it
    printed as the pod's log."""
    from kubernetes import client

    kube = world.kube
    core, custom = client.CoreV1Api(kube.api()), client.CustomObjectsApi(kube.api())
    try:
        _operate(world, kube, core, custom, stop)
    except BaseException as e:   # raised in the test by World.settle, not lost with the thread
        world.failure = e


def _operate(world: World, kube: KubeMock, core, custom, stop: threading.Event) -> None:
    seen = 0
    while not stop.wait(0.05):
        requests = kube.requests(seen)
        for method, path, body in requests:
            if method != "POST" or not isinstance(body, dict) or "dryRun=" in path:
                continue
            plural = path.split("?")[0].rsplit("/", 1)[-1]
            name = (body.get("metadata") or {}).get("name")
            if plural == "pytorchjobs":
                _pods(kube, core, name, body)
            if plural in FINISHED:
                group, version, types = FINISHED[plural]
                conditions = [{"type": t, "status": "True" if i == len(types) - 1 else "False", "reason": t,
                               "message": f"{name} is {t.lower()}", "lastTransitionTime": f"2026-11-24T10:00:0{i}Z"}
                              for i, t in enumerate(types)]
                custom.patch_namespaced_custom_object_status(group, version, "default", plural, name,
                                                             {"status": {"conditions": conditions}})
            command = (body.get("spec") or {}).get("containers", [{}])[0].get("command") or []
            if plural == "pods" and name.startswith("fsdpkit-gpu"):  # nvidia-smi -L on a node with 8 GPUs
                kube.route(f"get /api/v1/namespaces/default/pods/{name}/log", "".join(
                    f"GPU {i}: NVIDIA H100 80GB HBM3 (UUID: GPU-{i:08x}-aaaa)\n" for i in range(8)).encode())
                core.patch_namespaced_pod_status(name, "default", {"status": {"phase": "Succeeded"}})
            if plural == "mpijobs":  # the MPI operator's launcher, with what nccl-tests printed over EFA
                launcher = f"{name}-launcher"
                kube.route(f"get /api/v1/namespaces/default/pods/{launcher}/log",
                           (ROOT / "tests" / "data" / "nccl" / "p5-2node-efa.log").read_bytes())
                labels = {"training.kubeflow.org/job-name": name, "training.kubeflow.org/job-role": "launcher"}
                kube.create("/api/v1/namespaces/default/pods", {
                    "apiVersion": "v1", "kind": "Pod",
                    "metadata": {"name": launcher, "namespace": "default", "labels": labels},
                    "spec": {"containers": [{"name": "launcher", "image": "x"}]}, "status": {"phase": "Succeeded"}})
            if plural == "rayclusters":   # KubeRay's head pod, up (`ray exec` runs on it)
                kube.create("/api/v1/namespaces/default/pods", {
                    "apiVersion": "v1", "kind": "Pod",
                    "metadata": {"name": f"{name}-head", "namespace": "default",
                                 "labels": {"ray.io/cluster": name, "ray.io/node-type": "head"}},
                    "spec": {"containers": [{"name": "ray-head", "image": IMAGE}]}, "status": {"phase": "Running"}})
            if plural == "pods" and command[:4] == ["python", "-m", "fsdpkit", "ckpt"]:
                argv = [a.replace("/ckpt/", f"{world.volume}/") for a in command[3:]]
                out = run_cli(*argv, env=world.env).stdout
                kube.route(f"get /api/v1/namespaces/default/pods/{name}/log", out.encode())
                core.patch_namespaced_pod_status(name, "default", {"status": {"phase": "Succeeded"}})
        seen += len(requests)
        world.acted = seen


def _pods(kube: KubeMock, core, name: str, job: dict) -> None:
    from kubernetes import client

    """The training operator's pods of a PyTorchJob (one per replica, named as it names them), run
    to completion, each with a training log."""
    for rtype, replica in job["spec"]["pytorchReplicaSpecs"].items():
        for index in range(replica.get("replicas", 1)):
            pod = f"{name}-{rtype.lower()}-{index}"
            try:   # a job submitted again: its former pods go with the former job
                core.delete_namespaced_pod(pod, "default")
            except client.ApiException as e:
                if e.status != 404:
                    raise
            core.create_namespaced_pod("default", {
                "apiVersion": "v1", "kind": "Pod",
                "metadata": {"name": pod, "namespace": "default", "labels": {
                    "training.kubeflow.org/job-name": name, "training.kubeflow.org/replica-type": rtype.lower(),
                    "training.kubeflow.org/replica-index": str(index)}},
                "spec": {"containers": [{"name": "pytorch", "image": IMAGE}]},
                "status": {"phase": "Succeeded", "containerStatuses": [
                    {"name": "pytorch", "ready": False, "restartCount": 0, "image": IMAGE, "imageID": "",
                     "state": {"terminated": {"exitCode": 0, "reason": "Completed"}}}]}})
            kube.route(f"get /api/v1/namespaces/default/pods/{pod}/log", TRAINING_LOG)
