"""ResolvedJob: what a job runs with, worked out once from its spec.

A JobSpec is what the user gave, checked field by field and between fields. Everything a job
derives from it is worked out here, in one pass, from one build of the trainer's config: the
options and output directories the nodes get, the steps a token budget means, the checkpoint
interval, the planner's step time, the grace period a stop needs, the start-up, the deadlines
and hang time HyperPod is told, and where each value came from. Renderers, `plan`, the capacity
check and `deploy` read it; none of them calls the planner or builds the config again.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

from fsdpkit.envelope import said_once_accepted
from fsdpkit.errors import UserError
from fsdpkit.image import pins
from fsdpkit.jobs.devices import DeviceChoice, DraOffer, choose
from fsdpkit.jobs.spec import CLUSTER_BACKENDS, JobSpec, flat_options, load_spec, named, output_root
from fsdpkit.plan.grace import (
    MEMORY_MB_S_PER_NODE,
    Cadence,
    GracePeriod,
    HangTime,
    StartUp,
    cadence,
    grace_period,
    startup,
    stop_tier,
    write_seconds,
)
from fsdpkit.plan.planner import Plan, plan_config
from fsdpkit.train.config import TrainConfig, build, recipe_values, step_tokens, to_flags
from fsdpkit.train.model.config import check_nf4_layout
from fsdpkit.train.sections import CheckpointConfig, OptimConfig, check_context_group, check_expert_group

log = logging.getLogger(__name__)

Options = dict[str, object]
KUBERNETES_GRACE = 30   # terminationGracePeriodSeconds where a pod names none


@dataclass(frozen=True)
class Source:
    """One resolved value and where it came from: given (the spec or its train options), the
    preset's recipe, the plan (with its reasoning), or a default."""

    name: str
    value: int | str | None
    source: str
    why: str = ""

    def to_dict(self) -> dict[str, object]:
        return {"name": self.name, "value": self.value, "source": self.source, "why": self.why}


@dataclass(frozen=True)
class Budget:
    """How much the job trains: its steps, the tokens they cover, and what set them."""

    steps: int
    step_tokens: int
    source: str          # "train.max_steps", "train.tokens", or "default"

    @property
    def tokens(self) -> int:
        return self.steps * self.step_tokens


@dataclass(frozen=True)
class Trainer:
    """What the nodes' trainer runs with: the options passed (output directories, resume, the
    checkpoint interval and steps written in), the config they build, and the values derived
    from the plan for it."""

    options: Options
    config: TrainConfig
    budget: Budget
    plan: Plan | None
    cadence: Cadence | None          # the derived checkpoint interval, where the spec gives none
    grace: GracePeriod | None        # None: no shared storage to write a stop's checkpoint to
    startup: StartUp
    hang: HangTime                   # the planned one, whether or not the spec gives its own
    hang_seconds: int                # HyperPod's: hyperpod.hang_timeout, else the planned
    loss_threshold: int

    @property
    def step_s(self) -> float | None:
        return self.plan.step_s if self.plan is not None else None

    def flags(self) -> list[str]:
        """The trainer's flags: the preset's recipe as resolved for this job, then the job's own
        options. Written out, so the manifest says what the pods train with, whatever fsdpkit the
        image holds."""
        return to_flags({"preset": self.config.preset, **recipe_values(self.config), **self.options})


