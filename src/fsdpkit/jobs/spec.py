"""JobSpec: one typed description of a training run that every backend renders.

Defaults live in the dataclasses below and nowhere else. A spec comes from a YAML file, then
`--set key=value` overrides (dotted for sections: `hyperpod.auto_resume=false`,
`train.max_steps=100`), then `validate`, which rejects a bad value with the field's name before
anything is rendered or sent to a cluster.
"""

from __future__ import annotations

import dataclasses
import re
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from fsdpkit.errors import UserError
from fsdpkit.hardware.instances import Instance, lookup
from fsdpkit.image import pins
from fsdpkit.train.config import SECTIONS, build
from fsdpkit.yamlfile import describe_yaml_error, load_mapping

BACKENDS = ("local", "pytorchjob", "hyperpod", "slurm")
CLUSTER_BACKENDS = ("pytorchjob", "hyperpod")

# RFC 1123 label, starting with a letter: the training operator names a Service after every
# replica (`NAME-worker-3`), and Service names must start with a letter.
_NAME = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
_NAME_MAX = 50  # leaves room for "-worker-NNN" within the 63-character limit
_QUANTITY = re.compile(r"^[0-9]+(\.[0-9]+)?(m|k|Ki|Mi|Gi|Ti|Pi|Ei|M|G|T|P|E)?$")
# Credential formats: Hugging Face, AWS access keys, GitHub, OpenAI-style, Slack.
_TOKEN_SHAPED = re.compile(r"^(hf_[A-Za-z0-9]{20,}|(AKIA|ASIA)[A-Z0-9]{16}|gh[pousr]_[A-Za-z0-9]{20,}|github_pat_"
                           r"|sk-|xox[abp]-)")
# Environment names that carry credentials: their values must come from a Secret reference.
_SECRET_NAME = re.compile(r"(TOKEN|SECRET|PASSWORD|PASSWD|CREDENTIAL|API_KEY|ACCESS_KEY|PRIVATE_KEY)", re.I)


@dataclass
class Storage:
    """Where checkpoints and run outputs live: an existing PVC (FSx for Lustre, EFS) or a new one."""

    claim: str | None = None          # existing PersistentVolumeClaim
    size: str | None = None           # create NAME-ckpt of this size ...
    storage_class: str | None = None  # ... with this storage class
    access_mode: str = "ReadWriteMany"
    mount_path: str = "/checkpoints"
    shared_path: str | None = None    # Slurm / local: a directory every node already mounts (/fsx)
    # The volume's aggregate write throughput (FSx for Lustre: per-TiB tier x capacity); sizes the
    # time a stopping job is given to finish its checkpoint (fsdpkit.plan.grace).
    write_mb_per_s: int = 500

    @property
    def enabled(self) -> bool:
        return bool(self.claim or self.size or self.shared_path)

    @property
    def root(self) -> str | None:
        """Where the job's outputs live inside the container or on the node."""
        if self.shared_path:
            return self.shared_path
        return self.mount_path if (self.claim or self.size) else None


@dataclass
class SecretRef:
    """An environment variable filled from a key of an existing Kubernetes Secret."""

    env: str
    secret: str
    key: str


@dataclass
class HyperPodOptions:
    auto_resume: bool = True         # sagemaker.amazonaws.com/enable-job-auto-resume
    max_retry: int = 3               # sagemaker.amazonaws.com/job-max-retry-count
    instance_group: str | None = None
    deep_health_check: str = "preferred"   # preferred | required | off
    kind: str = "PyTorchJob"               # PyTorchJob | HyperPodPyTorchJob


@dataclass
class SlurmOptions:
    partition: str | None = None
    account: str | None = None
    time: str | None = None          # e.g. "2-00:00:00"
    container_image: str | None = None   # pyxis/enroot image; empty: run on the host's Python
    container_mounts: list[str] = field(default_factory=list)
    script_dir: str = "."
    output: str = "%x-%j.out"


