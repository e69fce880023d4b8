"""A job spec's rules, table-driven: each row breaks one rule and gets its one line (the field
first); each rule's edge is allowed; and every `raise UserError` of the spec's validators is reached
by a row, so a rule added without a negative test fails here."""

from __future__ import annotations

import copy
import re
import subprocess
import sys

import pytest
import yaml
from raise_sites import raise_sites, unreached

from fsdpkit.errors import UserError
from fsdpkit.jobs import resolved, spec
from fsdpkit.jobs.backends import get_backend
from fsdpkit.jobs.resolved import resolve
from fsdpkit.jobs.spec import load_spec, load_spec_dict, parse_overrides

from conftest import ROOT

BASE = {
    "name": "llama-tiny", "backend": "pytorchjob", "image": "123456789012.dkr.ecr.us-west-2.amazonaws.com/fsdpkit:1",
    "instance_type": "p5.48xlarge", "nodes": 2, "storage": {"size": "1200Gi", "storage_class": "fsx-sc"},
    "train": {"preset": "tiny", "max_steps": 50},
}
DROP = object()   # a row's value that removes the key


def spec_of(changes: dict) -> dict:
    """BASE with `changes` merged in (dotted keys into sections; DROP removes)."""
    doc = copy.deepcopy(BASE)
    for dotted, value in changes.items():
        *parents, leaf = dotted.split(".")
        target = doc
        for p in parents:
            target = target.setdefault(p, {})
        if value is DROP:
            target.pop(leaf, None)
        else:
            target[leaf] = value
    return doc


