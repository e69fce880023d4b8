"""What every node runs: the command (torchrun under fsdpkit's supervisor, with c10d rendezvous,
around `python -m fsdpkit.train`, or the user's own program), its environment, and the time it is
given to stop. One place, so PyTorchJob, HyperPod, Ray and Slurm cannot drift apart."""

from __future__ import annotations

from fsdpkit.hardware.instances import network_env
from fsdpkit.image.dockerfile import has_ofi_nccl
from fsdpkit.jobs.spec import JobSpec, job_config, train_config, train_options
from fsdpkit.plan.grace import GracePeriod, StartUp, checkpoint_bytes, grace_period, startup, stop_tier
from fsdpkit.plan.planner import plan_config
from fsdpkit.train.config import TrainConfig, recipe_values, to_flags
from fsdpkit.train.runtime.supervisor import torchrun_args

# Set on every GPU node: the caching allocator grows segments instead of fragmenting (fewer
# out-of-memory stops at long sequences), and NCCL's flight recorder keeps the last collectives of
# each rank, dumped on a watchdog timeout, which is what a hang is diagnosed from.
GPU_ENV = {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True", "TORCH_NCCL_TRACE_BUFFER_SIZE": "2000",
           "TORCH_NCCL_DUMP_ON_TIMEOUT": "1"}


def node_env(spec: JobSpec) -> dict[str, str]:
    """The environment of every node's process (the spec's own `env` wins): network settings of the
    instance type, and on GPUs the allocator and flight-recorder settings, the flight recorder
    dumping to the job's shared storage (the container's /tmp is gone with the pod)."""
    plugin = spec.ofi_nccl is not None or has_ofi_nccl(spec.image) is not False
    env = {"PYTHONUNBUFFERED": "1",
           **network_env(spec.instance, spec.efa, spec.diagnose_network, spec.ofi_nccl, plugin)}
    if spec.gpus and spec.accelerator_resource == "nvidia.com/gpu":
        env.update(GPU_ENV)
        if spec.storage.root:
            env["TORCH_NCCL_DEBUG_INFO_TEMP_FILE"] = f"{spec.storage.root}/{spec.name}/flight-recorder/rank_"
    return {**env, **spec.env}


def planned_step_seconds(spec: JobSpec, cfg: TrainConfig) -> float | None:
    """The planner's step time for the job, where its nodes are NVIDIA GPUs of a known type."""
    if spec.instance is None or spec.instance.resource != "nvidia.com/gpu":
        return None
    return plan_config(cfg, spec.instance_type, spec.nodes.max, procs_per_node=spec.procs).step_s


def job_grace(spec: JobSpec) -> GracePeriod | None:
    """The time the job's pods need after SIGTERM, where they run fsdpkit's trainer with
    checkpoints on shared storage: from the checkpoint's size, the storage's write rate and the
    planner's step time (fsdpkit.plan.grace)."""
    if spec.command is not None or not spec.storage.root:
        return None
    cfg = train_config(spec)
    rate, tier = stop_tier(cfg.checkpoint.tiered, spec.storage.write_mb_per_s, spec.nodes.max)
    return grace_period(cfg.shape, rate, planned_step_seconds(spec, cfg), tier)


def durable_write_seconds(spec: JobSpec, cfg: TrainConfig) -> float:
    """How long a checkpoint's write to the job's shared storage takes (0 without storage): what a
    synchronous save there stops the training loop for, tiered or not."""
    if not spec.storage.root:
        return 0.0
    return checkpoint_bytes(cfg.shape) / (spec.storage.write_mb_per_s * 1e6)


def job_startup(spec: JobSpec) -> StartUp | None:
    """The planned start-up of the job's pods, where they run fsdpkit's trainer: the newest
    checkpoint read back from shared storage, and compiling where the nodes are NVIDIA GPUs."""
    if spec.command is not None:
        return None
    cfg = train_config(spec)
    gpu = spec.gpus > 0 and spec.accelerator_resource == "nvidia.com/gpu"
    return startup(cfg.shape if spec.storage.root else None, spec.storage.write_mb_per_s,
                   cfg.parallel.compiles("cuda" if gpu else "cpu"))


def grace_seconds(spec: JobSpec) -> int | None:
    """terminationGracePeriodSeconds: the spec's, else the derived one; None keeps Kubernetes' 30 s."""
    if spec.termination_grace_seconds is not None:
        return spec.termination_grace_seconds
    grace = job_grace(spec)
    return grace.seconds if grace else None


def launcher_args(spec: JobSpec, rdzv_endpoint: str, rdzv_id: str, nnodes: str | None = None) -> list[str]:
    """torchrun with c10d rendezvous under fsdpkit's supervisor (`fsdpkit-torchrun`,
    fsdpkit.train.runtime.supervisor): SIGTERM gives the workers the whole grace period to checkpoint and
    ends in exit 143, and no worker outlives it."""
    return ["fsdpkit-torchrun", *torchrun_args(spec.procs, spec.max_restarts, nnodes or str(spec.nodes),
                                               (rdzv_endpoint, rdzv_id))]


def node_command(spec: JobSpec, rdzv_endpoint: str, rdzv_id: str, root: str | None,
                 nnodes: str | None = None) -> list[str]:
    """argv of the program on each node."""
    if spec.command is not None:
        return list(spec.command)
    return [*launcher_args(spec, rdzv_endpoint, rdzv_id, nnodes), "-m", "fsdpkit.train",
            *trainer_flags(spec, root)]


def trainer_flags(spec: JobSpec, root: str | None) -> list[str]:
    """The trainer's flags: the preset's recipe as resolved for this job, then the spec's own options.
    Written out, so the manifest says what the pods train with, whatever fsdpkit the image holds."""
    options = train_options(spec, root)
    cfg = job_config(spec, options)
    return to_flags({"preset": cfg.preset, **recipe_values(cfg), **options})