@dataclass
class JobSpec:
    name: str = ""
    backend: str = "local"
    image: str | None = None
    namespace: str = "default"
    # The trainer's options (`fsdpkit train --help`), or `command` for another program.
    train: dict[str, Any] = field(default_factory=dict)
    command: list[str] | None = None
    nodes: str = "1"                 # N, or "MIN:MAX" for an elastic job
    instance_type: str | None = None
    gpus_per_node: int | None = None   # default: every GPU of the instance type
    procs_per_node: int | None = None  # processes per node; default: GPUs per node (or 1)
    efa_per_node: int | None = None    # default: every EFA interface of the instance type
    ofi_nccl: str | None = None        # aws-ofi-nccl version in the image (1.14.0): picks how NCCL loads it
    cpu: str | None = None
    memory: str | None = None
    shm_size: str = "64Gi"
    storage: Storage = field(default_factory=Storage)
    env: dict[str, str] = field(default_factory=dict)
    secrets: list[SecretRef] = field(default_factory=list)
    hf_token_env: str | None = None  # at submit, put the value of this local env var in a Secret
    node_selector: dict[str, str] = field(default_factory=dict)
    tolerations: list[dict[str, Any]] = field(default_factory=list)
    affinity: dict[str, Any] = field(default_factory=dict)
    priority_class: str | None = None
    queue: str | None = None         # Kueue LocalQueue
    max_restarts: int = 3            # torchrun restarts of a worker group (elasticPolicy.maxRestarts)
    backoff_limit: int = 3           # pod failures the operator tolerates (runPolicy.backoffLimit)
    ttl_after_finished: int | None = 7 * 24 * 3600
    # Seconds between SIGTERM and SIGKILL; default: enough to write a checkpoint (see `fsdpkit plan`).
    termination_grace_seconds: int | None = None
    resubmits: int = 0               # whole-job resubmissions (resume from checkpoint) after Failed
    diagnose_network: bool = False   # NCCL_DEBUG=INFO, for `fsdpkit job logs --check-network`
    rdzv_port: int = 29500
    hyperpod: HyperPodOptions = field(default_factory=HyperPodOptions)
    slurm: SlurmOptions = field(default_factory=SlurmOptions)

    # -- derived values, one rule each -------------------------------------------------------------
    @property
    def instance(self) -> Instance | None:
        return lookup(self.instance_type) if self.instance_type else None

    @property
    def node_range(self) -> tuple[int, int]:
        lo, _, hi = str(self.nodes).partition(":")
        return int(lo), int(hi or lo)

    @property
    def elastic(self) -> bool:
        lo, hi = self.node_range
        return ":" in str(self.nodes) and lo != hi

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
        return dataclasses.asdict(self)


