"""Rendered manifests and scripts: every backend x node layout x instance type validates against the
real CRD schemas (../shared/schemas) and, for built-in kinds, kubernetes-validate; the Slurm script
parses and runs; bad specs get one-line errors."""

from __future__ import annotations

import copy
import itertools
import json
import os
import stat
import subprocess
from pathlib import Path

import pytest
import yaml

from fsdpkit.cluster import pod_rules
from fsdpkit.errors import UserError
from fsdpkit.hardware.instances import INSTANCES
from fsdpkit.jobs import hyperpod, manifests
from fsdpkit.jobs.backends import get_backend
from fsdpkit.jobs.backends.slurm import script
from fsdpkit.jobs.ray import raycluster_manifest
from fsdpkit.jobs.resolved import load_job
from fsdpkit.jobs.spec import parse_overrides
from fsdpkit.train.observe import log_lines

from conftest import ROOT, losses, require, run_cli, unavailable
from job_specs import write_spec
from kube_admission import pod_security_violations
from manifest_schemas import IMAGE, crd_validator, pod_of, validate_builtin, validate_hyperpod_job


def spec_for(backend="pytorchjob", nodes="2", instance="p5.48xlarge", **extra):
    doc = {"name": "t1", "backend": backend, "image": IMAGE, "nodes": nodes, "instance_type": instance,
           "storage": {"claim": "fsx-claim"}, "hf_token_env": "HF_TOKEN",
           "secrets": [{"env": "WANDB_API_KEY", "secret": "wandb", "key": "api-key"}],
           "env": {"LOG_LEVEL": "info"}, "tolerations": [{"key": "dedicated", "operator": "Equal", "value": "ml",
                                                          "effect": "NoSchedule"}],
           "priority_class": "training", "queue": "team-a", "train": {"preset": "tiny", "checkpoint_freq": 50},
           **extra}
    return load_job(None, list(doc.items()))










LAYOUTS = [("1", "single-node"), ("4", "multi-node"), ("2:4", "elastic")]


def _pytorchjob_pods(job):
    return [r["template"] for r in job["spec"]["pytorchReplicaSpecs"].values()]


def _hyperpod_pods(job):
    validate_hyperpod_job(job)
    return [r["template"] for r in job["spec"]["replicaSpecs"]]


# backend (and hyperpod operator) -> (kind, render, the kind's own validation returning its pod templates)
KINDS = {
    "pytorchjob": ("PyTorchJob", manifests.render, None),
    "hyperpod": ("HyperPodPyTorchJob", hyperpod.render, _hyperpod_pods),
    "hyperpod-kubeflow": ("PyTorchJob", hyperpod.render, None),
}


# hyperpodrun runs a fixed number of nodes (an elastic range is refused at render: see below).
@pytest.mark.parametrize(("backend", "nodes"), [(b, n) for b in KINDS for n, _ in LAYOUTS
                                                 if not (b == "hyperpod" and ":" in n)],
                         ids=[f"{i}-{b}" for b in KINDS for n, i in LAYOUTS if not (b == "hyperpod" and ":" in n)])
def test_every_manifest_validates_against_the_real_schemas(backend, nodes):
    """TrainJobs are checked in test_trainjob.py, with the JobSet they become."""
    validator = crd_validator("kubeflow.org_pytorchjobs.yaml")
    kind, render, own = KINDS[backend]
    checked = 0
    for instance in INSTANCES:
        extra = {"hyperpod": {"operator": "kubeflow"}, "namespace": "kubeflow"} if backend == "hyperpod-kubeflow" \
            else {}
        spec = spec_for(backend.split("-")[0], nodes, instance, storage={"size": "100Gi", "storage_class": "fsx-sc"},
                        cpu="8", memory="64Gi", **extra)
        objs = render(spec)
        assert [o["kind"] for o in objs] == ["Secret", "PersistentVolumeClaim", kind]
        job = objs[-1]
        if own is None:
            errors = [f"{list(e.absolute_path)}: {e.message}" for e in validator.iter_errors(job)]
            assert not errors, (instance, errors[:5])
            pods = _pytorchjob_pods(job)
        else:
            pods = own(job)
        for obj in objs[:-1]:
            validate_builtin(obj)
        for template in pods:
            validate_builtin(pod_of(template))
        checked += 1
    assert checked == len(INSTANCES)


def _first_pod(job):
    return next(iter(job["spec"]["pytorchReplicaSpecs"].values()))["template"]["spec"]


