"""JobSpec: one typed description of a training run that every backend renders.

Defaults live in the fields below and nowhere else. A spec comes from a YAML file, then
`--set key=value` overrides (dotted for sections: `hyperpod.auto_resume=false`,
`train.max_steps=100`), read by the same typed config machine as the trainer's options
(fsdpkit.settings): each field's type, range and choices, then `validate`'s rules between fields.
A bad value is rejected with the field's name before anything is rendered or sent to a cluster.
"""

from __future__ import annotations

import logging
import re
import typing
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import BeforeValidator, model_validator

from fsdpkit import kube_names as names
from fsdpkit import yamlfile
from fsdpkit.errors import UserError
from fsdpkit.hardware.instances import Instance, lookup
from fsdpkit.home import jobs_home
from fsdpkit.jobs.spec_sections import (
    AWS_TOPOLOGY_LEVELS,
    HyperPodOptions,
    SecretRef,
    SlurmOptions,
    Storage,
    TopologyOptions,
    TrainJobOptions,
)
from fsdpkit.settings import Bool, Int, NodeRange, Nodes, Settings, Str, aliases, fail, load, option
from fsdpkit.train.config import SECTIONS
from fsdpkit.train.sections import CheckpointConfig
from fsdpkit.yamlfile import describe_yaml_error, load_mapping

log = logging.getLogger(__name__)

BackendName = Literal["local", "trainjob", "pytorchjob", "hyperpod", "slurm"]
BACKENDS: tuple[str, ...] = typing.get_args(BackendName)
CLUSTER_BACKENDS = ("trainjob", "pytorchjob", "hyperpod")

# RFC 1123 label, starting with a letter: the training operator names a Service after every
# replica (`NAME-worker-3`), and Service names must start with a letter.
_NAME = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
_NAME_MAX = 50  # leaves room for "-worker-NNN" within the 63-character limit
_QUANTITY = re.compile(r"^[0-9]+(\.[0-9]+)?(m|k|Ki|Mi|Gi|Ti|Pi|Ei|M|G|T|P|E)?$")
# Credential formats: Hugging Face, AWS access keys, GitHub, OpenAI-style, Slack.
_TOKEN_SHAPED = re.compile(r"^(hf_[A-Za-z0-9]{20,}|(AKIA|ASIA)[A-Z0-9]{16}|gh[pousr]_[A-Za-z0-9]{20,}|github_pat_"
                           r"|sk-|xox[abp]-)")
# Environment names that carry credentials: their values must come from a Secret reference.
SECRET_NAME = re.compile(r"(TOKEN|SECRET|PASSWORD|PASSWD|CREDENTIAL|API_KEY|ACCESS_KEY|PRIVATE_KEY)", re.I)


# Backends whose pods Kueue admits (PyTorchJob, TrainJob, HyperPodPyTorchJob), so it can place them.
TOPOLOGY_BACKENDS = CLUSTER_BACKENDS


def _name_text(raw: Any) -> Any:
    """A job name as written: YAML's `true`, `1.5` or `null` are not names (a string field elsewhere
    takes them as their text)."""
    if not isinstance(raw, str):
        raise fail(f"expected a name in quotes or plain letters, got {raw!r}")
    return raw


