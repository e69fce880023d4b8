"""Starter job specs from the installed package, not a source checkout: the example specs ship as
package data (`fsdpkit examples list|show`), and `fsdpkit job init` writes a spec with every field,
each with a one-line comment from the field's own help text, so the spec documents itself.

Fields given on the command line are written as values; the rest are written commented out with
their defaults, except the sections of other backends, which are left out.
"""

from __future__ import annotations

from importlib import resources
from typing import Any, cast

import yaml
from pydantic import BaseModel

from fsdpkit.cluster import kueue
from fsdpkit.errors import NotFound, UserError
from fsdpkit.jobs.resolved import resolve
from fsdpkit.jobs.spec import CLUSTER_BACKENDS, JobSpec, load_spec_dict
from fsdpkit.settings import Settings, section_of
from fsdpkit.train.config import TrainOptions

_EXAMPLES = "examples"
# The backend each optional section belongs to, and what each section is.
_SECTION_BACKEND = {"hyperpod": "hyperpod", "trainjob": "trainjob", "slurm": "slurm"}
_SECTION_HELP = {"storage": "where checkpoints and run outputs live (on: checkpoints survive the pod)",
                 "hyperpod": "SageMaker HyperPod: the operator, its restarts and health rules",
                 "trainjob": "Kubeflow Trainer v2", "slurm": "sbatch options", "train": "the trainer's options",
                 "topology": "with placement: topology, the level Kueue keeps the nodes under"}
# The trainer options a starter spec names (every one is in `fsdpkit train --help`).
_TRAIN_OPTIONS = (("preset", None), ("init_from_hf", "checkpoint"), ("dataset", "data"), ("data_format", "data"),
                  ("dataset_config_name", "data"), ("tokenizer", "data"), ("lora", "adapters"),
                  ("lora_rank", "adapters"), ("base_dtype", "adapters"), ("objective", "loss"), ("dpo_beta", "loss"),
                  ("seq_len", "data"), ("train_batch_size", "data"), ("max_steps", "optim"), ("tokens", "optim"),
                  ("lr", "optim"),
                  ("activation_checkpointing", "parallel"), ("checkpoint_every", "checkpoint"),
                  ("keep_last", "checkpoint"))


# What ships beside the job specs: a project's requirements file, for `image init` and `image check`.
_SUFFIXES = (".yaml", ".txt")


def _files() -> dict[str, Any]:
    """Example name -> its packaged file."""
    root = resources.files(__package__) / _EXAMPLES
    return {f.name.rsplit(".", 1)[0]: f for f in sorted(root.iterdir(), key=lambda p: p.name)
            if f.name.endswith(_SUFFIXES)}


def examples() -> dict[str, str]:
    """Example name -> its first comment line (what it shows)."""
    out = {}
    for name, f in _files().items():
        head = " ".join(line.lstrip("# ").strip() for line in f.read_text().splitlines()
                        if line.startswith("# ") and not line.startswith("#  "))
        out[name] = head.split(": ")[0].split(". ")[0].rstrip(".")
    return out


def spec_examples() -> list[str]:
    """The examples that are job specs."""
    return [name for name, f in _files().items() if f.name.endswith(".yaml")]


def example(name: str) -> str:
    """An example's text (NAME, or NAME with its suffix)."""
    files = _files()
    name = next((name.removesuffix(s) for s in _SUFFIXES if name.removesuffix(s) in files), name)
    if name not in files:
        raise NotFound(f"example {name!r} not found; see `fsdpkit examples list` ({', '.join(files)})")
    return cast("str", files[name].read_text())


def _value(v: Any) -> str:
    return cast("str", yaml.safe_dump(v, default_flow_style=True, width=1000).strip().removesuffix("...").strip())


def _help(model: type[BaseModel], name: str) -> str:
    """The field's help, its first sentence: one comment line."""
    text = " ".join((model.model_fields[name].description or "").split())
    return text.split(". ")[0]