def test_the_8b_example_on_four_p5_nodes_carries_recipe_grace_pull_policy_and_efa():
    """What a first real run on 4 x p5.48xlarge gets, field by field: the model's recipe (not one
    global learning rate), time to write its 96 GB checkpoint after SIGTERM, a pull policy that
    sees a re-pushed tag, and NCCL forced onto EFA."""
    spec = load_job(ROOT / "examples" / "jobs" / "eks-p5.yaml", [("nodes", 4)])
    job = manifests.render(spec)[-1]
    assert not list(crd_validator("kubeflow.org_pytorchjobs.yaml").iter_errors(job))
    assert job["spec"]["pytorchReplicaSpecs"]["Worker"]["replicas"] == 3
    pod = _first_pod(job)
    container = pod["containers"][0]
    validate_builtin(pod_of({"spec": pod}))
    # The recipe is written into the command, and it is what the pods' trainer parses.
    cmd = container["command"]
    assert cmd[0] == "fsdpkit-torchrun" and "--nnodes=4" in cmd
    from fsdpkit.train.config import parse_args

    cfg = parse_args(cmd[cmd.index("fsdpkit.train") + 1:])
    o = cfg.optim
    assert (o.lr, o.min_lr, o.warmup_steps, o.lr_decay_style, o.weight_decay, o.beta2, o.grad_clip) == \
        (3e-4, 3e-6, 200, "cosine", 0.1, 0.95, 1.0)
    assert (cfg.data.seq_len, cfg.data.train_batch_size, cfg.data.tokenizer) == (
        8192, 1, "hf-internal-testing/Llama-3.1-8B-Instruct")   # ungated: no licence needed
    assert cfg.validation_share() <= 0.02 and cfg.checkpoint.every_seconds == 30 * 60
    # Grace: a 96.4 GB checkpoint at the spec's 1,200 MB/s is 80 s of writing; far above Kubernetes' 30 s.
    from fsdpkit.plan.grace import grace_period
    from fsdpkit.plan.planner import plan_config

    step_s = plan_config(cfg, "p5.48xlarge", 4).step_s
    expected = grace_period(cfg.shape, 1200, step_s)
    assert 96e9 < expected.checkpoint_bytes < 97e9
    assert pod["terminationGracePeriodSeconds"] == expected.seconds >= 60 + 1.5 * 80
    # A tag (:v1) can be pushed again: always pull.
    assert container["imagePullPolicy"] == "Always"
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert {k: env.get(k) for k in ("FI_PROVIDER", "NCCL_NET", "FI_EFA_USE_DEVICE_RDMA", "NCCL_PROTO")} == {
        "FI_PROVIDER": "efa", "NCCL_NET": "AWS Libfabric", "FI_EFA_USE_DEVICE_RDMA": "1", "NCCL_PROTO": None}
    assert container["resources"]["limits"]["vpc.amazonaws.com/efa"] == 32
    assert env["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:True"
    assert env["TORCH_NCCL_DEBUG_INFO_TEMP_FILE"] == "/checkpoints/llama3-8b/flight-recorder/rank_"

    # g5.12xlarge has one EFA interface but no GPUDirect RDMA; g5.2xlarge has no EFA at all.
    def env_of(instance):
        pod = _first_pod(manifests.render(load_job(ROOT / "examples" / "jobs" / "eks-p5.yaml", [
            ("nodes", 2), ("instance_type", instance), ("train.preset", "llama3_2_1b")]))[-1])
        c = pod["containers"][0]
        return {e["name"]: e.get("value") for e in c["env"]}, c["resources"]["limits"]
    g5_env, g5_limits = env_of("g5.12xlarge")
    assert (g5_env["FI_PROVIDER"], g5_env["NCCL_NET"], g5_env["FI_EFA_USE_DEVICE_RDMA"], g5_env["NCCL_PROTO"]) == (
        "efa", "AWS Libfabric", "0", "simple")
    assert g5_limits == {"nvidia.com/gpu": 4, "vpc.amazonaws.com/efa": 1}
    plain_env, plain_limits = env_of("g5.2xlarge")
    assert not {"FI_PROVIDER", "NCCL_NET", "FI_EFA_USE_DEVICE_RDMA", "NCCL_PROTO"} & set(plain_env)
    assert plain_limits == {"nvidia.com/gpu": 1} and plain_env["PYTORCH_CUDA_ALLOC_CONF"]


@pytest.mark.parametrize(("version", "env"), [
    (None, {"NCCL_NET": "AWS Libfabric"}), ("1.9.1", {"NCCL_NET": "AWS Libfabric"}), ("1.14.0", {"NCCL_NET": "OFI"}),
    ("1.17.1", {"NCCL_NET": "OFI", "NCCL_NET_PLUGIN": "ofi"})])
def test_nccl_is_pointed_at_the_ofi_plugin_of_the_images_generation(version, env):
    got = {e["name"]: e.get("value") for e in manifests.env_list(spec_for(nodes="2", ofi_nccl=version).spec)}
    assert {k: got.get(k) for k in ("NCCL_NET", "NCCL_NET_PLUGIN")} == {"NCCL_NET_PLUGIN": None, **env}


def test_rendered_yaml_has_no_anchors(cli):
    """Two replicas share one pod template in memory; the YAML still spells each out."""
    r = cli("job", "render", str(ROOT / "examples" / "jobs" / "eks-p5.yaml"))
    assert r.returncode == 0, r.stderr
    assert "&id" not in r.stdout and "*id" not in r.stdout and r.stdout.count("terminationGracePeriodSeconds") == 2


def test_a_digest_pinned_image_is_not_pulled_again():
    pinned = IMAGE.rsplit(":", 1)[0] + "@sha256:" + "a" * 64
    assert _first_pod(manifests.pytorchjob_manifest(spec_for(image=pinned)))["containers"][0][
        "imagePullPolicy"] == "IfNotPresent"


def test_strict_validation_catches_a_wrong_type_and_an_unknown_field():
    validator = crd_validator("kubeflow.org_pytorchjobs.yaml")
    job = manifests.pytorchjob_manifest(spec_for())
    bad = copy.deepcopy(job)
    bad["spec"]["nprocPerNode"] = 8  # the CRD wants a string
    assert any("nprocPerNode" in str(e.absolute_path) for e in validator.iter_errors(bad))
    bad = copy.deepcopy(job)
    bad["spec"]["runPolicy"]["backofLimit"] = 3
    assert list(validator.iter_errors(bad))


@pytest.mark.parametrize("backend", ["pytorchjob", "hyperpod", "trainjob"])
def test_priority_is_kueue_s_label_when_a_queue_orders_the_job_and_the_pods_priority_class_otherwise(backend):
    """With a queue, priority_class names a Kueue WorkloadPriorityClass: Kueue's label on the job and its
    pods (the HyperPod CLI's way), and no priorityClassName, which the Priority admission plugin would look
    up among PriorityClasses and refuse. Without one, the pods' priorityClassName (and the PyTorchJob's
    gang-scheduling priority); a TrainJob's pods take none, its label is all it has."""
    queued = get_backend(backend).render(spec_for(backend)).objects()[-1]
    bare = get_backend(backend).render(spec_for(backend, queue=None)).objects()[-1]
    for job in (queued, bare):
        pods = [t for _, t in pod_rules.templates(job)]
        assert job["metadata"]["labels"].get("kueue.x-k8s.io/priority-class") == (
            "training" if job is queued or backend == "trainjob" else None)
        assert job["metadata"]["labels"].get("kueue.x-k8s.io/queue-name") == ("team-a" if job is queued else None)
        want = None if job is queued or backend == "trainjob" else "training"
        assert [p["spec"].get("priorityClassName") for p in pods] == [want] * len(pods)
        if backend != "trainjob":
            assert all((p["metadata"]["labels"]).get("kueue.x-k8s.io/priority-class") ==
                       ("training" if job is queued else None) for p in pods)
    if backend == "pytorchjob":
        assert "schedulingPolicy" not in queued["spec"]["runPolicy"]
        assert bare["spec"]["runPolicy"]["schedulingPolicy"] == {"priorityClass": "training"}


@pytest.mark.parametrize("backend", ["pytorchjob", "trainjob", "hyperpod", "ray"])
def test_every_pod_meets_the_pod_security_level_its_spec_names_and_the_render_says_which(tmp_path, backend):
    """Pod Security admission's checks (tests/kube_admission.py) over each pod the operator makes:
    the default pods meet baseline (no privilege escalation, nothing taken away that training
    needs) and fail restricted; `security: restricted` pods meet restricted, as `run_as_user`, HOME
    where that user can write, the checkpoint volume theirs through fsGroup."""
    def pods(spec):
        job = raycluster_manifest(spec) if backend == "ray" else get_backend(backend).render(spec).objects()[-1]
        return [pod for _, pod in pod_rules.pods(job)]

    instance = "ml.p5.48xlarge" if backend == "hyperpod" else "p5.48xlarge"
    kind = "pytorchjob" if backend == "ray" else backend   # `fsdpkit ray create` takes a Kubernetes job's spec
    base = pods(spec_for(kind, instance=instance))
    assert len(base) == {"pytorchjob": 2, "ray": 2}.get(backend, 1)
    for pod in base:
        assert pod_security_violations(pod, "baseline") == []
        assert pod_security_violations(pod, "restricted")
        assert [c["securityContext"] for c in pod["spec"]["containers"]] == [{"allowPrivilegeEscalation": False}]
    for pod in pods(spec_for(kind, instance=instance, security="restricted", run_as_user=1234)):
        assert pod_security_violations(pod, "restricted") == []
        assert pod["spec"]["securityContext"] == {"runAsNonRoot": True, "runAsUser": 1234, "runAsGroup": 1234,
                                                  "fsGroup": 1234, "seccompProfile": {"type": "RuntimeDefault"}}
        assert {"name": "HOME", "value": "/tmp"} in pod["spec"]["containers"][0]["env"]
    if backend == "ray":
        return
    doc = {"name": "t1", "backend": backend, "image": IMAGE, "nodes": 2, "instance_type": instance}
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(doc))
    r = run_cli("job", "render", str(tmp_path / "job.yaml"))
    assert r.returncode == 0, r.stderr
    assert r.stderr.splitlines()[-1] == ('note: these pods meet Pod Security "baseline"; a namespace that enforces '
                                         '"restricted" refuses them: set security: restricted there')
    r = run_cli("job", "render", str(tmp_path / "job.yaml"), "--set", "security=restricted", "--json")
    assert r.returncode == 0 and json.loads(r.stdout)["data"]["pod_security"] == "restricted"