class JobSpec(Settings):
    name: Annotated[str, BeforeValidator(_name_text)] = option(
        "", "the job's name (lowercase letters, digits and '-')")
    backend: BackendName = option("local", "where it runs", what="a backend")
    image: Str | None = option(None, "the container image")
    namespace: Str = option("default", "Kubernetes namespace (where the spec names none: the kubeconfig "
                             "context's, as kubectl takes it, else default)")
    train: dict[str, Any] = option(default_factory=dict, help="the trainer's options (`fsdpkit train --help`)")
    command: list[Str] | None = option(None, "another program to run instead of the trainer")
    nodes: Nodes = option(NodeRange(1, 1), "N, or MIN:MAX for an elastic job")
    instance_type: Str | None = option(None, "EC2 instance type of the nodes")
    gpus_per_node: Int | None = option(None, "default: every GPU of the instance type", ge=0)
    procs_per_node: Int | None = option(None, "processes per node; default: GPUs per node (or 1)", ge=1)
    efa_per_node: Int | None = option(None, "default: every EFA interface of the instance type", ge=0)
    devices: Literal["auto", "dra", "extended"] = option(
        "auto", "how pods ask for GPUs and EFA: dra (DRA claims, each GPU with the EFA on its PCIe root), extended "
        "(nvidia.com/gpu, vpc.amazonaws.com/efa counts), auto (dra where `job submit` finds the drivers and the job "
        "has no queue)", what="a way to ask for devices")
    ofi_nccl: Str | None = option(None, "aws-ofi-nccl version in the image (1.14.0): picks how NCCL loads it")
    cpu: Str | None = option(None, "CPU request per node (a Kubernetes quantity)")
    memory: Str | None = option(None, "memory request per node (a Kubernetes quantity)")
    shm_size: Str = option("64Gi", "size of /dev/shm")
    storage: Storage = option(default_factory=Storage)
    env: dict[str, Str] = option(default_factory=dict, help="environment variables (no secrets)")
    secrets: list[SecretRef] = option(default_factory=list, help="variables filled from existing Secrets")
    hf_token_env: Str | None = option(None, "at submit, put the value of this local variable in a Secret")
    node_selector: dict[str, Str] = option(default_factory=dict, help="Kubernetes nodeSelector")
    tolerations: list[dict[str, Any]] = option(default_factory=list, help="Kubernetes tolerations")
    affinity: dict[str, Any] = option(default_factory=dict, help="Kubernetes affinity")
    priority_class: Str | None = option(
        None, "the job's priority: a Kubernetes PriorityClass, or with queue a Kueue WorkloadPriorityClass (set as "
        "Kueue's kueue.x-k8s.io/priority-class label, as the HyperPod CLI and task governance do)")
    queue: Str | None = option(None, "Kueue LocalQueue (it must exist in the namespace)")
    security: Literal["baseline", "restricted"] = option(
        "baseline", "the Pod Security level the pods meet: baseline (the image's own user; no privilege escalation), "
        "or restricted, for namespaces that enforce it (no root: the pods run as run_as_user; every capability "
        "dropped; the runtime's seccomp profile)", what="a Pod Security level")
    run_as_user: Int = option(1000, "with security: restricted, the user and group id the pods run as (the image "
                              "must work without root; HOME is /tmp)", ge=1)
    placement: Literal["any", "topology"] = option(
        "any", "topology: the job's nodes close together in the network, so NCCL's rings cross fewer switches "
        "(Kueue's topology-aware scheduling; needs queue)", what="a placement")
    topology: TopologyOptions = option(default_factory=TopologyOptions)
    max_restarts: Int = option(3, "torchrun restarts of a worker group (elasticPolicy.maxRestarts)", ge=0)
    backoff_limit: Int = option(3, "pod failures the operator tolerates (runPolicy.backoffLimit)", ge=0)
    ttl_after_finished: Int | None = option(7 * 24 * 3600, "seconds a finished job is kept", ge=0)
    termination_grace_seconds: Int | None = option(
        None, "seconds between SIGTERM and SIGKILL (default: enough to write a checkpoint; see `fsdpkit plan`)",
        ge=0)
    resubmits: Int = option(0, "whole-job resubmissions (resume from checkpoint) after Failed", ge=0)
    diagnose_network: Bool = option(False, "NCCL_DEBUG=INFO, for `fsdpkit job logs --check-network`")
    rdzv_port: Int = option(29500, "torchrun's rendezvous port", ge=1, le=65535)
    hyperpod: HyperPodOptions = option(default_factory=HyperPodOptions)
    trainjob: TrainJobOptions = option(default_factory=TrainJobOptions)
    slurm: SlurmOptions = option(default_factory=SlurmOptions)

    @model_validator(mode="before")
    @classmethod
    def _hyperpod_names(cls, raw: Any) -> Any:
        """HyperPod names (and labels) its nodes' instance types with `ml.`; the EC2 name would select
        no node, so it is renamed, and said once."""
        if isinstance(raw, dict) and raw.get("backend") == "hyperpod":
            it = raw.get("instance_type")
            if isinstance(it, str) and it and not it.startswith("ml."):
                log.info(f"instance_type: {it} is ml.{it} on HyperPod (its nodes are labelled so)")
                raw = {**raw, "instance_type": f"ml.{it}"}
        return raw

    @model_validator(mode="after")
    def _rules(self) -> JobSpec:
        validate(self)
        return self

    # -- derived values, one rule each -------------------------------------------------------------
    @property
    def instance(self) -> Instance | None:
        return lookup(self.instance_type) if self.instance_type else None

    @property
    def gpus(self) -> int:
        if self.gpus_per_node is not None:
            return self.gpus_per_node
        return self.instance.accelerators if self.instance else 0

    @property
    def procs(self) -> int:
        return self.procs_per_node or max(1, self.gpus)

    @property
    def efa(self) -> int:
        if self.efa_per_node is not None:
            return self.efa_per_node
        return self.instance.efa if self.instance else 0

    @property
    def cpu_request(self) -> str | None:
        """The spec's cpu, else the pod's share of the instance's vCPUs (see `_node_share`)."""
        return self.cpu or _node_share(self, lambda i: i.vcpus, "")

    @property
    def memory_request(self) -> str | None:
        """The spec's memory, else the pod's share of the instance's memory (see `_node_share`)."""
        return self.memory or _node_share(self, lambda i: i.memory_gib, "Gi")

    @property
    def accelerator_resource(self) -> str:
        return self.instance.resource if self.instance else "nvidia.com/gpu"

    @property
    def created_claim(self) -> str | None:
        """The PVC this tool creates (None when an existing claim is used or there is no storage)."""
        return f"{self.name}-ckpt" if self.storage.size and not self.storage.claim else None

    @property
    def claim_name(self) -> str | None:
        return self.storage.claim or self.created_claim

    @property
    def hf_secret_name(self) -> str | None:
        return f"{self.name}-hf-token" if self.hf_token_env else None

    def to_dict(self) -> dict[str, Any]:
        return self.model_dump()


