"""GPUs and EFA asked for by DRA claims (resource.k8s.io/v1) or by the device plugins' extended
resources: the choice (jobs/devices.choose), the claim template and its GPU-EFA pairing, and every
backend's render either way, validated by the schemas a real API server holds (kubernetes-validate's
1.34 for the claim template and the Pods, the CRDs for the jobs, the HyperPod CLI's models) and read
back by kubectl."""

from __future__ import annotations

import copy
import json

import pytest

from fsdpkit.cluster import pod_rules
from fsdpkit.errors import UserError
from fsdpkit.jobs import devices
from fsdpkit.jobs.backends import get_backend
from fsdpkit.jobs.resolved import load_job

from conftest import ROOT, cli_here
from manifest_schemas import IMAGE, jobset_of, kubectl_reads, pod_of, validate_builtin, validate_object

GPU, EFA = devices.GPU_CLASS, devices.EFA_CLASS
FULL = devices.DraOffer(True, frozenset({GPU, EFA, "neuron.aws.com"}))


def job_for(backend="pytorchjob", instance="p5.48xlarge", **extra):
    if backend == "hyperpod":
        instance = f"ml.{instance}"
    doc = {"name": "t1", "backend": backend, "image": IMAGE, "nodes": "2", "instance_type": instance,
           "storage": {"claim": "fsx-claim"}, "train": {"preset": "tiny"}, **extra}
    return load_job(None, list(doc.items()))


def _pods(objs):
    """Each pod the job's operator makes, as a Pod (a TrainJob's on its own runtime, as Trainer
    assembles it)."""
    job = objs[-1]
    if job["kind"] == "TrainJob":
        runtime = next((o for o in objs if o["kind"] == "TrainingRuntime"), None)
        if runtime is not None:
            jobset = jobset_of(job, runtime)
            validate_object(jobset)
            return [pod_of(r["template"]["spec"]["template"]) for r in jobset["spec"]["replicatedJobs"]]
    return [pod for _, pod in pod_rules.pods(job, objs)]


@pytest.mark.parametrize("backend", ["pytorchjob", "trainjob", "hyperpod", "hyperpod-kubeflow"])
def test_a_dra_render_of_every_job_kind_validates_and_its_pods_claim_the_template(backend):
    """devices: dra: a ResourceClaimTemplate before the job (a TrainJob also its own TrainingRuntime,
    since a runtime patch cannot carry resourceClaims), each pod naming the template in
    resourceClaims and its container the claim, no GPU or EFA counted as an extended resource; every
    object valid for its real schema and each pod valid as a Pod of Kubernetes 1.34 (DRA's GA)."""
    kind, _, operator = backend.partition("-")
    extra = {"hyperpod": {"operator": operator}, "namespace": "kubeflow"} if operator else {}
    job = job_for(kind, devices="dra", **extra)
    assert (job.devices.mode, job.devices.why) == ("dra", "given (devices: dra); not checked against a cluster")
    objs = get_backend(kind).render(job).objects()
    want = {"trainjob": ["ResourceClaimTemplate", "TrainingRuntime", "TrainJob"],
            "hyperpod": ["ResourceClaimTemplate", "HyperPodPyTorchJob"]}.get(backend,
                                                                            ["ResourceClaimTemplate", "PyTorchJob"])
    assert [o["kind"] for o in objs] == want
    for obj in objs:
        validate_object(obj)
    pods = _pods(objs)
    assert len(pods) == (2 if backend in ("pytorchjob", "hyperpod-kubeflow") else 1)
    for pod in pods:
        validate_builtin(pod)
        assert pod["spec"]["resourceClaims"] == [{"name": "devices", "resourceClaimTemplateName": "t1-devices"}]
        node = pod["spec"]["containers"][0]
        assert node["resources"]["claims"] == [{"name": "devices"}]
        counted = {**node["resources"].get("requests", {}), **node["resources"].get("limits", {})}
        assert not {"nvidia.com/gpu", "vpc.amazonaws.com/efa"} & set(counted), counted
        assert pod_rules.pod_errors(pod["spec"]) == []
    # kubectl reads each object back as it was meant
    from fsdpkit import yamlfile

    assert kubectl_reads(yamlfile.dump_all(objs)) == objs


