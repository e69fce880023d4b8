"""What every node runs: the command (torchrun under fsdpkit's supervisor, with c10d rendezvous,
around `python -m fsdpkit.train`, or the user's own program) and its environment. One place, so
PyTorchJob, HyperPod, Ray and Slurm cannot drift apart."""

from __future__ import annotations

from fsdpkit.hardware.instances import network_env
from fsdpkit.image.dockerfile import has_ofi_nccl
from fsdpkit.jobs.resolved import ResolvedJob
from fsdpkit.jobs.spec import JobSpec
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


def launcher_args(spec: JobSpec, rdzv_endpoint: str, rdzv_id: str, nnodes: str | None = None) -> list[str]:
    """torchrun with c10d rendezvous under fsdpkit's supervisor (`fsdpkit-torchrun`,
    fsdpkit.train.runtime.supervisor): SIGTERM gives the workers the whole grace period to checkpoint and
    ends in exit 143, and no worker outlives it."""
    return ["fsdpkit-torchrun", *torchrun_args(spec.procs, spec.max_restarts, nnodes or str(spec.nodes),
                                               (rdzv_endpoint, rdzv_id))]


def node_command(job: ResolvedJob, rdzv_endpoint: str, rdzv_id: str, nnodes: str | None = None) -> list[str]:
    """argv of the program on each node."""
    if job.spec.command is not None:
        return list(job.spec.command)
    return [*launcher_args(job.spec, rdzv_endpoint, rdzv_id, nnodes), "-m", "fsdpkit.train", *job.flags()]