# A pod asks for this share of what its GPUs' part of the node has (the rest is the kubelet's, the
# device plugins' and the node agents'). A pod that asks for no cpu or memory is BestEffort: the
# first evicted under memory pressure, and the API server refuses hugepages without one of them.
NODE_SHARE = 0.8


def _node_share(spec: JobSpec, amount: Callable[[Instance], int], unit: str) -> str | None:
    inst = spec.instance
    if inst is None:
        return None
    part = spec.gpus / inst.accelerators if inst.accelerators and spec.gpus else 1.0
    return f"{max(1, int(amount(inst) * NODE_SHARE * part))}{unit}"


# -- loading ------------------------------------------------------------------------------------------
# Spec fields whose keys are the user's own (variable names, Kubernetes labels): kept as written by --set.
_VERBATIM = ("env", "node_selector", "affinity")


def _set_dotted(doc: dict[str, Any], dotted: str, value: Any) -> None:
    """`--set a.b=v`. A field's name may be given in kebab case as on the command line
    (`train.max-steps`, `storage.storage-class`), except inside a mapping of the user's own keys."""
    parts = dotted.split(".")
    for i, part in enumerate(parts):
        if i and parts[i - 1].replace("-", "_") in _VERBATIM:
            break
        parts[i] = part.replace("-", "_")
    *parents, leaf = parts
    target = doc
    for p in parents:
        target = target.setdefault(p, {})
        if not isinstance(target, dict):
            raise UserError(f"--set {dotted}: {p} is not a section")
    target[leaf] = value