RULES = {
    "no name": ({"name": ""}, r"^name: a job name is required"),
    "a name Kubernetes refuses": ({"name": "Llama_Tiny"}, r"^name: 'Llama_Tiny' is not a valid job name"),
    "a name too long": ({"name": "a" * 60}, r"^name: 'a{60}' is not a valid job name: use at most"),
    "a name YAML reads as true": ({"name": True}, r"^name: expected a name in quotes or plain letters, got True"),
    "kubeflow auto-resume outside its namespaces": (
        {"backend": "hyperpod", "hyperpod.operator": "kubeflow", "namespace": "team-a"},
        r"^namespace: HyperPod resumes a Kubeflow PyTorchJob only in the kubeflow namespace"),
    "a HyperPodPyTorchJob field on a PyTorchJob": (
        {"backend": "hyperpod", "hyperpod.operator": "kubeflow", "namespace": "kubeflow",
         "hyperpod.fault_deadline": 900},
        r"^hyperpod.fault_deadline: is a field of the HyperPod training operator's HyperPodPyTorchJob; drop it"),
    "HyperPod's spares on a TrainJob": (
        {"backend": "trainjob", "hyperpod.spares": 1, "queue": "team-a"},
        r"^hyperpod.spares: is a field of HyperPod's training operator \(a HyperPodPyTorchJob\); the trainjob backend "
        r"has no place for it: drop it, or set backend: hyperpod$"),
    "spares without a Kueue queue": ({"backend": "hyperpod", "hyperpod.spares": 1},
                                     r"^hyperpod.spares: 1 spare nodes are held by Kueue; give queue:"),
    "topology placement on Slurm": ({"backend": "slurm", "image": DROP, "storage": DROP, "placement": "topology",
                                     "queue": "team-a"},
                                    r"^placement: topology is placed by Kueue, which does not admit slurm jobs; use "
                                    r"the trainjob, pytorchjob or hyperpod backend, or placement: any \(on Slurm"),
    "topology placement without a queue": ({"placement": "topology"}, r"^placement: topology needs queue:"),
    "a topology level that is no label": ({"placement": "topology", "queue": "team-a", "topology.level": "a b"},
                                          r"^topology.level: 'a b' is not a node label key"),
    "a topology level HyperPod does not label": (
        {"backend": "hyperpod", "placement": "topology", "queue": "team-a", "topology.level": "cloud.com/block"},
        r"^topology.level: HyperPod labels its nodes' topology as one of topology.k8s.aws/network-node-layer-3"),
    "a placement that is neither": ({"placement": "near"}, r"^placement: 'near' is not a placement; choose one of: "
                                                           r"any, topology"),
    "tiered checkpoints off HyperPod": ({"train.tiered": True},
                                        r"^train.tiered: HyperPod's managed tiered checkpointing runs on HyperPod "
                                        r"clusters .*drop train.tiered on pytorchjob$"),
    "tiered checkpoints without a durable tier": (
        {"backend": "hyperpod", "storage": DROP, "train.tiered": True},
        r"^storage: train.tiered keeps the last step and every durable_every-th checkpoint on shared storage"),
    "a cluster job without an image": ({"image": DROP}, r"^image: the pytorchjob backend runs a container image"),
    "an elastic TrainJob": ({"backend": "trainjob", "nodes": "2:4"},
                            r"^nodes: elastic ranges need the pytorchjob or hyperpod backend, not trainjob"),
    "an elastic HyperPodPyTorchJob": ({"backend": "hyperpod", "nodes": "2:4"},
                                      r"^nodes: 2:4 is a range, and HyperPod's elastic agent"),
    "a local job on two nodes": ({"backend": "local", "storage": DROP},
                                 r"^nodes: the local backend runs on this machine: nodes must be 1$"),
    "more GPUs than the node": ({"gpus_per_node": 9}, r"^gpus_per_node: 9 is more than p5.48xlarge has \(8 H100\)"),
    "EFA on a node without it": ({"instance_type": "g5.2xlarge", "efa_per_node": 1},
                                 r"^efa_per_node: g5.2xlarge has no EFA interfaces"),
    "more EFA than the node": ({"efa_per_node": 33}, r"^efa_per_node: 33 is more than p5.48xlarge has \(32\)$"),
    "DRA off Kubernetes": ({"backend": "slurm", "devices": "dra"},
                           r"^devices: dra is Kubernetes' Dynamic Resource Allocation; the slurm backend has none"),
    "DRA for Trainium": ({"instance_type": "trn1.32xlarge", "devices": "dra"},
                         r"^devices: dra asks NVIDIA's DRA driver for GPUs; trn1.32xlarge has Trainium"),
    "a cpu that is no quantity": ({"cpu": "lots"}, r"^cpu: 'lots' is not a Kubernetes quantity"),
    "a storage size that is no quantity": ({"storage.size": "big"},
                                           r"^storage.size: 'big' is not a Kubernetes quantity"),
    "a node path on Kubernetes": ({"storage": {"shared_path": "/fsx"}},
                                  r"^storage.shared_path: is for Slurm and local"),
    "a claim and a size": ({"storage.claim": "fsx-claim"},
                           r"^storage: give either claim \(an existing PVC\) or size \(a new PVC\), not both$"),
    "a new volume without a class": ({"storage.storage_class": DROP}, r"^storage.storage_class: a new PVC needs"),
    "a relative mount path": ({"storage.mount_path": "fsx"}, r"^storage.mount_path: 'fsx' must be an absolute path$"),
    "a secret's value in env": ({"env": {"HF_TOKEN": "hf_x"}}, r"^env.HF_TOKEN: looks like a secret and must not"),
    "a variable name that is no name": ({"env": {"MY-VAR": "1"}}, r"^env.MY-VAR: must be the NAME of an environment"),
    "a token where a name goes": ({"hf_token_env": "hf_AbCdEfGhIjKlMnOpQrStUvWxYz012345"},
                                  r"^hf_token_env: looks like a token, not the NAME"),
    "a secret reference without its key": ({"secrets": [{"env": "A", "secret": "s", "key": ""}]},
                                           r"^secrets\[0\].key: required$"),
    "a secret reference whose env is no name": ({"secrets": [{"env": "1A", "secret": "s", "key": "k"}]},
                                                r"^secrets\[0\].env: must be the NAME"),
    "train and a command": ({"command": ["python", "x.py"]}, r"^command: give either train .* or command"),
    "an empty command": ({"command": [], "train": DROP}, r"^command: must not be empty$"),
    "an aws-ofi-nccl that is no version": ({"ofi_nccl": "latest"}, r"^ofi_nccl: 'latest' is not an aws-ofi-nccl"),
    "the launcher's restarts under train": ({"train.max_restarts": 2},
                                            r"^train.max_restarts: a job's launcher takes this from the spec; "
                                            r"set max_restarts: 2"),
    "the launcher's processes under train": ({"train.nproc": 8}, r"^train.nproc: .*set procs_per_node: 8"),
    "checkpoints without storage": ({"storage": DROP, "train.checkpoint_every": 10},
                                    r"^storage: train.checkpoint_every is set but the job has no storage"),
    "a trainer rule broken": ({"train.lr": 1e-4, "train.min_lr": 2e-4}, r"^train.min_lr: 0.0002 must be <= lr"),
    "a trainer option unknown": ({"train.max_stepz": 3}, r"^train.unknown option 'max_stepz'"),
    "a token budget beside max_steps": ({"train.tokens": 10**6},
                                        r"^train.tokens: give a token budget or max_steps \(50\), not both$"),
}
# Each rule's edge, which it allows.
EDGES = {
    "a name of 50": {"name": "a" * 50},
    "kubeflow auto-resume in a hyperpod- namespace": {"backend": "hyperpod", "hyperpod.operator": "kubeflow",
                                                      "namespace": "hyperpod-team"},
    "an elastic PyTorchJob": {"nodes": "2:4"},
    "topology placement through a queue, at a level of the user's Kueue Topology": {
        "placement": "topology", "queue": "team-a", "topology.level": "cloud.com/block"},
    "tiered checkpoints on HyperPod with storage": {"backend": "hyperpod", "train.tiered": True},
    "spares through a Kueue queue": {"backend": "hyperpod", "hyperpod.spares": 1, "queue": "team-a"},
    "a PyTorchJob on HyperPod with the operator's fields at their defaults": {
        "backend": "hyperpod", "hyperpod.operator": "kubeflow", "namespace": "kubeflow", "hyperpod.spares": 0},
    "all the node's GPUs and EFA": {"gpus_per_node": 8, "efa_per_node": 32},
    "a claim alone": {"storage": {"claim": "fsx-claim"}},
    "a local job on one node": {"backend": "local", "storage": DROP, "nodes": 1, "instance_type": DROP},
    "a floor at the peak": {"train.lr": 1e-4, "train.min_lr": 1e-4},
    "checkpoints every 0 without storage": {"storage": DROP, "train.checkpoint_every": 0},
    "a command alone": {"command": ["python", "x.py"], "train": DROP},
    "a secret by reference": {"secrets": [{"env": "HF_TOKEN", "secret": "hf", "key": "token"}]},
}