# -- loading ------------------------------------------------------------------------------------------
def _convert(path: str, raw: Any, tp: Any) -> Any:
    """Turn a YAML value into the annotated type, or raise a UserError naming the field."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        if raw is None:
            return None
        tp = next(a for a in args if a is not type(None))
        origin, args = typing.get_origin(tp), typing.get_args(tp)
    if dataclasses.is_dataclass(tp):
        if not isinstance(raw, dict):
            raise UserError(f"{path}: expected a mapping of {', '.join(f.name for f in dataclasses.fields(tp))}, "
                            f"got {raw!r}")
        return _build(tp, raw, path)
    if origin is list:
        if not isinstance(raw, list):
            raise UserError(f"{path}: expected a list, got {raw!r}")
        return [_convert(f"{path}[{i}]", v, args[0]) for i, v in enumerate(raw)]
    if origin is dict:
        if not isinstance(raw, dict):
            raise UserError(f"{path}: expected a mapping, got {raw!r}")
        if args and args[1] is str:
            return {str(k): _scalar_str(f"{path}.{k}", v) for k, v in raw.items()}
        return dict(raw)
    return _convert_scalar(path, raw, tp)


def _convert_scalar(path: str, raw: Any, tp: Any) -> Any:
    if tp is bool:
        if isinstance(raw, bool):
            return raw
        if str(raw).lower() in ("true", "yes", "on", "1"):
            return True
        if str(raw).lower() in ("false", "no", "off", "0"):
            return False
        raise UserError(f"{path}: expected true or false, got {raw!r}")
    if tp is int:
        if isinstance(raw, bool) or not re.fullmatch(r"-?\d+", str(raw).strip()):
            raise UserError(f"{path}: expected an integer, got {raw!r}")
        return int(raw)
    if tp is str:
        return _scalar_str(path, raw)
    return raw


def _scalar_str(path: str, raw: Any) -> str:
    if isinstance(raw, (dict, list)) or raw is None:
        raise UserError(f"{path}: expected a string, got {raw!r}")
    return str(raw).lower() if isinstance(raw, bool) else str(raw)


def _build(cls: type, doc: dict, prefix: str = "") -> Any:
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    values = {}
    for key, raw in doc.items():
        path = f"{prefix}.{key}" if prefix else str(key)
        if key not in names:
            raise UserError(f"{path}: unknown field; allowed: {', '.join(sorted(names))}")
        if cls is JobSpec and key == "secrets" and isinstance(raw, list):
            for i, item in enumerate(raw):
                if not isinstance(item, dict):
                    raise UserError(f"secrets[{i}]: give a reference {{env, secret, key}} to an existing "
                                    "Kubernetes Secret, not a value")
        values[key] = _convert(path, raw, hints[key])
    try:
        return cls(**values)
    except TypeError as e:  # a required field (SecretRef.env, ...) is missing
        missing = str(e).split("argument")[-1].strip(": ")
        raise UserError(f"{prefix or cls.__name__}: missing {missing}") from None


def _set_dotted(doc: dict, dotted: str, value: Any) -> None:
    *parents, leaf = dotted.split(".")
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
            value = yaml.safe_load(raw) if raw.strip() else ""
        except yaml.YAMLError as e:
            raise UserError(f"--set {key.strip()}: the value is not valid YAML: {describe_yaml_error(e)}") from None
        out.append((key.strip(), value))
    return out


def load_spec(path: str | Path | None, overrides: list[tuple[str, Any]] = (), pin_image: bool = False) -> JobSpec:
    """Read a spec file (or start from the defaults), apply overrides, validate. With `pin_image`,
    an image this machine pushed (`fsdpkit image push`) runs as the digest it was pushed as, unless
    the image was given as an override."""
    doc = load_mapping(path, "job spec", "fields (name, image, nodes, ...)") if path is not None else {}
    for key, value in overrides:
        _set_dotted(doc, key, value)
    spec = load_spec_dict(doc)
    if pin_image and not any(key == "image" for key, _ in overrides) and (digest := pins.pinned(spec.image)):
        spec = dataclasses.replace(spec, image=digest)
    return spec


def load_spec_dict(doc: dict[str, Any]) -> JobSpec:
    """A spec from a mapping (such as the spec.json the local backend keeps), validated."""
    doc = dict(doc)
    if "nodes" in doc:
        doc["nodes"] = str(doc["nodes"])
    spec = _build(JobSpec, doc)
    validate(spec)
    return spec


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
    """Every rule of a spec, section by section; the first one broken is a one-line UserError."""
    _validate_identity(spec)
    _validate_nodes(spec)
    _validate_storage(spec)
    _validate_environment(spec)
    _validate_policies(spec)
    if spec.train:
        _validate_train(spec)


def _validate_identity(spec: JobSpec) -> None:
    if not spec.name:
        raise UserError("name: a job name is required (lowercase letters, digits and '-')")
    if len(spec.name) > _NAME_MAX or not _NAME.match(spec.name):
        raise UserError(f"name: {spec.name!r} is not a valid job name: use at most {_NAME_MAX} lowercase letters, "
                        "digits and '-', starting with a letter and ending with a letter or digit (RFC 1123)")
    if spec.backend not in BACKENDS:
        raise UserError(f"backend: {spec.backend!r} is not a backend; choose one of: {', '.join(BACKENDS)}")
    if spec.backend in CLUSTER_BACKENDS and not spec.image:
        raise UserError(f"image: the {spec.backend} backend runs a container image; give image: "
                        "(for example ACCOUNT.dkr.ecr.REGION.amazonaws.com/fsdpkit:TAG)")


def _validate_nodes(spec: JobSpec) -> None:
    """Node count, and what each node gets of its instance type."""
    if not re.fullmatch(r"\d+(:\d+)?", spec.nodes):
        raise UserError(f"nodes: {spec.nodes!r} must be a count (2) or an elastic range (MIN:MAX, such as 2:4)")
    lo, hi = spec.node_range
    if lo < 1 or hi < lo:
        raise UserError(f"nodes: {spec.nodes!r} must be >= 1, and MIN <= MAX")
    if spec.elastic and spec.backend not in CLUSTER_BACKENDS:
        raise UserError(f"nodes: elastic ranges need the pytorchjob or hyperpod backend, not {spec.backend}")
    if spec.backend == "local" and lo != 1:
        raise UserError("nodes: the local backend runs on this machine: nodes must be 1")
    inst = spec.instance  # raises for an unknown instance type
    for name in ("gpus_per_node", "procs_per_node", "efa_per_node"):
        v = getattr(spec, name)
        if v is not None and v < (1 if name == "procs_per_node" else 0):
            raise UserError(f"{name}: {v} is out of range; it must be >= {1 if name == 'procs_per_node' else 0}")
    if inst is not None:
        if spec.gpus > inst.accelerators:
            raise UserError(f"gpus_per_node: {spec.gpus} is more than {inst.name} has ({inst.accelerators} "
                            f"{inst.accelerator}); use at most {inst.accelerators}")
        if spec.efa_per_node and inst.efa == 0:
            raise UserError(f"efa_per_node: {inst.name} has no EFA interfaces; remove efa_per_node or pick an "
                            "EFA instance type (p4d, p5, p5e, p5en, g5.12xlarge and up, trn1.32xlarge)")
        if spec.efa > inst.efa:
            raise UserError(f"efa_per_node: {spec.efa} is more than {inst.name} has ({inst.efa})")


def _validate_storage(spec: JobSpec) -> None:
    for name in ("cpu", "memory", "shm_size"):
        _check_quantity(name, getattr(spec, name))
    _check_quantity("storage.size", spec.storage.size)
    if spec.storage.shared_path and spec.backend in CLUSTER_BACKENDS:
        raise UserError("storage.shared_path: is for Slurm and local jobs; on Kubernetes give storage.claim "
                        "(an existing PVC) or storage.size")
    if spec.storage.claim and spec.storage.size:
        raise UserError("storage: give either claim (an existing PVC) or size (a new PVC), not both")
    if spec.storage.size and not spec.storage.storage_class:
        raise UserError("storage.storage_class: a new PVC needs a storage class (for example fsx-sc or efs-sc)")
    if not spec.storage.mount_path.startswith("/"):
        raise UserError(f"storage.mount_path: {spec.storage.mount_path!r} must be an absolute path")
    if spec.storage.write_mb_per_s < 1:
        raise UserError(f"storage.write_mb_per_s: {spec.storage.write_mb_per_s} is out of range; it must be >= 1")


def _validate_environment(spec: JobSpec) -> None:
    """Variables, secrets and the command: no secret value or token is ever written into the spec."""
    for key, value in spec.env.items():
        if _SECRET_NAME.search(key) and value:
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


def _validate_policies(spec: JobSpec) -> None:
    """Restart, retention and rendezvous settings, and HyperPod's own."""
    for name in ("max_restarts", "backoff_limit", "resubmits", "ttl_after_finished", "termination_grace_seconds"):
        v = getattr(spec, name)
        if v is not None and v < 0:
            raise UserError(f"{name}: {v} is out of range; it must be >= 0")
    if not 1 <= spec.rdzv_port <= 65535:
        raise UserError(f"rdzv_port: {spec.rdzv_port} is out of range; it must be 1..65535")
    hp = spec.hyperpod
    if hp.deep_health_check not in ("preferred", "required", "off"):
        raise UserError(f"hyperpod.deep_health_check: {hp.deep_health_check!r}; choose preferred, required or off")
    if hp.kind not in ("PyTorchJob", "HyperPodPyTorchJob"):
        raise UserError(f"hyperpod.kind: {hp.kind!r}; choose PyTorchJob or HyperPodPyTorchJob")
    if hp.max_retry < 0:
        raise UserError(f"hyperpod.max_retry: {hp.max_retry} is out of range; it must be >= 0")