def parse_overrides(pairs: list[str]) -> list[tuple[str, Any]]:
    out = []
    for pair in pairs:
        key, sep, raw = pair.partition("=")
        if not sep or not key:
            raise UserError(f"--set {pair!r}: expected KEY=VALUE (for example nodes=4 or train.max_steps=100)")
        try:
            value = yamlfile.load(raw) if raw.strip() else ""
        except yaml.YAMLError as e:
            raise UserError(f"--set {key.strip()}: the value is not valid YAML: {describe_yaml_error(e)}") from None
        out.append((key.strip(), value))
    return out


def load_spec(path: str | Path | None, overrides: Sequence[tuple[str, Any]] = (),
              namespace: Callable[[], str | None] | None = None) -> JobSpec:
    """Read a spec file (or start from the defaults), apply overrides, validate. `namespace` gives
    the namespace of a cluster job whose file and overrides name none (kubectl's: the kubeconfig
    context's); it is not asked for a local or Slurm job."""
    doc = load_mapping(path, "job spec", "fields (name, image, nodes, ...)") if path is not None else {}
    for key, value in overrides:
        _set_dotted(doc, key, value)
    if namespace is not None and "namespace" not in doc and doc.get("backend") in CLUSTER_BACKENDS \
            and (found := namespace()):
        doc["namespace"] = found
    return load_spec_dict(doc)


def load_spec_dict(doc: dict[str, Any]) -> JobSpec:
    """A spec from a mapping (such as the spec.json the local backend keeps), validated."""
    return load(JobSpec, doc)


# -- validation -----------------------------------------------------------------------------------------
def check_variable_name(field_name: str, name: str) -> None:
    """Refuse anything but an environment variable's NAME where one is expected, and never echo a
    value that looks like a credential: it would land in logs, errors and manifests."""
    if _TOKEN_SHAPED.search(name) or (len(name) >= 20 and re.search(r"[a-z]", name) and re.search(r"[A-Z]", name)
                                      and re.search(r"\d", name)):
        raise UserError(f"{field_name}: looks like a token, not the NAME of an environment variable; give the "
                        "variable's name (for example HF_TOKEN) and keep its value in your shell")
    if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", name):
        raise UserError(f"{field_name}: must be the NAME of an environment variable (letters, digits, _), not "
                        "its value")


def _check_quantity(name: str, value: str | None) -> None:
    if value is not None and not _QUANTITY.match(value):
        raise UserError(f"{name}: {value!r} is not a Kubernetes quantity (for example 500m, 16, 64Gi)")


def validate(spec: JobSpec) -> None:
    """The rules between fields (each field's own type, range and choices are checked as it is
    read); the first one broken is a one-line UserError."""
    _validate_identity(spec)
    _validate_nodes(spec)
    _validate_placement(spec)
    _validate_storage(spec)
    _validate_environment(spec)
    if spec.train:
        _validate_train(spec)