def refusal(changes: dict) -> str:
    """The spec's own rules, then the trainer's (checked when the job is resolved), then what a
    render needs (an image for a pod)."""
    with pytest.raises(UserError) as e:
        job = resolve(load_spec_dict(spec_of(changes)))
        get_backend(job.spec.backend).render(job)
    return str(e.value)


@pytest.mark.parametrize("case", sorted(RULES))
def test_each_rule_refuses_in_one_line_naming_the_field(case):
    changes, message = RULES[case]
    got = refusal(changes)
    assert re.search(message, got) and "\n" not in got, got


@pytest.mark.parametrize("case", sorted(EDGES))
def test_each_rule_allows_its_edge(case):
    job = resolve(load_spec_dict(spec_of(EDGES[case])))
    get_backend(job.spec.backend).render(job)


SET_RULES = {
    "no equals sign": (["nodes"], r"^--set 'nodes': expected KEY=VALUE"),
    "no key": (["=4"], r"^--set '=4': expected KEY=VALUE"),
    "a value that is no YAML": (["env={a"], r"^--set env: the value is not valid YAML"),
}


@pytest.mark.parametrize("case", sorted(SET_RULES))
def test_each_set_refusal_is_one_line(case):
    pairs, message = SET_RULES[case]
    with pytest.raises(UserError, match=message):
        parse_overrides(pairs)


def test_set_into_a_value_that_is_no_section(tmp_path):
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(BASE))
    with pytest.raises(UserError, match=r"^--set name.first: name is not a section$"):
        load_spec(path, [("name.first", "x")])


def test_every_refusal_of_the_spec_has_a_row(tmp_path):
    messages = [refusal(changes) for changes, _ in RULES.values()]
    for pairs, _ in SET_RULES.values():
        with pytest.raises(UserError) as e:
            parse_overrides(pairs)
        messages.append(str(e.value))
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(BASE))
    with pytest.raises(UserError) as e:
        load_spec(path, [("name.first", "x")])
    messages.append(str(e.value))
    sites = raise_sites(spec.check_variable_name, spec._check_quantity, spec._validate_identity,
                        spec._validate_nodes, spec._validate_placement, spec._validate_storage,
                        spec._validate_environment, spec._validate_train, spec._set_dotted, spec.parse_overrides,
                        resolved._checked_config, spec.require_image)
    assert not unreached(sites, messages)


def test_set_takes_a_field_in_kebab_or_snake_case_and_keeps_the_user_s_own_keys(tmp_path):
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(BASE))
    pairs = ["train.max-steps=7", "storage.storage-class=efs-sc", "gpus-per-node=4", "env.my_var=1",
             "node-selector.gpu-class=h100", "hyperpod.auto_resume=false"]
    spec = load_spec(path, parse_overrides(pairs))
    assert spec.train["max_steps"] == 7 and spec.storage.storage_class == "efs-sc" and spec.gpus == 4
    assert spec.env == {"my_var": "1"} and spec.node_selector == {"gpu-class": "h100"}
    assert spec.hyperpod.auto_resume is False


def test_job_commands_import_no_torch():
    """Specs, renders and plans are read without torch: every `fsdpkit job` and `plan` call would
    otherwise spend seconds importing it (the trainer's config, LoRA's shape included, is plain data)."""
    code = ("import sys; from fsdpkit.cli import job, plan; from fsdpkit.jobs import manifests, hyperpod, trainjob; "
            "from fsdpkit.jobs.resolved import load_job; s = load_job('examples/jobs/hyperpod-p5.yaml'); "
            "hyperpod.render(s); print(sorted(m for m in sys.modules if m.split('.')[0] == 'torch'))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "[]"