@pytest.mark.parametrize("backend", ["pytorchjob", "trainjob", "hyperpod"])
def test_without_dra_the_same_spec_renders_extended_resources(backend):
    """devices: extended (and auto with no cluster read): the device plugins' counts, requests equal
    to limits, no claim template, no claims; a TrainJob on the spec's ClusterTrainingRuntime."""
    for mode in ("extended", "auto"):
        job = job_for(backend, devices=mode)
        assert job.devices.mode == "extended"
        objs = get_backend(backend).render(job).objects()
        assert not {"ResourceClaimTemplate", "TrainingRuntime"} & {o["kind"] for o in objs}
        for pod in _pods(objs):
            validate_builtin(pod)
            res = pod["spec"]["containers"][0]["resources"]
            assert res["limits"]["nvidia.com/gpu"] == res["requests"]["nvidia.com/gpu"] == 8
            assert res["limits"]["vpc.amazonaws.com/efa"] == res["requests"]["vpc.amazonaws.com/efa"] == 32
            assert "claims" not in res and "resourceClaims" not in pod["spec"]
        if backend == "trainjob":
            assert objs[-1]["spec"]["runtimeRef"] == {"name": "torch-distributed", "kind": "ClusterTrainingRuntime",
                                                     "apiGroup": "trainer.kubeflow.org"}


def _requests(job):
    claim = devices.claim_template(job.spec, {})
    validate_builtin({**claim, "metadata": {"name": "x", "namespace": "default"}})
    d = claim["spec"]["spec"]["devices"]
    return [(r["name"], r["exactly"]["deviceClassName"], r["exactly"]["count"]) for r in d["requests"]], \
        [tuple(c["requests"]) for c in d.get("constraints", [])]


@pytest.mark.parametrize(("instance", "gpus", "efa", "groups", "per_gpu", "per_efa"), [
    ("p5.48xlarge", None, None, 8, 1, 4),      # 8 H100 and 32 EFA: each GPU with its four interfaces
    ("p5en.48xlarge", None, None, 8, 1, 2),    # 16 EFA
    ("p4d.24xlarge", None, None, 4, 2, 1),     # 4 EFA: two A100s share each
    ("p5.48xlarge", 4, 16, 4, 1, 4),           # half a node: whole groups
])
def test_the_claim_pairs_each_gpu_group_with_the_efa_on_its_pcie_root(instance, gpus, efa, groups, per_gpu,
                                                                        per_efa):
    extra = {k: v for k, v in (("gpus_per_node", gpus), ("efa_per_node", efa)) if v is not None}
    reqs, constraints = _requests(job_for(instance=instance, devices="dra", **extra))
    assert reqs == [r for i in range(groups) for r in ((f"gpu-{i}", GPU, per_gpu), (f"efa-{i}", EFA, per_efa))]
    assert constraints == [(f"gpu-{i}", f"efa-{i}") for i in range(groups)]
    assert {c["matchAttribute"] for c in devices.claim_template(job_for(instance=instance, devices="dra", **extra)
                                                                .spec, {})["spec"]["spec"]["devices"]["constraints"]} \
        == {"resource.kubernetes.io/pcieRoot"}


@pytest.mark.parametrize(("instance", "extra", "want"), [
    ("g6.48xlarge", {}, [("gpu", GPU, 8), ("efa", EFA, 1)]),                    # one EFA for 8 GPUs: no groups
    ("p5.48xlarge", {"gpus_per_node": 4, "efa_per_node": 32}, [("gpu", GPU, 4), ("efa", EFA, 32)]),  # not whole
    ("p5.48xlarge", {"efa_per_node": 0}, [("gpu", GPU, 8)]),                   # no EFA asked for
    ("g5.2xlarge", {}, [("gpu", GPU, 1)]),                                     # no EFA on the instance
])
def test_a_node_that_splits_into_no_whole_groups_asks_for_its_devices_unpaired(instance, extra, want):
    assert _requests(job_for(instance=instance, devices="dra", **extra)) == (want, [])