def _validate_identity(spec: JobSpec) -> None:
    if not spec.name:
        raise UserError("name: a job name is required (lowercase letters, digits and '-')")
    if len(spec.name) > _NAME_MAX or not _NAME.match(spec.name):
        raise UserError(f"name: {spec.name!r} is not a valid job name: use at most {_NAME_MAX} lowercase letters, "
                        "digits and '-', starting with a letter and ending with a letter or digit (RFC 1123)")
    if spec.backend in CLUSTER_BACKENDS:   # names the API server checks, checked before anything is rendered
        names.check("namespace", spec.namespace, "label")
        for field in ("queue", "priority_class"):   # an object's name, and a label's value on the pods
            if (value := getattr(spec, field)) is not None:
                names.check(field, value, "subdomain", "label value")
    hp = spec.hyperpod
    if spec.backend == "hyperpod" and hp.operator == "kubeflow" and hp.auto_resume and \
            not (spec.namespace == "kubeflow" or spec.namespace.startswith("hyperpod")):
        raise UserError(f"namespace: HyperPod resumes a Kubeflow PyTorchJob only in the kubeflow namespace or one "
                        f"whose name starts with hyperpod, not {spec.namespace!r}; set namespace: kubeflow (or "
                        "hyperpod-...), or hyperpod.auto_resume: false")
    if spec.backend == "hyperpod" and hp.operator == "kubeflow" and (own := _operator_fields(hp)):
        raise UserError(f"hyperpod.{own[0]}: is a field of the HyperPod training operator's HyperPodPyTorchJob; "
                        "drop it, or set hyperpod.operator: hyperpod")
    if spec.backend != "hyperpod" and (own := _operator_fields(hp)):
        # Only the HyperPod training operator reads them: on another backend they would change nothing.
        raise UserError(f"hyperpod.{own[0]}: is a field of HyperPod's training operator (a HyperPodPyTorchJob); the "
                        f"{spec.backend} backend has no place for it: drop it, or set backend: hyperpod")
    if spec.backend == "hyperpod" and hp.spares and not spec.queue:
        raise UserError(f"hyperpod.spares: {hp.spares} spare nodes are held by Kueue; give queue: (the Kueue "
                        "LocalQueue the job is admitted through), or hyperpod.spares: 0")


def require_image(spec: JobSpec) -> str:
    """The image a Kubernetes pod of the job runs. Checked where a pod is made, not when the spec is
    read: `plan` and `job render --explain` of a spec whose image is not pushed yet still work."""
    if not spec.image:
        raise UserError(f"image: the {spec.backend} backend runs a container image; give image: "
                        "(for example ACCOUNT.dkr.ecr.REGION.amazonaws.com/fsdpkit:TAG; `fsdpkit image push` "
                        "prints it)")
    return spec.image


# HyperPodOptions fields that only the HyperPod training operator reads (not a Kubeflow PyTorchJob).
OPERATOR_FIELDS = ("spares", "repeat_offenders_to_avoid", "scale_up_snooze", "startup_deadline", "fault_deadline")


def _operator_fields(hp: HyperPodOptions) -> list[str]:
    """The HyperPodPyTorchJob-only fields given values other than their defaults."""
    return [f for f in OPERATOR_FIELDS if getattr(hp, f) != HyperPodOptions.model_fields[f].default]


def _validate_nodes(spec: JobSpec) -> None:
    """Node count, and what each node gets of its instance type."""
    if spec.nodes.elastic and spec.backend not in ("pytorchjob", "hyperpod"):
        raise UserError(f"nodes: elastic ranges need the pytorchjob or hyperpod backend, not {spec.backend} (a "
                        "TrainJob runs a fixed number of nodes)")
    if spec.nodes.elastic and spec.backend == "hyperpod" and spec.hyperpod.operator == "hyperpod" and \
            spec.command is None:
        # hyperpodrun's run() asserts min_nodes == max_nodes ("Elastic cluster size is currently not supported").
        raise UserError(f"nodes: {spec.nodes} is a range, and HyperPod's elastic agent (hyperpodrun) starts a "
                        f"fixed number of nodes; give nodes: {spec.nodes.max}, or hyperpod.operator: kubeflow for an "
                        "elastic PyTorchJob")
    if spec.backend == "local" and spec.nodes.min != 1:
        raise UserError("nodes: the local backend runs on this machine: nodes must be 1")
    inst = spec.instance  # raises for an unknown instance type
    if inst is not None:
        if spec.gpus > inst.accelerators:
            raise UserError(f"gpus_per_node: {spec.gpus} is more than {inst.name} has ({inst.accelerators} "
                            f"{inst.accelerator}); use at most {inst.accelerators}")
        if spec.efa_per_node and inst.efa == 0:
            raise UserError(f"efa_per_node: {inst.name} has no EFA interfaces; remove efa_per_node or pick an "
                            "EFA instance type (p4d, p5, p5e, p5en, g5.12xlarge and up, trn1.32xlarge)")
        if spec.efa > inst.efa:
            raise UserError(f"efa_per_node: {spec.efa} is more than {inst.name} has ({inst.efa})")
    if spec.devices == "dra":
        if spec.backend not in CLUSTER_BACKENDS:
            raise UserError(f"devices: dra is Kubernetes' Dynamic Resource Allocation; the {spec.backend} backend "
                            "has none: remove devices, or pick a Kubernetes backend")
        if inst is not None and inst.resource != "nvidia.com/gpu":
            raise UserError(f"devices: dra asks NVIDIA's DRA driver for GPUs; {inst.name} has {inst.accelerator} "
                            f"({inst.resource}): set devices: extended")