@dataclass(frozen=True)
class ResolvedJob:
    spec: JobSpec
    root: str | None                 # where the job's outputs live on its nodes
    trainer: Trainer | None          # None: the job runs its own command
    grace_seconds: int | None        # terminationGracePeriodSeconds; None keeps Kubernetes' 30 s
    devices: DeviceChoice            # how the pods ask for GPUs and EFA (jobs.devices.choose)

    def on_cluster(self, offer: DraOffer) -> ResolvedJob:
        """The job as submitted to a cluster offering `offer`: its devices chosen again against it."""
        return dataclasses.replace(self, devices=choose(self.spec, offer))

    @cached_property
    def sources(self) -> list[Source]:
        """Each value the job derives, with where it came from (`job render --explain`)."""
        return _sources(self)

    @property
    def pod_grace(self) -> int:
        return self.grace_seconds if self.grace_seconds is not None else KUBERNETES_GRACE

    @property
    def startup_deadline(self) -> int | None:
        """HyperPod's runPolicy.startupDeadlineSeconds: the spec's, else the planned start-up."""
        given = self.spec.hyperpod.startup_deadline
        return given if given is not None else self.trainer.startup.seconds if self.trainer else None

    @property
    def fault_deadline(self) -> int | None:
        """runPolicy.faultDeadlineSeconds: the spec's, else the grace a stop needs (its checkpoint
        written) and a start-up after it."""
        given = self.spec.hyperpod.fault_deadline
        return given if given is not None else self.pod_grace + self.trainer.startup.seconds if self.trainer else None

    def flags(self) -> list[str]:
        if self.trainer is None:
            raise TypeError(f"job {self.spec.name} runs its own command, not fsdpkit's trainer")
        return self.trainer.flags()

    def default_steps(self) -> str | None:
        """The warning for a job off this machine that trains the trainer's default number of
        steps, which nobody chose; None otherwise."""
        t = self.trainer
        if t is None or self.spec.backend == "local" or t.budget.source != "default":
            return None
        return (f"train.max_steps: this job trains the default {t.budget.steps} steps ({t.budget.tokens:,} tokens); "
                "set train.tokens (a token budget) or train.max_steps")


# -- the trainer's options ----------------------------------------------------------------------------------
def output_dirs(spec: JobSpec, root: str) -> dict[str, str]:
    """Checkpoints and run outputs of this job under `root` (the mounted storage)."""
    return {"checkpoint_dir": f"{root}/{spec.name}/checkpoints", "run_dir": f"{root}/{spec.name}/run",
            "compile_cache_dir": f"{root}/{spec.name}/compile-cache"}


def _without(opts: Options, option: str, section: str) -> Options:
    """`opts` less `option`, given at the top or in its section's block."""
    out = {k: v for k, v in opts.items() if k != option}
    block = out.get(section)
    if isinstance(block, dict) and option in block:
        out[section] = {k: v for k, v in block.items() if k != option}
    return out


def _with_outputs(spec: JobSpec, root: str | None) -> Options:
    """The spec's trainer options with the job's outputs on its storage: checkpoints and metrics go
    to the shared volume and every start resumes from the newest checkpoint there, so a restarted
    pod, a resubmitted job and HyperPod's auto-resume all continue instead of starting over."""
    opts: Options = dict(spec.train)
    if root is None:
        return opts
    flat = flat_options(opts)
    for option, path in output_dirs(spec, root).items():
        if option not in flat:   # compile is on by default on GPUs: with its cache there, a restart starts warm
            opts[option] = path
    if named(flat, CheckpointConfig, "resume_from_checkpoint") is None:
        opts["resume_from_checkpoint"] = "auto"
    return opts


def with_budget(spec: JobSpec, tokens: int) -> tuple[JobSpec, str | None]:
    """The spec training on a token budget instead of its step count, and the train option that
    budget replaced (None where the spec gave none)."""
    flat = flat_options(spec.train)
    train = _without(spec.train, "tokens", "optim")
    if steps := named(flat, OptimConfig, "max_steps"):
        train = _without(train, steps, "optim")
    replaced = f"train.{steps} {flat[steps]}" if steps else None
    return spec.model_copy(update={"train": {**train, "tokens": tokens}}), replaced


# -- the one pass -------------------------------------------------------------------------------------------
def load_job(path: str | Path | None, overrides: Sequence[tuple[str, object]] = (),
             pin_image: bool = False, namespace: Callable[[], str | None] | None = None) -> ResolvedJob:
    """A spec file (or the defaults) with overrides, validated and resolved. With `pin_image`, an
    image this machine pushed (`fsdpkit image push`) runs as the digest it was pushed as, unless the
    image was given as an override. `namespace`: a cluster job's namespace where the spec names
    none (load_spec)."""
    with said_once_accepted():
        spec = load_spec(path, overrides, namespace)
        if pin_image and not any(key == "image" for key, _ in overrides) and (digest := pins.pinned(spec.image)):
            spec = spec.model_copy(update={"image": digest})
        return resolve(spec)


def resolve(spec: JobSpec) -> ResolvedJob:
    """Everything the job derives from its spec, worked out once. A trainer option the trainer
    refuses is refused here, as `train.OPTION: ...`, before anything is rendered or sent."""
    root = output_root(spec)
    trainer = None if spec.command is not None else _trainer(spec, root)
    grace = trainer.grace if trainer else None
    grace_s = spec.termination_grace_seconds if spec.termination_grace_seconds is not None else \
        grace.seconds if grace else None
    return ResolvedJob(spec, root, trainer, grace_s, choose(spec, None))