def test_the_longest_job_name_keeps_every_name_kubernetes_derives_from_it_within_63_characters():
    """Service names, pod hostnames and label values are RFC 1123 labels (63 characters at most). The
    operators derive them from the job's name: a PyTorchJob's Service per replica (NAME-worker-127),
    a JobSet pod's hostname (NAME-node-0-127), HyperPod's pods (NAME-pod-127), and fsdpkit's Secret
    and claim. 50 characters is the longest name that keeps all of them within 63 on 128 nodes."""
    longest, lengths = "a" * 50, {}
    for backend in ("pytorchjob", "trainjob", "hyperpod"):
        instance = "ml.p5.48xlarge" if backend == "hyperpod" else "p5.48xlarge"
        objs = get_backend(backend).render(spec_for(backend, "128", instance, name=longest,
                                                    storage={"size": "1Ti", "storage_class": "fsx"})).objects()
        job = objs[-1]
        derived = [o["metadata"]["name"] for o in objs]
        if backend == "pytorchjob":
            derived += [f"{longest}-{r.lower()}-{i}" for r, s in job["spec"]["pytorchReplicaSpecs"].items()
                        for i in range(s["replicas"])]
        elif backend == "trainjob":
            derived += [f"{longest}-node-0-{i}" for i in range(job["spec"]["trainer"]["numNodes"])]
        else:
            derived += [f"{longest}-pod-{i}" for i in range(job["spec"]["replicaSpecs"][0]["replicas"])]
        lengths[backend] = max(map(len, derived))
    # NAME-worker-126, NAME-node-0-127, NAME-hf-token: two characters to spare at the most.
    assert lengths == {"pytorchjob": 61, "trainjob": 61, "hyperpod": 59}
    with pytest.raises(UserError) as e:
        spec_for(name="a" * 51)
    assert str(e.value) == (f"name: {'a' * 51!r} is not a valid job name: use at most 50 lowercase letters, digits and "
                            "'-', starting with a letter and ending with a letter or digit (RFC 1123)")


@pytest.mark.parametrize("operator", ["hyperpod", "kubeflow"])
def test_hyperpod_retries_a_failed_job_only_with_auto_resume(operator):
    """auto_resume: false means no retry at all: HyperPod's operator retries jobMaxRetryCount times,
    and its Kubeflow path acts on the auto-resume annotations; either is present only with auto_resume."""
    def job(auto_resume):
        extra = {"namespace": "kubeflow"} if operator == "kubeflow" else {}
        return hyperpod.render(spec_for("hyperpod", "2", "ml.p5.48xlarge", **extra, hyperpod={
            "operator": operator, "auto_resume": auto_resume, "max_retry": 4}))[-1]

    on, off = job(True), job(False)
    if operator == "hyperpod":
        assert (on["spec"]["runPolicy"]["jobMaxRetryCount"], off["spec"]["runPolicy"]["jobMaxRetryCount"]) == (4, 0)
    else:
        assert {k: v for k, v in on["metadata"]["annotations"].items() if k.startswith("sagemaker.amazonaws.com/")} \
            == {hyperpod.AUTO_RESUME: "true", hyperpod.MAX_RETRY: "4"}
        assert not [k for k in off["metadata"]["annotations"] if k.startswith("sagemaker.amazonaws.com/")]