def _validate_placement(spec: JobSpec) -> None:
    """Topology placement is Kueue's to do: on a backend whose pods Kueue admits, through a queue."""
    if spec.placement != "topology":
        return
    if spec.backend not in TOPOLOGY_BACKENDS:
        raise UserError(f"placement: topology is placed by Kueue, which does not admit {spec.backend} jobs; use the "
                        f"{', '.join(TOPOLOGY_BACKENDS[:-1])} or {TOPOLOGY_BACKENDS[-1]} backend, or placement: any"
                        + (" (on Slurm, ask sbatch for --switches with the topology plugin)" if spec.backend == "slurm"
                           else ""))
    if not spec.queue:
        raise UserError("placement: topology needs queue: (a Kueue LocalQueue whose ClusterQueue has a Topology "
                        "of the node labels), or placement: any")
    level = spec.topology.level
    if not re.fullmatch(r"([a-z0-9]([-a-z0-9.]*[a-z0-9])?/)?[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?", level):
        raise UserError(f"topology.level: {level!r} is not a node label key (such as {AWS_TOPOLOGY_LEVELS[0]})")
    if spec.backend == "hyperpod" and level not in AWS_TOPOLOGY_LEVELS:
        raise UserError(f"topology.level: HyperPod labels its nodes' topology as one of "
                        f"{', '.join(AWS_TOPOLOGY_LEVELS)}, not {level!r}")


def _validate_storage(spec: JobSpec) -> None:
    for name in ("cpu", "memory", "shm_size"):
        _check_quantity(name, getattr(spec, name))
    _check_quantity("storage.size", spec.storage.size)
    if spec.storage.shared_path and spec.backend in CLUSTER_BACKENDS:
        raise UserError("storage.shared_path: is for Slurm and local jobs; on Kubernetes give storage.claim "
                        "(an existing PVC) or storage.size")
    if spec.storage.claim and spec.storage.size:
        raise UserError("storage: give either claim (an existing PVC) or size (a new PVC), not both")
    if spec.backend in CLUSTER_BACKENDS:   # the names the pods' volumes and a new PVC carry
        for field in ("claim", "storage_class"):
            if (value := getattr(spec.storage, field)) is not None:
                names.check(f"storage.{field}", value, "subdomain")
    if spec.storage.size and not spec.storage.storage_class:
        raise UserError("storage.storage_class: a new PVC needs a storage class (for example fsx-sc or efs-sc)")
    if not spec.storage.mount_path.startswith("/"):
        raise UserError(f"storage.mount_path: {spec.storage.mount_path!r} must be an absolute path")