def test_the_choice_follows_the_spec_the_queue_and_what_the_cluster_offers():
    auto = job_for(devices="auto").spec
    no_efa_class = devices.DraOffer(True, frozenset({GPU}))
    cases = [
        (auto, None, "extended", devices.NOT_READ),
        (auto, FULL, "dra", f"the cluster serves resource.k8s.io/v1 with DeviceClass {GPU} and {EFA}"),
        (auto, devices.DraOffer(False), "extended",
         "the cluster does not serve resource.k8s.io/v1 (Kubernetes 1.34 or later)"),
        (auto, no_efa_class, "extended", f"it has no DeviceClass {EFA} (AWS's EFA DRA driver, aws-dranet installs it)"),
        (auto, devices.DraOffer(True, unread="deviceclasses is forbidden"), "extended",
         "its DeviceClasses could not be read (deviceclasses is forbidden); set devices: dra where the cluster has "
         "the drivers"),
        (job_for(devices="dra").spec, devices.DraOffer(True, unread="deviceclasses is forbidden"), "dra",
         "given (devices: dra); not checked: its DeviceClasses could not be read (deviceclasses is forbidden)"),
        (job_for(devices="auto", efa_per_node=0).spec, no_efa_class, "dra",
         f"the cluster serves resource.k8s.io/v1 with DeviceClass {GPU}"),
        (job_for(devices="auto", queue="team-a").spec, FULL, "extended",
         "Kueue counts the queue's quota in nvidia.com/gpu; it counts DRA devices only when configured to "
         "(deviceClassMappings)"),
        (job_for(devices="extended").spec, FULL, "extended", "given (devices: extended)"),
        (job_for(devices="dra").spec, FULL, "dra", "given (devices: dra)"),
        (job_for(devices="auto", instance="trn1.32xlarge").spec, FULL, "extended",
         "aws.amazon.com/neuron has no DRA driver fsdpkit asks for"),
        (load_job(None, [("name", "t1"), ("train", {"preset": "tiny"})]).spec, FULL, "extended",
         "no GPUs asked for on Kubernetes"),
    ]
    for spec, offer, mode, why in cases:
        assert devices.choose(spec, offer) == devices.DeviceChoice(mode, why), (spec.devices, offer)
    with pytest.raises(UserError, match=f"^devices: dra, but it has no DeviceClass {EFA} "):
        devices.choose(job_for(devices="dra").spec, no_efa_class)


def test_render_explain_says_how_the_pods_ask_for_devices():
    job = job_for(devices="auto")
    assert [(s.name, s.value, s.source, s.why) for s in job.sources if s.name == "devices"] == [
        ("devices", "extended", "default", devices.NOT_READ)]
    given = job_for(devices="dra")
    assert [(s.value, s.source) for s in given.sources if s.name == "devices"] == [("dra", "given")]


@pytest.mark.parametrize(("extra", "message"), [
    ({"backend": "slurm", "devices": "dra"}, "devices: dra is Kubernetes' Dynamic Resource Allocation; the slurm "
                                             "backend has none"),
    ({"instance_type": "trn1.32xlarge", "devices": "dra"}, "devices: dra asks NVIDIA's DRA driver for GPUs; "
                                                          "trn1.32xlarge has Trainium"),
    ({"devices": "yes"}, "devices"),
])
def test_dra_where_it_cannot_be_is_refused_naming_the_field(extra, message):
    doc = {"name": "t1", "backend": "pytorchjob", "image": IMAGE, "nodes": "2", "instance_type": "p5.48xlarge",
           "train": {"preset": "tiny"}, **extra}
    with pytest.raises(UserError, match=message.replace("(", r"\(").replace(")", r"\)")):
        load_job(None, list(doc.items()))


def test_a_container_claim_its_pod_does_not_declare_is_what_the_api_server_refuses():
    pod = pod_of(get_backend("pytorchjob").render(job_for(devices="dra")).objects()[-1]["spec"][
        "pytorchReplicaSpecs"]["Master"]["template"])
    bad = copy.deepcopy(pod)
    bad["spec"]["resourceClaims"] = [{"name": "other", "resourceClaimTemplateName": "t1-devices"}]
    assert pod_rules.pod_errors(bad["spec"]) == [
        "spec.containers[0].resources.claims[0].name: must be the name of an entry in pod.spec.resourceClaims "
        "('devices' is not)"]
    twice = copy.deepcopy(pod)
    twice["spec"]["containers"][0]["resources"]["claims"] *= 2
    assert pod_rules.pod_errors(twice["spec"]) == [
        "spec.containers[0].resources.claims[1].name: Duplicate value: 'devices'"]


def test_plan_and_render_explain_say_how_the_pods_ask_for_devices():
    spec = str(ROOT / "examples" / "jobs" / "eks-p5.yaml")
    for extra, want in (([], {"mode": "extended", "explanation": devices.NOT_READ}),
                        (["--set", "devices=dra"], {"mode": "dra", "explanation": "given (devices: dra); not checked "
                                                                                  "against a cluster"})):
        r = cli_here("plan", spec, *extra, "--json")
        assert r.returncode == 0, r.stderr
        assert json.loads(r.stdout)["data"]["devices"] == want
    human = cli_here("plan", spec, "--set", "devices=dra")
    assert "devices: DRA claims (given (devices: dra); not checked against a cluster)" in human.stdout.splitlines()
    explain = cli_here("job", "render", spec, "--set", "devices=dra", "--explain")
    assert any(line.split()[:2] == ["devices", "dra"] for line in explain.stdout.splitlines()), explain.stdout
