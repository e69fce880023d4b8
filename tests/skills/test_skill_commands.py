"""Every command line of every SKILL.md runs as written, in order, in a folder of the skill's own,
as an agent following it would: local commands on this machine; cluster commands against kmock,
scripted as a healthy EKS cluster whose operators and kubelet the test plays; AWS commands against
moto in server mode; `docker` as a stand-in that pushes into moto's ECR. A line that creates cloud
resources runs with `--dry-run` where it has one (and must still succeed). Each must succeed with
`ok: true`, unless EXPECT says what the skill documents instead. A skill that names a missing file
or a flag that fails, fails here."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from doc_commands import command_lines
from fake_tools import FAKE_DOCKER

from conftest import ROOT, KubeMock, require, run_cli, start_moto
from finetune_fixtures import chat_records, local_task, tiny_qwen
from job_specs import GROUP, PLURAL, VERSION, set_conditions
from kube_objects import crd, daemonset, deployment, healthy_eks, hyperpod_operator, trainer_v2
from prometheus_server import RecordedPrometheus

pytestmark = pytest.mark.slow
require("kmock")
require("moto.server")

SKILLS = sorted((ROOT / "src" / "fsdpkit" / "skills" / "data").glob("*/SKILL.md"))
LINES = [(p.parent.name, line) for p in SKILLS for line in command_lines(p)]

# Lines that change cloud resources run as dry runs: an EKS cluster takes 20-40 min, a file system 10.
DRY_RUN = re.compile(r"^fsdpkit (cluster (create|delete)|storage fsx (create|delete|storage-class))\b")
# What a skill documents other than success: (exit code, a piece of the error message or output).
EXPECT = {
    # The EKS cluster is found by name (moto's EKS answers with its endpoint and CA), but its API
    # endpoint is in no network reachable from here.
    r"^fsdpkit cluster check --eks-cluster": (3, "cannot reach the Kubernetes API"),
    # moto's EKS reports no cluster security group (every real EKS cluster has one): the command
    # names the flag that gives it.
    r"^fsdpkit storage fsx storage-class .* --eks-cluster llm": (2, "has no cluster security group; give "
                                                                    "--security-group-id"),
    # `storage fsx create` ran as a dry run above: there is no file system to show, and it says how to make one.
    r"^fsdpkit storage fsx status ckpt": (2, "no FSx file system named 'ckpt' (fsdpkit storage fsx create ckpt"),
    # The recorded DCGM series hold one node at about 58% against the others' 95%: the skill says
    # what a straggler finding means.
    r"^fsdpkit metrics my-job": (1, "straggler"),
    # The 70B on one p5 does not fit: the skill shows the plan that fails, with the change as its hint.
    r"^fsdpkit plan --preset llama3_1_70b --instance-type p5.48xlarge --nodes 1 --json": (1, "plan again with"),
}
IMAGE = "000000000000.dkr.ecr.us-west-2.amazonaws.com/fsdpkit:v1"


def test_every_skill_line_is_covered():
    assert len(LINES) >= 70 and {s for s, _ in LINES} == {p.parent.name for p in SKILLS}


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """moto with fsdpkit's build infrastructure, kmock as a cluster with every operator fsdpkit
    drives, a running job `my-job`, a Prometheus with its GPUs' series, a fake `docker`, and the
    environment that reaches them."""
    root = tmp_path_factory.mktemp("world")
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
        (bin_dir / tool).write_text(f"#!/bin/sh\necho {tool} \"$@\" >> {root}/installers.log\n")
    for tool in ("docker", "kubectl", "helm"):
        (bin_dir / tool).chmod(0o755)
    env = {**aws_env, "HOME": str(root / "home"),
           "FSDPKIT_HOME": str(root / "fsdpkit-home"), "HF_HUB_OFFLINE": "1", "FSDPKIT_PROMETHEUS_URL": prometheus.url,
           "MLFLOW_TRACKING_URI": f"file:{root / 'mlruns'}",
           "PATH": f"{bin_dir}:{os.path.dirname(sys.executable)}:/usr/bin:/bin", **kube.env}
    healthy_eks(kube)
    # The device plugins as `fsdpkit cluster addons install` names them, already running.
    kube.create("/apis/apps/v1/namespaces/kube-system/daemonsets",
                daemonset("nvidia-device-plugin-daemonset", "kube-system", {"name": "nvidia-device-plugin-ds"}))
    trainer_v2(kube)
    hyperpod_operator(kube)
    kube.create("/apis/apiextensions.k8s.io/v1/customresourcedefinitions", crd("rayclusters.ray.io"))
    kube.create("/apis/apps/v1/namespaces/kuberay/deployments",
                deployment("kuberay-operator", "kuberay", {"app.kubernetes.io/name": "kuberay-operator"}))
    kube.create("/api/v1/namespaces/default/persistentvolumeclaims",
                {"apiVersion": "v1", "kind": "PersistentVolumeClaim", "metadata": {"name": "fsx-claim"},
                 "spec": {"accessModes": ["ReadWriteMany"], "resources": {"requests": {"storage": "1200Gi"}}}})
    # EKS clusters the skills name, as DescribeCluster sees them.
    import boto3

    session = boto3.Session(aws_access_key_id="testing", aws_secret_access_key="testing", region_name="us-west-2")
    role = session.client("iam", endpoint_url=url).create_role(RoleName="eks", AssumeRolePolicyDocument="{}")
    for name in ("my-cluster", "llm"):
        session.client("eks", endpoint_url=url).create_cluster(
            name=name, roleArn=role["Role"]["Arn"], resourcesVpcConfig={"subnetIds": ["subnet-1"]})
    _running_job(kube, root, env)
    stop = threading.Event()
    kubelet = threading.Thread(target=_kubelet, args=(kube, root, env, stop), daemon=True)
    kubelet.start()
    yield root, env, kube
    stop.set()
    kubelet.join(10)
    kube.close()
    prometheus.close()
    server.stop()


def _running_job(kube, root: Path, env: dict) -> None:
    """`my-job`: a PyTorchJob of two nodes the operator runs and finishes, with its pods and logs."""
    spec = root / "my-job.yaml"
    spec.write_text(f"name: my-job\nbackend: pytorchjob\nimage: {IMAGE}\ninstance_type: p5.48xlarge\nnodes: 2\n"
                    "storage: {claim: fsx-claim}\ntrain: {preset: tiny, max_steps: 100}\n")
    r = run_cli("job", "submit", str(spec), "--json", env=env, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    from kubernetes import client

    core = client.CoreV1Api(kube.api())
    for rtype, index in (("master", 0), ("worker", 0), ("worker", 1)):
        name = f"my-job-{rtype}-{index}"
        core.create_namespaced_pod("default", {
            "apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "namespace": "default", "labels": {
                "training.kubeflow.org/job-name": "my-job", "training.kubeflow.org/replica-type": rtype,
                "training.kubeflow.org/replica-index": str(index)}},
            "spec": {"containers": [{"name": "pytorch", "image": IMAGE}]},
            "status": {"phase": "Succeeded", "containerStatuses": [
                {"name": "pytorch", "ready": False, "restartCount": 0, "image": IMAGE, "imageID": "",
                 "state": {"terminated": {"exitCode": 0, "reason": "Completed"}}}]}})
        kube.route(f"get /api/v1/namespaces/default/pods/{name}/log",
                   b"fsdpkit: network: efa (NCCL 2.21.5, aws-ofi-nccl 1.14.0, provider efa, 32 NICs)\n"
                   b"Batch 100 Loss: 2.10000, Speed: 1000.00 samples/sec, lr: 0.000300\n")
    set_conditions(kube, "my-job", "Created", "Running", "Succeeded")
    client.CustomObjectsApi(kube.api()).patch_namespaced_custom_object_status(
        GROUP, VERSION, "default", PLURAL, "my-job",
        {"status": {"startTime": "2026-11-24T09:00:00Z", "completionTime": "2026-11-24T10:00:00Z"}})


# The condition each job operator sets on a job that finished well.
FINISHED = {"pytorchjobs": ("kubeflow.org", "v1", ["Created", "Running", "Succeeded"]),
            "trainjobs": ("trainer.kubeflow.org", "v1alpha1", ["Complete"]),
            "hyperpodpytorchjobs": ("sagemaker.amazonaws.com", "v1", ["Created", "Running", "Completed"])}


def _kubelet(kube, root: Path, env: dict, stop: threading.Event) -> None:
    """Plays the job operators and the kubelet: a job that is created runs and succeeds; a helper
    pod of fsdpkit's (`ckpt ... --pvc`) runs its own `fsdpkit ckpt` command here, on the checkpoints
    skill's folder standing in for the volume, and serves what it printed as the pod's log."""
    from kubernetes import client

    core, custom = client.CoreV1Api(kube.api()), client.CustomObjectsApi(kube.api())
    seen = 0
    while not stop.wait(0.1):
        requests = kube.requests()
        for method, path, body in requests[seen:]:
            if method != "POST" or not isinstance(body, dict):
                continue
            plural = path.split("?")[0].rsplit("/", 1)[-1]
            name = (body.get("metadata") or {}).get("name")
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
            if plural == "pods" and command[:4] == ["python", "-m", "fsdpkit", "ckpt"]:
                volume = root.parent / "fsdpkit-checkpoints" / "volume"
                argv = [a.replace("/ckpt/", f"{volume}/") for a in command[3:]]
                out = run_cli(*argv, env=env).stdout
                kube.route(f"get /api/v1/namespaces/default/pods/{name}/log", out.encode())
                core.patch_namespaced_pod_status(name, "default", {"status": {"phase": "Succeeded"}})
        seen = len(requests)


def _argv(line: str) -> list[str]:
    argv = shlex.split(line, comments=True)[1:]
    if DRY_RUN.match(line) and "--dry-run" not in argv:
        cut = argv.index("--") if "--" in argv else len(argv)
        argv.insert(cut, "--dry-run")
    return argv


@pytest.mark.parametrize("skill", sorted({s for s, _ in LINES}))
def test_skill_commands_run_as_written(skill, world):
    root, env, _kube = world
    folder = root.parent / skill
    folder.mkdir(exist_ok=True)
    # What a user's project holds before an agent starts: their requirements and a run config.
    (folder / "requirements.txt").write_text("rich==13.9.4\n")
    (folder / "run.yaml").write_text("preset: tiny\noptim:\n  max_steps: 10\n")
    if skill == "fsdpkit-checkpoints":  # the job's volume, as the helper pod sees it
        (folder / "volume" / "my-job").mkdir(parents=True, exist_ok=True)
    if skill == "fsdpkit-fine-tune" and not (folder / "models").exists():
        # A model downloaded from the hub (tiny, of Qwen2.5's form), chat records and a task of their own.
        tiny_qwen(folder / "models" / "Qwen2.5-0.5B-Instruct", require("transformers"))
        (folder / "data").mkdir()
        (folder / "data" / "chat.jsonl").write_text("".join(json.dumps(r) + "\n" for r in chat_records()))
        local_task(folder / "tasks", [(f"What is {i} plus 1?", [f"{i + 1}.", "zebra."], 0) for i in range(20)],
                   "my_task")
    # fsdpkit's build infrastructure, as `fsdpkit infra create` leaves it (the infra skill takes it down).
    assert run_cli("infra", "create", env=env, timeout=120).returncode == 0
    if not (folder / ".git").exists():  # a project under git (--tag-strategy git-sha)
        for git in (["init", "-q"], ["add", "-A"], ["-c", "user.email=a@b", "-c", "user.name=a", "commit", "-qm", "x"]):
            subprocess.run(["git", *git], cwd=folder, check=True, capture_output=True)
    for _, line in [x for x in LINES if x[0] == skill]:
        argv = _argv(line)
        t0 = time.monotonic()
        r = run_cli(*argv, cwd=folder, env=env, timeout=600)
        print(f"{time.monotonic() - t0:6.1f}s exit {r.returncode}  {line}")
        if skill == "fsdpkit-checkpoints" and argv[:2] == ["train", "--max-steps"] and r.returncode == 0:
            # The volume the helper pod mounts holds this job's checkpoints.
            _mirror(folder / "ckpts", folder / "volume" / "my-job" / "checkpoints")
        code, says = next((v for rx, v in EXPECT.items() if re.search(rx, line)), (0, None))
        where = f"{skill}: `{line}`"
        assert r.returncode == code, f"{where} exited {r.returncode}, not {code}:\n{r.stdout[-1500:]}\n" \
                                     f"{r.stderr[-2000:]}"
        if "--json" in argv:
            envelope = json.loads(r.stdout)
            assert envelope["ok"] is (code == 0), f"{where}: {envelope}"
        if says:
            assert says in r.stdout + r.stderr, f"{where}: no {says!r} in\n{r.stdout[-1500:]}\n{r.stderr[-1500:]}"


def _mirror(src: Path, dst: Path) -> None:
    import shutil

    if dst.exists():
        shutil.rmtree(dst)
    shutil.copytree(src, dst)