def _line(indent: int, name: str, value: Any, help_text: str, active: bool) -> str:
    text = f"{' ' * indent}{'' if active else '# '}{name}: {_value(value)}"
    return f"{text:<48} # {help_text}" if help_text else text


def _default(model: type[BaseModel], name: str) -> Any:
    f = model.model_fields[name]
    value = f.get_default(call_default_factory=True)
    return value.model_dump() if isinstance(value, BaseModel) else str(value) if name == "nodes" else value


def _section(model: type[Settings], values: dict[str, Any], indent: int) -> list[str]:
    lines = []
    for name in model.model_fields:
        active = name in values
        lines.append(_line(indent, name, values[name] if active else _default(model, name), _help(model, name),
                           active))
    return lines


def _team_fields(backend: str, team: str | None, priority: str | None) -> dict[str, Any]:
    """A team's namespace and LocalQueue as HyperPod task governance names them, and its priority."""
    if priority and not team:
        raise UserError("--priority: a Kueue priority needs --team (the team's queue orders jobs by it)")
    if not team:
        return {}
    if backend not in CLUSTER_BACKENDS:
        raise UserError(f"--team: a team's quota is a Kueue queue on Kubernetes; pick a Kubernetes backend "
                        f"({', '.join(CLUSTER_BACKENDS)}), not {backend}")
    return {"namespace": kueue.TEAM_NAMESPACE.format(team=team), "queue": kueue.TEAM_QUEUE.format(team=team),
            **({"priority_class": priority} if priority else {})}


def _top_fields(backend: str, name: str, image: str | None, instance_type: str | None, nodes: str | None,
                team: str | None, priority: str | None) -> dict[str, Any]:
    """The spec's top-level fields given: HyperPod's instance types by its names (ml.), a fixed
    node count as a number, a team's namespace and queue."""
    if backend == "hyperpod" and instance_type and not instance_type.startswith("ml."):
        instance_type = f"ml.{instance_type}"  # how HyperPod names (and labels) its instance types
    top: dict[str, Any] = {"name": name, "backend": backend, **_team_fields(backend, team, priority)}
    top.update({k: v for k, v in (("image", image), ("instance_type", instance_type), ("nodes", nodes)) if v})
    if nodes and nodes.isdigit():
        top["nodes"] = int(nodes)
    return top


def starter(backend: str, name: str, instance_type: str | None = None, nodes: str | None = None,
            image: str | None = None, preset: str | None = None, claim: str | None = None,
            shared_path: str | None = None, dataset: str | None = None, tokenizer: str | None = None,
            init_from_hf: str | None = None, data_format: str | None = None, lora: bool = False,
            dataset_config_name: str | None = None, objective: str | None = None,
            base_dtype: str | None = None, team: str | None = None, priority: str | None = None) -> str:
    """The text of a starter spec; it loads back as the spec these values describe (checked here).
    `team`: the job goes where HyperPod task governance puts a team's work, its namespace and its
    LocalQueue, with `priority` as a Kueue WorkloadPriorityClass of the cluster's policy."""
    top = _top_fields(backend, name, image, instance_type, nodes, team, priority)
    instance_type = top.get("instance_type")
    storage = {k: v for k, v in (("claim", claim), ("shared_path", shared_path)) if v}
    train = {k: v for k, v in (("preset", preset), ("init_from_hf", init_from_hf), ("dataset", dataset),
                                ("dataset_config_name", dataset_config_name), ("data_format", data_format),
                                ("tokenizer", tokenizer), ("lora", lora), ("base_dtype", base_dtype),
                                ("objective", objective)) if v}
    # HyperPod's Slurm (its ml. instance names): srun resumes a job after HyperPod replaces a node.
    slurm = {"hyperpod": True} if backend == "slurm" and instance_type and instance_type.startswith("ml.") else {}
    doc = {**top, **({"storage": storage} if storage else {}), **({"train": train} if train else {}),
           **({"slurm": slurm} if slurm else {})}
    # A bad value is refused here, before anything is written. A cluster job's image may be filled in
    # later (written commented out): `plan` reads the spec without one, rendering says it is missing.
    spec = load_spec_dict(doc)
    # What the job will really use where the spec says nothing: the preset's recipe, and checkpoint_every
    # from its storage.
    trainer = resolve(spec).trainer
    assert trainer is not None  # a starter spec runs fsdpkit's trainer
    cfg = trainer.config
    derived = {name: getattr(getattr(cfg, group) if group else cfg, name) for name, group in _TRAIN_OPTIONS}

    lines = _header(backend, image, team, dataset, storage)
    lines += _field_lines(backend, top, {"storage": storage, "train": train, "slurm": slurm}, derived)
    return "\n".join(lines) + "\n"