def train_config(spec: JobSpec) -> Any:
    """The TrainConfig the job's nodes will run (output directories on the job's storage)."""
    root = "/local-job-dir" if spec.backend == "local" and not spec.storage.shared_path else spec.storage.root
    return build([train_options(spec, root)])


def _validate_train(spec: JobSpec) -> None:
    """The trainer's own rules, run here so a bad option fails before submission, not in a pod.
    Checked on the options the job will really pass (output directories on the job's storage)."""
    root = "/local-job-dir" if spec.backend == "local" and not spec.storage.shared_path else spec.storage.root
    if flat_options(spec.train).get("checkpoint_freq") and root is None:
        raise UserError("storage: train.checkpoint_freq is set but the job has no storage, so checkpoints "
                        "would be written inside the container and lost; give storage.claim (an existing PVC "
                        "such as FSx for Lustre) or storage.size and storage.storage_class")
    try:
        train_config(spec)
    except UserError as e:
        raise UserError(f"train.{e}") from None


def output_dirs(spec: JobSpec, root: str) -> dict[str, str]:
    """Checkpoints and run outputs of this job under `root` (the mounted storage)."""
    return {"checkpoint_dir": f"{root}/{spec.name}/checkpoints", "run_dir": f"{root}/{spec.name}/run"}


def train_options(spec: JobSpec, root: str | None) -> dict[str, Any]:
    """The trainer's options for this job. With storage, checkpoints and metrics go to the shared
    volume and every start resumes from the newest checkpoint there: a restarted pod, a resubmitted
    job and HyperPod's auto-resume all continue instead of starting over."""
    opts = dict(spec.train)
    if root is not None:
        flat = flat_options(opts)
        dirs = output_dirs(spec, root)
        if "checkpoint_dir" not in flat:
            opts["checkpoint_dir"] = dirs["checkpoint_dir"]
        if "run_dir" not in flat:
            opts["run_dir"] = dirs["run_dir"]
        if "resume_from_checkpoint" not in flat and "resume" not in flat:
            opts["resume_from_checkpoint"] = "auto"
    return opts


def flat_options(doc: dict[str, Any]) -> dict[str, Any]:
    """Trainer options with their `section: {...}` blocks flattened."""
    out: dict[str, Any] = {}
    for k, v in doc.items():
        out.update(v if k in SECTIONS and isinstance(v, dict) else {k: v})
    return out