def _validate_environment(spec: JobSpec) -> None:
    """Variables, secrets and the command: no secret value or token is ever written into the spec."""
    for key, value in spec.env.items():
        if SECRET_NAME.search(key) and value:
            raise UserError(f"env.{key}: looks like a secret and must not be written into the spec; reference a "
                            f"Kubernetes Secret instead (secrets: [{{env: {key}, secret: NAME, key: KEY}}]) or "
                            "use hf_token_env for the Hugging Face token")
        check_variable_name(f"env.{key}", key)
    for i, ref in enumerate(spec.secrets):
        for f in ("env", "secret", "key"):
            if not getattr(ref, f):
                raise UserError(f"secrets[{i}].{f}: required")
        check_variable_name(f"secrets[{i}].env", ref.env)
    if spec.hf_token_env:
        check_variable_name("hf_token_env", spec.hf_token_env)
    if spec.command is not None and spec.train:
        raise UserError("command: give either train (fsdpkit's trainer options) or command (another program)")
    if spec.command is not None and not spec.command:
        raise UserError("command: must not be empty")
    if spec.ofi_nccl is not None and not re.fullmatch(r"\d+\.\d+(\.\d+)?(-aws)?", spec.ofi_nccl):
        raise UserError(f"ofi_nccl: {spec.ofi_nccl!r} is not an aws-ofi-nccl version (for example 1.14.0)")


def output_root(spec: JobSpec) -> str | None:
    """Where the job's outputs go on its nodes: its storage, or for a local job without a shared
    path FSDPKIT_HOME's jobs directory; None where nothing keeps them."""
    if spec.backend == "local" and not spec.storage.shared_path:
        return str(jobs_home())
    return spec.storage.root


def _validate_train(spec: JobSpec) -> None:
    """The rules between the trainer's options and the job's other fields. The trainer's own rules
    are checked when the job is resolved (fsdpkit.jobs.resolved), on the options it will pass."""
    root = output_root(spec)
    flat = flat_options(spec.train)
    for name, field in LAUNCHER_OPTIONS.items():
        if name in flat:
            # The job's launcher (torchrun, hyperpodrun, srun) starts and restarts the processes from the
            # spec's own field; the trainer's option would be ignored on a cluster, or win locally.
            raise UserError(f"train.{name}: a job's launcher takes this from the spec; set {field}: "
                            f"{flat[name]} (a top-level field) and drop train.{name}")
    if flat.get("tiered") or flat.get("tiered_checkpoint"):
        if spec.backend != "hyperpod":
            # Elsewhere no in-memory store answers: every stop's save would go to shared storage in a
            # grace period planned for node memory.
            raise UserError(f"train.tiered: HyperPod's managed tiered checkpointing runs on HyperPod clusters (its "
                            f"in-memory store); use backend: hyperpod, or drop train.tiered on {spec.backend}")
        if root is None:
            raise UserError("storage: train.tiered keeps the last step and every durable_every-th checkpoint on "
                            "shared storage; give storage.claim or storage.size and storage.storage_class")
    every = named(flat, CheckpointConfig, "checkpoint_every")
    if every is not None and str(flat[every]) != "0" and root is None:
        raise UserError("storage: train.checkpoint_every is set but the job has no storage, so checkpoints "
                        "would be written inside the container and lost; give storage.claim (an existing PVC "
                        "such as FSx for Lustre) or storage.size and storage.storage_class")


# Trainer options a job spec owns as its own fields (what every node's launcher is given).
LAUNCHER_OPTIONS = {"max_restarts": "max_restarts", "nproc": "procs_per_node"}


def named(flat: dict[str, Any], owner: type[Settings], option: str) -> str | None:
    """Under which name (the option's own, or an alias) flattened trainer options give `option`
    of the section `owner`; None when they do not."""
    names = (option, *aliases(owner.model_fields[option]))
    return next((n for n in names if n in flat), None)


def flat_options(doc: dict[str, Any]) -> dict[str, Any]:
    """Trainer options with their `section: {...}` blocks flattened."""
    out: dict[str, Any] = {}
    for k, v in doc.items():
        out.update(v if k in SECTIONS and isinstance(v, dict) else {k: v})
    return out