def _checked_config(spec: JobSpec, opts: Options) -> TrainConfig:
    """The trainer's config of the job, checked at every world an elastic job may run at (the NF4
    base's layout, the context and expert groups); a refusal names its train. field."""
    try:
        cfg = build([opts], on_nodes=spec.backend != "local", ranks=spec.nodes.max * spec.procs)
        worlds = [(nodes, nodes * spec.procs) for nodes in range(spec.nodes.min, spec.nodes.max + 1)]
        if cfg.lora_shape is not None and cfg.lora_shape.nf4:
            # Each node count an elastic job may run at shards the NF4 base its own way.
            for nodes, ranks in worlds:
                check_nf4_layout(cfg.shape, cfg.parallel.shard_ranks(ranks, nodes), ranks)
        check_context_group(cfg.parallel.context_parallel, spec.procs)
        for _, ranks in worlds:
            check_expert_group(cfg.parallel.expert_parallel, ranks)
    except UserError as e:
        raise UserError(f"train.{e}", hint=e.hint) from None
    return cfg


def _checkpoint_cadence(spec: JobSpec, cfg: TrainConfig, durable_given: bool) -> tuple[Cadence, Options]:
    """Checkpoints on by default where they survive the pod: as often as costs <= 5% of the run.
    Tiered, the periodic ones go to node memory, and shared storage's cadence becomes every
    durable_every-th of them (unless given). The cadence, and the options it writes."""
    durable = cadence(cfg.shape, spec.storage.write_mb_per_s, cfg.lora_shape)
    tiered = cfg.checkpoint.tiered
    derived = cadence(cfg.shape, MEMORY_MB_S_PER_NODE * spec.nodes.max, cfg.lora_shape) if tiered else durable
    written: Options = {"checkpoint_every": derived.every}
    if tiered and not durable_given:
        written["durable_every"] = max(1, math.ceil(durable.seconds / derived.seconds))
    return derived, written


def _trainer(spec: JobSpec, root: str | None) -> Trainer:
    opts = _with_outputs(spec, root)
    flat = flat_options(opts)
    ranks = spec.nodes.max * spec.procs
    cfg = _checked_config(spec, opts)
    # The rendered command carries the steps, whatever the ranks of an elastic job come to.
    budget_source = "train.tokens" if cfg.optim.tokens is not None else \
        "train.max_steps" if named(flat, OptimConfig, "max_steps") else "default"
    if cfg.optim.tokens is not None:
        opts = {**_without(opts, "tokens", "optim"), "max_steps": cfg.optim.max_steps}
    budget = Budget(cfg.optim.max_steps, step_tokens(cfg.data, cfg.parallel.data_ranks(ranks)), budget_source)
    derived = None
    if spec.storage.enabled and named(flat, CheckpointConfig, "checkpoint_every") is None:
        derived, written = _checkpoint_cadence(spec, cfg, "durable_every" in flat)
        opts = {**opts, **written}
        cfg = cfg.model_copy(update={"checkpoint": cfg.checkpoint.model_copy(update=written)})
    nvidia = spec.instance is not None and spec.instance.resource == "nvidia.com/gpu"
    plan = plan_config(cfg, spec.instance_type, spec.nodes.max, procs_per_node=spec.procs) if nvidia else None
    step_s = plan.step_s if plan is not None else None
    grace = None
    if spec.storage.root:
        rate, tier = stop_tier(cfg.checkpoint.tiered, spec.storage.write_mb_per_s, spec.nodes.max)
        grace = grace_period(cfg.shape, rate, step_s, tier, cfg.lora_shape)
    start = startup(cfg.shape if spec.storage.root else None, spec.storage.write_mb_per_s,
                    cfg.parallel.compiles("cuda" if nvidia and spec.gpus > 0 else "cpu"), cfg.lora_shape,
                    cfg.shape if cfg.checkpoint.init_from_hf else None)
    hp = spec.hyperpod
    write_s = write_seconds(cfg.shape, spec.storage.write_mb_per_s, cfg.lora_shape) if spec.storage.root else 0.0
    hang = HangTime(step_s, cfg.log.logging_freq, write_s, planned=plan is not None)
    loss = hp.loss_threshold if hp.loss_threshold is not None else math.ceil(2 * math.log(cfg.shape.vocab_size))
    return Trainer(opts, cfg, budget, plan, derived, grace, start, hang,
                   hp.hang_timeout if hp.hang_timeout is not None else hang.seconds, loss)