def test_manifest_shape_follows_the_spec():
    fixed = manifests.pytorchjob_manifest(spec_for(nodes="3"))
    assert fixed["spec"]["nprocPerNode"] == "8"
    assert {k: v["replicas"] for k, v in fixed["spec"]["pytorchReplicaSpecs"].items()} == {"Master": 1, "Worker": 2}
    pod = fixed["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]
    c = pod["containers"][0]
    assert c["name"] == "pytorch"
    cmd = c["command"]
    assert "--rdzv-backend=c10d" in cmd and "--rdzv-endpoint=t1-master-0:29500" in cmd and "--nnodes=3" in cmd
    assert not any("master_addr" in a or "master-addr" in a for a in cmd)
    assert c["resources"]["limits"] == {"nvidia.com/gpu": 8, "vpc.amazonaws.com/efa": 32}
    assert {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": "64Gi"}} in pod["volumes"]
    assert {"name": "checkpoints", "persistentVolumeClaim": {"claimName": "fsx-claim"}} in pod["volumes"]
    assert cmd[cmd.index("--checkpoint-dir") + 1] == "/checkpoints/t1/checkpoints"
    assert fixed["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] == "team-a"

    elastic = manifests.pytorchjob_manifest(spec_for(nodes="2:4"))
    assert elastic["spec"]["elasticPolicy"] == {"rdzvBackend": "c10d", "rdzvPort": 29500, "rdzvId": "t1",
                                                "minReplicas": 2, "maxReplicas": 4, "maxRestarts": 3,
                                                "nProcPerNode": 8}
    assert list(elastic["spec"]["pytorchReplicaSpecs"]) == ["Worker"]
    cmd = elastic["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]["containers"][0]["command"]
    assert "--nnodes=2:4" in cmd and "--rdzv-endpoint=t1-worker-0:29500" in cmd

    # EFA environment by platform: GPUDirect RDMA where the hardware has it; none without EFA.
    def env(instance):
        spec = spec_for(instance=instance, nodes="1").spec
        return {e["name"]: e.get("value") for e in manifests.env_list(spec)}
    assert env("p4d.24xlarge")["FI_EFA_USE_DEVICE_RDMA"] == "1"
    assert env("p5.48xlarge")["FI_PROVIDER"] == "efa" and env("p5.48xlarge")["FI_EFA_USE_DEVICE_RDMA"] == "1"
    assert "FI_PROVIDER" not in env("g5.xlarge") and "NCCL_DEBUG" not in env("p5.48xlarge")
    diag = {e["name"]: e.get("value") for e in manifests.env_list(spec_for(diagnose_network=True).spec)}
    assert diag["NCCL_DEBUG"] == "INFO"
    trn = manifests.pytorchjob_manifest(spec_for(instance="trn1.32xlarge", nodes="1"))
    res = trn["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]["containers"][0]["resources"]["limits"]
    assert res == {"aws.amazon.com/neuron": 16, "vpc.amazonaws.com/efa": 8}


def test_hyperpod_job_kind_matches_the_official_template():
    """HyperPodPyTorchJob has no CRD schema to validate against; the HyperPod CLI's own template
    package has one for its parameters. Our manifest must match what that template renders."""
    import importlib.util

    import jinja2
    import jsonschema

    found = importlib.util.find_spec("hyperpod_pytorch_job_template")
    if found is None:
        unavailable("hyperpod-pytorch-job-template is not installed (make venv installs sagemaker-hyperpod)")
    # Read the files rather than import the package: its __init__ pulls in the whole HyperPod SDK.
    tpl_dir = Path(found.origin).parent / "v1_1"
    template = {}
    exec((tpl_dir / "template.py").read_text(), template)

    spec = spec_for("hyperpod", "2", "ml.p5.48xlarge", hyperpod={"max_retry": 4, "deep_health_check": "required"})
    ours = hyperpod.render(spec)[-1]
    container = ours["spec"]["replicaSpecs"][0]["template"]["spec"]["containers"][0]
    params = {"job_name": "t1", "namespace": "default", "image": IMAGE, "command": container["command"],
              "instance_type": "ml.p5.48xlarge", "node_count": 2, "tasks_per_node": "8", "accelerators": 8,
              "accelerators_limit": 8, "efa": 32, "efa_limit": 32, "max_retry": 4, "queue_name": "team-a",
              "deep_health_check_passed_nodes_only": True,
              "volume": [{"name": "checkpoints", "type": "pvc", "mount_path": "/checkpoints",
                          "claim_name": "fsx-claim"}]}
    schema = json.loads((tpl_dir / "schema.json").read_text())
    # Not jsonschema.validate: the upstream schema says "type": "float", which its meta-schema rejects.
    jsonschema.Draft202012Validator(schema).validate(params)
    official = yaml.safe_load(jinja2.Template(template["TEMPLATE_CONTENT"]).render(**params))
    assert (ours["apiVersion"], ours["kind"]) == (official["apiVersion"], official["kind"])
    assert ours["spec"]["nprocPerNode"] == official["spec"]["nprocPerNode"]
    # The template's run policy, plus what fsdpkit adds: restarts, deadlines, log monitoring, finished
    # pods kept.
    assert {k: ours["spec"]["runPolicy"][k] for k in official["spec"]["runPolicy"]} == official["spec"]["runPolicy"]
    assert set(ours["spec"]["runPolicy"]) - set(official["spec"]["runPolicy"]) == {
        "restartPolicy", "logMonitoringConfiguration", "ttlSecondsAfterFinished", "startupDeadlineSeconds",
        "faultDeadlineSeconds"}
    validate_hyperpod_job(ours)
    o_pod = official["spec"]["replicaSpecs"][0]
    assert ours["spec"]["replicaSpecs"][0]["replicas"] == o_pod["replicas"]
    o_container = o_pod["template"]["spec"]["containers"][0]
    assert container["command"] == o_container["command"] and container["image"] == o_container["image"]
    # The same GPUs and EFA devices, and the 2 MiB pages libfabric registers EFA memory in.
    assert container["resources"]["limits"] == {**{k: int(v) for k, v in o_container["resources"]["limits"].items()},
                                                "hugepages-2Mi": "5120Mi"}
    assert container["ports"] == [{"containerPort": 8080, "name": "agent"}]
    assert ours["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] == official["metadata"]["labels"][
        "kueue.x-k8s.io/queue-name"]
    pod = ours["spec"]["replicaSpecs"][0]["template"]
    validate_builtin(pod_of(pod))
    required = pod["spec"]["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    keys = {e["key"]: e["values"] for e in required["nodeSelectorTerms"][0]["matchExpressions"]}
    # The official template asks for the same nodes through a nodeSelector.
    assert keys["sagemaker.amazonaws.com/deep-health-check-status"] == [
        o_pod["template"]["spec"]["nodeSelector"]["sagemaker.amazonaws.com/deep-health-check-status"]]
    assert container["command"][0] == "hyperpodrun"


def test_hyperpod_fault_handling_fields_round_trip_through_the_hyperpod_cli_model():
    """HyperPod CLI 3.12's fields for faults: spare nodes, repeat offenders left out, the scale-up
    snooze, the startup and fault deadlines, and each log rule's stopPattern. What fsdpkit renders,
    the CLI's own model reads and writes back unchanged."""
    given = {"spares": 2, "repeat_offenders_to_avoid": 1, "scale_up_snooze": 120, "startup_deadline": 900,
             "fault_deadline": 2400}
    job = hyperpod.render(spec_for("hyperpod", "4", "ml.p5.48xlarge", hyperpod=given))[-1]
    back = validate_hyperpod_job(job).model_dump(mode="json", exclude_unset=True)
    run_policy, replica = job["spec"]["runPolicy"], job["spec"]["replicaSpecs"][0]
    assert back["runPolicy"] == run_policy and back["replicaSpecs"][0]["spares"] == replica["spares"] == 2
    assert run_policy["restartPolicy"]["maxNumRepeatOffendersToAvoid"] == 1
    assert run_policy["restartPolicy"]["scaleUpSnoozeTimeInSeconds"] == 120
    assert (run_policy["startupDeadlineSeconds"], run_policy["faultDeadlineSeconds"]) == (900, 2400)
    assert {r["stopPattern"] for r in run_policy["logMonitoringConfiguration"]} == {f".*{log_lines.FINAL}.*"}


def test_hyperpod_deadlines_come_from_the_plan():
    """Unset, the startup deadline is the planned start-up (image, the checkpoint read back, compile)
    and the fault deadline the pod's grace (its checkpoint written) plus a start-up; spares stand in
    for as many repeat offenders. A job that runs its own command keeps the operator's defaults."""
    spec = spec_for("hyperpod", "2", "ml.p5.48xlarge", storage={"claim": "fsx", "write_mb_per_s": 100},
                    train={"preset": "llama3_1_8b"}, hyperpod={"spares": 1})
    policy = validate_hyperpod_job(job := hyperpod.render(spec)[-1]).model_dump(mode="json", exclude_unset=True)[
        "runPolicy"]
    assert spec.trainer is not None and spec.trainer.grace is not None
    start, grace = spec.trainer.startup, spec.trainer.grace
    # An 8B checkpoint (96,363,134,976 bytes) read at 100 MB/s: 600 s + 1.5 x 963.6 s + 300 s to
    # compile = 2345.4 s, in whole minutes; the grace 60 s + 2 x 1.4 s steps + 1.5 x 963.6 s, in tens.
    assert (start.read_s, start.compile_s, start.seconds) == (96_363_134_976 / 100e6, 300, 2400)
    assert grace.seconds == spec.grace_seconds == 1510
    assert policy["startupDeadlineSeconds"] == 2400
    assert policy["faultDeadlineSeconds"] == 1510 + 2400
    assert policy["restartPolicy"]["maxNumRepeatOffendersToAvoid"] == 1
    assert job["spec"]["replicaSpecs"][0]["spares"] == 1
    # Unchanged from the operator's defaults: no spares, no snooze; a command of the user's has no plan.
    bare = hyperpod.render(spec_for("hyperpod", "2", "ml.p5.48xlarge"))[-1]["spec"]
    assert "spares" not in bare["replicaSpecs"][0]
    assert not {"maxNumRepeatOffendersToAvoid", "scaleUpSnoozeTimeInSeconds"} & set(bare["runPolicy"]["restartPolicy"])
    own = hyperpod.render(spec_for("hyperpod", "2", "ml.p5.48xlarge", train={}, command=["python", "x.py"]))[-1]
    assert not {"startupDeadlineSeconds", "faultDeadlineSeconds"} & set(own["spec"]["runPolicy"])


@pytest.mark.parametrize("required", [False, True], ids=["preferred", "required"])
def test_topology_placement_asks_kueue_on_every_pod_template_of_every_kueue_backend(required):
    """`placement: topology` as Kueue's topology request on each PodSet's pod template: the
    PyTorchJob's replicas, the TrainJob's JobSet (after Trainer applies the runtime patch) and the
    HyperPodPyTorchJob, the last as the HyperPod CLI's own template renders the same request."""
    import importlib.util

    import jinja2

    from fsdpkit.cluster import trainer
    from fsdpkit.jobs import trainjob
    from fsdpkit.jobs.spec_sections import KUEUE_PREFERRED_TOPOLOGY, KUEUE_REQUIRED_TOPOLOGY

    from manifest_schemas import SCHEMAS, jobset_of, validate_object

    level = "topology.k8s.aws/network-node-layer-2"
    want = {KUEUE_REQUIRED_TOPOLOGY if required else KUEUE_PREFERRED_TOPOLOGY: level}
    on_pods = {**want, "karpenter.sh/do-not-disrupt": "true"}   # beside Karpenter's (aws/karpenter.py)
    # Kueue's own names (sigs.k8s.io/kueue apis/kueue/v1alpha1).
    assert (KUEUE_REQUIRED_TOPOLOGY, KUEUE_PREFERRED_TOPOLOGY) == (
        "kueue.x-k8s.io/podset-required-topology", "kueue.x-k8s.io/podset-preferred-topology")
    extra = {"placement": "topology", "topology": {"level": level, "required": required}}

    job = manifests.render(spec_for("pytorchjob", "4", **extra))[-1]
    validate_object(job)
    templates = [r["template"] for r in job["spec"]["pytorchReplicaSpecs"].values()]
    assert len(templates) == 2 and all(t["metadata"]["annotations"] == on_pods for t in templates)
    for t in templates:
        validate_builtin(pod_of(t))

    job = trainjob.render(spec_for("trainjob", "4", **extra))[-1]
    validate_object(job)
    runtime = yaml.safe_load((SCHEMAS / "examples" / "kubeflow-trainer_torch_distributed_runtime.yaml").read_text())
    for rt in (runtime, trainer.runtime_manifest(IMAGE)):
        jobset = jobset_of(job, rt)
        validate_object(jobset)
        pod = jobset["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]
        assert pod["metadata"]["annotations"] == on_pods

    ours = hyperpod.render(spec_for("hyperpod", "4", "ml.p5.48xlarge", **extra))[-1]
    validate_object(ours)
    pod = ours["spec"]["replicaSpecs"][0]["template"]
    assert pod["metadata"]["annotations"] == on_pods
    found = importlib.util.find_spec("hyperpod_pytorch_job_template")
    if found is None:
        unavailable("hyperpod-pytorch-job-template is not installed (make venv installs sagemaker-hyperpod)")
    template: dict = {}
    exec((Path(found.origin).parent / "v1_1" / "template.py").read_text(), template)
    official = yaml.safe_load(jinja2.Template(template["TEMPLATE_CONTENT"]).render(
        job_name="t1", namespace="default", image=IMAGE, node_count=4,
        **{("required_topology" if required else "preferred_topology"): level}))
    assert official["spec"]["replicaSpecs"][0]["template"]["metadata"]["annotations"] == want
    # The HyperPod CLI puts it on the job too; so does fsdpkit, beside its own annotations.
    assert official["metadata"]["annotations"] == want
    assert {k: v for k, v in ours["metadata"]["annotations"].items() if k.startswith("kueue.")} == want


def test_hyperpodrun_parses_the_command_with_sigterm_and_the_checkpoint_s_time(monkeypatch):
    """The rendered worker command through the HyperPod elastic agent's own parser and config (what
    `hyperpodrun` runs first): SIGTERM, not its default SIGKILL, and the planned grace, not its
    default 15 s, so the trainer's checkpoint finishes before anything is killed."""
    import signal

    agent = require("hyperpod_elastic_agent.run")
    from torch.distributed.run import config_from_args, get_args_parser

    from fsdpkit.train.config import parse_args

    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # torch's config_from_args would set it in this process
    spec = load_job(ROOT / "examples" / "jobs" / "hyperpod-p5.yaml")
    pod = hyperpod.render(spec)[-1]["spec"]["replicaSpecs"][0]["template"]["spec"]
    command = pod["containers"][0]["command"]
    assert command[0] == "hyperpodrun"
    # hyperpodrun is torchrun's parser plus the agent's options. torch >= 2.12's torchrun has a
    # --shutdown-timeout of its own, and agent 1.1.3 needs torch < 2.12 (its Requires-Dist), so on this
    # torch each parser reads its own options, unchanged: the agent's first, torchrun's the rest.
    import argparse

    def parse(argv):
        own = argparse.ArgumentParser(add_help=False)
        agent.add_additional_hyperpod_args(own)
        mine, rest = own.parse_known_args(argv)
        return argparse.Namespace(**{**vars(get_args_parser().parse_args(rest)), **vars(mine)})

    args = parse(command[1:])
    _, _, shutdown = agent.additional_hyperpod_config_from_args(args)
    assert spec.trainer is not None and spec.trainer.grace is not None
    grace = spec.trainer.grace
    assert shutdown.shutdown_signal == signal.SIGTERM
    # 60 s + 2 x 1.4 s + 1.5 x 192.7 s (96.4 GB at 500 MB/s) = 351.9 s, in tens; the agent stops 15 s before.
    assert grace.seconds == 360 and shutdown.shutdown_timeout == 360 - hyperpod.AGENT_MARGIN == 345
    assert pod["terminationGracePeriodSeconds"] == 360   # the kubelet waits longer than the agent
    config, _entry, entry_args = config_from_args(args)
    assert config.min_nodes == config.max_nodes == 4   # what run() asserts before it starts anything
    assert config.nproc_per_node == 8
    cfg = parse_args(entry_args[entry_args.index("fsdpkit.train") + 1:])
    assert cfg.checkpoint.resume_from_checkpoint == "auto" and cfg.checkpoint.checkpoint_dir.startswith("/checkpoints")
    # Without a planned grace (no storage), Kubernetes' 30 s, and still SIGTERM.
    bare = hyperpod.render(load_job(ROOT / "examples" / "jobs" / "hyperpod-p5.yaml", [("storage", {})]))[-1]
    pod = bare["spec"]["replicaSpecs"][0]["template"]["spec"]
    args = parse(pod["containers"][0]["command"][1:])
    assert (args.shutdown_signal, args.shutdown_timeout, pod["terminationGracePeriodSeconds"]) == ("SIGTERM", 15, 30)


def test_an_elastic_range_hyperpodrun_refuses_is_refused_at_render():
    with pytest.raises(UserError, match=r"^nodes: 2:4 is a range, and HyperPod's elastic agent "
                                        r"\(hyperpodrun\) starts a fixed number of nodes; give "
                                        r"nodes: 4, or hyperpod.operator: kubeflow for an elastic PyTorchJob$"):
        spec_for("hyperpod", "2:4", "ml.p5.48xlarge")
    # The Kubeflow variant is elastic through torchrun, and runs where HyperPod's auto-resume acts.
    spec = spec_for("hyperpod", "2:4", "ml.p5.48xlarge", hyperpod={"operator": "kubeflow"}, namespace="kubeflow")
    assert hyperpod.render(spec)[-1]["spec"]["elasticPolicy"]["maxReplicas"] == 4
    with pytest.raises(UserError, match=r"^namespace: HyperPod resumes a Kubeflow PyTorchJob only in the kubeflow "
                                        r"namespace or one whose name starts with hyperpod, not 'default'"):
        spec_for("hyperpod", "2", "ml.p5.48xlarge", hyperpod={"operator": "kubeflow"})
    assert spec_for("hyperpod", "2", "ml.p5.48xlarge", hyperpod={"operator": "kubeflow", "auto_resume": False})


@pytest.mark.parametrize("instance", ["p5.48xlarge", "p4d.24xlarge", "g5.xlarge"])
def test_slurm_script_parses_and_carries_rendezvous_and_efa(instance):
    spec = spec_for("slurm", "4", instance, slurm={"partition": "gpu", "container_image": "nvcr.io#nvidia/pytorch"},
                    storage={"shared_path": "/fsx"})
    text = script(spec)
    r = subprocess.run(["bash", "-n"], input=text, text=True, capture_output=True)
    assert r.returncode == 0, r.stderr
    assert "#SBATCH --nodes=4" in text and "#SBATCH --partition=gpu" in text
    assert "--rdzv-backend=c10d" in text and '"--rdzv-endpoint=${rdzv_endpoint}"' in text
    assert 'rdzv_endpoint="${head_addr:-$head_node}:29500"' in text  # the head node by its NodeAddr
    assert "--container-image='nvcr.io#nvidia/pytorch'" in text and "--container-mounts=/fsx:/fsx" in text
    assert "--checkpoint-dir /fsx/t1/checkpoints" in text
    efa = INSTANCES[instance].efa
    assert ("export FI_PROVIDER=efa" in text) == bool(efa)
    assert ("export FI_EFA_USE_DEVICE_RDMA=1" in text) == INSTANCES[instance].rdma
    assert 'export HF_TOKEN="${HF_TOKEN:?' in text  # read from the submitting shell, never written here
    assert " fsdpkit-torchrun " in text   # torchrun under the supervisor: SIGTERM ends in a checkpoint, exit 143
    assert "--signal=TERM@" not in text   # no time limit, nothing to warn ahead of


def test_slurm_warns_ahead_of_the_time_limit_by_the_grace_period():
    spec = spec_for("slurm", "2", "p5.48xlarge", slurm={"time": "2-00:00:00"}, storage={"shared_path": "/fsx"},
                    train={"preset": "llama3_1_8b", "checkpoint_freq": 500})
    # 60 s + 2 x 1.4 s steps + 1.5 x 192.7 s to write 96.4 GB at 500 MB/s = 351.9 s, in tens.
    assert spec.grace_seconds == 360 and "#SBATCH --signal=TERM@360\n" in script(spec)


@pytest.mark.slow
def test_slurm_script_runs_training_through_srun_and_torchrun(tmp_path):
    """Run the generated script for real: `scontrol` and `srun` are stand-ins that play a
    one-node allocation on this machine; torchrun and the trainer are the real ones."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "scontrol").write_text("#!/bin/sh\necho 127.0.0.1\n")
    (bin_dir / "srun").write_text('#!/bin/sh\nwhile [ "${1#--}" != "$1" ]; do shift; done\nexec "$@"\n')
    for f in bin_dir.iterdir():
        f.chmod(f.stat().st_mode | stat.S_IEXEC)
    run_dir = tmp_path / "run"
    spec = load_job(None, [("name", "slurm-tiny"), ("backend", "slurm"), ("nodes", 1), ("procs_per_node", 2),
                            ("rdzv_port", 29731), ("max_restarts", 0),
                            ("train", {"max_steps": 12, "seq_len": 64, "validation_freq": 0, "progress": "off",
                                       "run_dir": str(run_dir), "logging_freq": 4})])
    path = tmp_path / "job.sbatch"
    path.write_text(script(spec))
    venv_bin = Path(os.sys.executable).parent
    env = {**os.environ, "PATH": f"{bin_dir}:{venv_bin}:{os.environ['PATH']}", "SLURM_JOB_NODELIST": "n1",
           "SLURM_JOB_ID": "4242", "SLURM_JOB_NUM_NODES": "1", "HF_TOKEN": "x", "WANDB_API_KEY": "x"}
    r = subprocess.run(["bash", str(path)], env=env, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-3000:]
    got = losses(run_dir)
    assert len(got) == 3 and got[-1] < got[0]


BAD = [
    ({"name": "Bad_Name"}, "name: 'Bad_Name' is not a valid job name"),
    ({"gpus_per_node": 16}, "gpus_per_node: 16 is more than p5.48xlarge has (8 H100); use at most 8"),
    ({"instance_type": "g5.xlarge", "efa_per_node": 1}, "efa_per_node: g5.xlarge has no EFA interfaces"),
    ({"image": None}, "image: the pytorchjob backend runs a container image"),
    ({"env": {"HF_TOKEN": "hf_abc123"}}, "env.HF_TOKEN: looks like a secret and must not be written into the spec"),
    ({"secrets": ["hf_abc123"]}, "secrets[0]: give a reference {env, secret, key} to an existing Kubernetes Secret"),
    ({"backend": "nomad"}, "backend: 'nomad' is not a backend; choose one of: local, trainjob, pytorchjob, hyperpod, "
                            "slurm"),
    ({"instance_type": "p9.huge"}, "instance_type: 'p9.huge' is not in fsdpkit's table"),
    ({"nodes": "4:2"}, "nodes: '4:2' must be >= 1, and MIN <= MAX"),
    ({"storage": None, "train": {"checkpoint_freq": 10}}, "storage: train.checkpoint_every is set but the job has no "
                                                          "storage"),
    ({"train": {"lr": -1}}, "train.lr: -1.0 is out of range"),
    ({"hf_token_env": "hf_abcdef-123"}, "hf_token_env: must be the NAME of an environment variable"),
    ({"memory": "lots"}, "memory: 'lots' is not a Kubernetes quantity"),
    ({"colour": "red"}, "colour: unknown field"),
    ({"train": {"preset": "llama3_1_8b", "context_parallel": 16}},
     "train.context_parallel: 16 must divide the processes on each node (8): the ranks that share a sequence sit on "
     "one node"),
    ({"nodes": "1:2", "train": {"preset": "qwen3_30b_a3b", "expert_parallel": 16}},
     "train.expert_parallel: 16 must divide the ranks of the run (8): each group of 16 consecutive ranks holds every "
     "expert once"),
]


@pytest.mark.parametrize(("change", "message"), BAD, ids=[b[1].split(":")[0] for b in BAD])
def test_bad_spec_is_one_line_and_exit_2(tmp_path, change, message):
    doc = {"name": "ok-job", "backend": "pytorchjob", "image": IMAGE, "instance_type": "p5.48xlarge",
           "storage": {"claim": "fsx"}}
    for k, v in change.items():
        if v is None:
            doc.pop(k, None)
        else:
            doc[k] = v
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(doc))
    # Nothing is contacted: the kubeconfig points at a port where nothing listens.
    r = run_cli("job", "submit", str(path), env={"KUBECONFIG": str(tmp_path / "none")})
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: {message}"), r.stderr
    r = run_cli("job", "render", str(path), "--json")
    env = json.loads(r.stdout)
    assert r.returncode == 2 and env["ok"] is False and env["error"]["message"].startswith(message)


def test_a_job_carries_its_context_parallel_layout_into_the_pods_command_its_plan_and_its_budget(tmp_path):
    """2 p5 nodes, sequences of 131072 tokens over 4 ranks each: 4 data-parallel shares of the
    batch, so a budget of 5,242,880 tokens is 10 steps of 4 x 131072 (16 ranks' worth would be 3)."""
    spec = write_spec(tmp_path, train={"preset": "llama3_1_8b", "seq_len": 131072, "train_batch_size": 1,
                                       "activation_checkpointing": "full", "context_parallel": 4, "tokens": 5242880})
    r = run_cli("job", "render", str(spec))
    assert r.returncode == 0, r.stderr
    job = next(d for d in yaml.safe_load_all(r.stdout) if d["kind"] == "PyTorchJob")
    command = job["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]["containers"][0]["command"]
    flags = dict(itertools.pairwise(command))   # flag -> the word after it
    assert (flags["--context-parallel"], flags["--max-steps"]) == ("4", "10")
    plan = json.loads(run_cli("plan", str(spec), "--json").stdout)["data"]
    assert (plan["context_parallel"], plan["world"], plan["fits"]) == (4, 16, True)
    assert plan["run"]["tokens"] == 10 * 4 * 131072


def test_set_overrides_and_unknown_fields():
    spec = load_job(None, [("name", "x"), ("backend", "slurm"), ("hyperpod.max_retry", 7), ("train.max_steps", 9)]).spec
    assert spec.hyperpod.max_retry == 7 and spec.train == {"max_steps": 9}
    with pytest.raises(UserError, match=r"hyperpod.colour: unknown field"):
        load_job(None, [("name", "x"), ("hyperpod.colour", 1)])


@pytest.mark.parametrize("example", sorted((ROOT / "examples" / "jobs").glob("*.yaml")), ids=lambda p: p.stem)
def test_example_specs_render(example):
    r = run_cli("job", "render", str(example), "--json")
    assert r.returncode == 0, r.stderr
    data = json.loads(r.stdout)["data"]
    if "manifests" in data:
        job = data["manifests"][-1]
        if job["kind"] == "HyperPodPyTorchJob":
            validate_hyperpod_job(job)
        else:
            schema = {"PyTorchJob": "kubeflow.org_pytorchjobs.yaml", "TrainJob": "trainer.kubeflow.org_trainjobs.yaml"}
            assert not list(crd_validator(schema[job["kind"]]).iter_errors(job))
    elif "script" in data:
        assert subprocess.run(["bash", "-n"], input=data["script"], text=True).returncode == 0


def test_colon_values_are_not_base_60_numbers(tmp_path):
    """YAML 1.1 (PyYAML's default) reads 2:4 as 124 and 48:00:00 as 172800: an elastic range would
    ask for 124 nodes and a Slurm time limit would be seconds. fsdpkit reads them as written."""
    path = tmp_path / "job.yaml"
    path.write_text("name: colon\nbackend: pytorchjob\nimage: x:1\nnodes: 2:4\nslurm:\n  time: 48:00:00\n")
    spec = load_job(path).spec
    assert (spec.nodes.min, spec.nodes.max) == (2, 4) and spec.slurm.time == "48:00:00"
    overrides = parse_overrides(["name=colon", "backend=pytorchjob", "image=x:1", "nodes=2:4"])
    assert load_job(None, overrides).spec.nodes == (2, 4)


def test_a_hyperpod_operator_is_one_of_two():
    with pytest.raises(UserError, match=r"^hyperpod.operator: 'slurm' is not a HyperPod job operator; choose one of: "
                                        r"hyperpod, kubeflow"):
        spec_for("hyperpod", "2", "ml.p5.48xlarge", hyperpod={"operator": "slurm"})
    with pytest.raises(UserError, match=r"^hyperpod.kind: unknown field"):
        spec_for("hyperpod", "2", "ml.p5.48xlarge", hyperpod={"kind": "PyTorchJob"})