def _header(backend: str, image: str | None, team: str | None, dataset: str | None,
            storage: dict[str, Any]) -> list[str]:
    """The spec's opening comments: how to use it, and what it still lacks for its backend."""
    lines = [f"# fsdpkit job spec ({backend}), written by `fsdpkit job init`. Every field is listed with what it",
             "# does; uncomment one to change it. Render it with `fsdpkit job render FILE`, check it will fit with",
             "# `fsdpkit plan FILE`, and submit with `fsdpkit job submit FILE` (--dry-run first)."]
    if backend in CLUSTER_BACKENDS and not image:
        lines.append("# image: is required: `fsdpkit image push` prints the URI of the image it pushed.")
    if team:
        lines.append(f"# team {team}: its quota and use: `fsdpkit cluster check --team {team}`; its priorities: "
                     "`kubectl get workloadpriorityclasses`.")
    if backend != "local" and not dataset:
        lines.append("# train.dataset: the embedded sample text unless you name your data (a hub dataset, or token "
                     "shards from `fsdpkit data prepare` on the storage)")
    if backend != "local" and not storage:
        lines.append("# storage: without it checkpoints are lost with the pod; give storage.claim (an FSx for "
                     "Lustre PVC)" if backend in CLUSTER_BACKENDS else
                     "# storage: without it checkpoints are lost; give storage.shared_path (a shared mount, /fsx)")
    return lines


def _field_lines(backend: str, top: dict[str, Any], sections: dict[str, dict[str, Any]],
                 derived: dict[str, Any]) -> list[str]:
    """Every field of the spec in its order, `train:` last: the given ones set, the others commented
    out with their defaults (the trainer's options with what the job derives); a section another
    backend's is left out."""
    lines = []
    for field in [*(f for f in JobSpec.model_fields if f != "train"), "train"]:
        if field in ("storage", "train", "topology") or field in _SECTION_BACKEND:
            if field in _SECTION_BACKEND and _SECTION_BACKEND[field] != backend:
                continue
            values = sections.get(field, {})
            # A section with nothing set stays commented out: an empty `slurm:` would be null.
            lines.append(f"{'' if values else '# '}{field + ':':<{48 if values else 46}} # {_SECTION_HELP[field]}")
            lines += (_train_lines(values, derived) if field == "train"
                      else _section(section_of(JobSpec, field), values, 2))
            continue
        active = field in top
        lines.append(_line(0, field, top[field] if active else _default(JobSpec, field), _help(JobSpec, field),
                           active))
    return lines


def _train_lines(values: dict[str, Any], derived: dict[str, Any]) -> list[str]:
    lines = []
    for name, group in _TRAIN_OPTIONS:
        model = section_of(TrainOptions, group) if group else TrainOptions
        active = name in values
        value = values[name] if active else derived.get(name, _default(model, name))
        lines.append(_line(2, name, value, _help(model, name), active))
    lines.append("  # every other trainer option: `fsdpkit train --help`")
    return lines