def _sources(job: ResolvedJob) -> list[Source]:
    """Each value the job derives, with where it came from (`job render --explain`, `plan`)."""
    spec, t = job.spec, job.trainer
    out: list[Source] = []
    if spec.termination_grace_seconds is not None:
        out.append(Source("grace_seconds", job.grace_seconds, "given", "termination_grace_seconds"))
    elif t is not None and t.grace is not None:
        out.append(Source("grace_seconds", job.grace_seconds, "plan", t.grace.explain()))
    elif spec.backend in CLUSTER_BACKENDS:
        out.append(Source("grace_seconds", KUBERNETES_GRACE, "default", "Kubernetes' own: the job has no storage "
                          "to write a stop's checkpoint to"))
    if spec.backend in CLUSTER_BACKENDS and spec.gpus:
        out.append(Source("devices", job.devices.mode, "given" if spec.devices != "auto" else "default",
                          job.devices.why))
    if t is None:
        return out
    if spec.backend == "hyperpod":
        out += _hyperpod_sources(job, t)
    out.append(_checkpoint_source(t))
    return out + _budget_sources(spec, t)


def _hyperpod_sources(job: ResolvedJob, t: Trainer) -> list[Source]:
    """The HyperPod operator's deadlines, hang time and loss threshold: given, or derived."""
    hp = job.spec.hyperpod
    return [
        Source("startup_deadline", job.startup_deadline, *(
            ("given", "hyperpod.startup_deadline") if hp.startup_deadline is not None else
            ("plan", t.startup.explain()))),
        Source("fault_deadline", job.fault_deadline, *(
            ("given", "hyperpod.fault_deadline") if hp.fault_deadline is not None else
            ("plan", f"the grace ({job.pod_grace} s) + the start-up ({t.startup.seconds} s)"))),
        Source("hang_seconds", t.hang_seconds, *(
            ("given", "hyperpod.hang_timeout") if hp.hang_timeout is not None else ("plan", t.hang.explain()))),
        Source("loss_threshold", t.loss_threshold, *(
            ("given", "hyperpod.loss_threshold") if hp.loss_threshold is not None else
            ("default", f"twice a uniform guess's loss, 2 ln({t.config.shape.vocab_size})")))]


def _checkpoint_source(t: Trainer) -> Source:
    """How often the job checkpoints: the derived cadence, what was given, or only the last step."""
    if t.cadence is not None:
        return Source("checkpoint_every", t.cadence.every, "plan", t.cadence.explain())
    ck = t.config.checkpoint
    given = ck.checkpoint_every != "0"
    return Source("checkpoint_every", ck.checkpoint_every, "given" if given else "default",
                  "train.checkpoint_every" if given else "the last step only" if ck.checkpoint_dir else
                  "no checkpoints: the job has no storage")


def _budget_sources(spec: JobSpec, t: Trainer) -> list[Source]:
    """The steps and the tokens they come to, over the data-parallel ranks of the job's world."""
    b = t.budget
    out = []
    steps_why = f"train.tokens {t.config.optim.tokens or 0:,} / {b.step_tokens:,} tokens a step" \
        if b.source == "train.tokens" else b.source if b.source != "default" else \
        "the trainer's default: set train.tokens or train.max_steps"
    out.append(Source("steps", b.steps, "default" if b.source == "default" else "given", steps_why))
    d, world = t.config.data, spec.nodes.max * spec.procs
    data_ranks = t.config.parallel.data_ranks(world)   # context and expert parallel ranks share batches
    of_world = f" of {world}" if data_ranks != world else ""
    out.append(Source("tokens", b.tokens, "default" if b.source == "default" else "given",
                      f"{b.steps:,} steps x {b.step_tokens:,} tokens (seq_len {d.seq_len} x micro-batch "
                      f"{d.train_batch_size} x accumulation {d.grad_accum_steps} x {data_ranks} data-parallel "
                      f"ranks{of_world})"))
    return out
