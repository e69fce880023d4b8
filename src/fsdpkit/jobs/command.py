"""The command every node runs: torchrun with c10d rendezvous around `python -m fsdpkit.train`, or
the user's own program. One place, so PyTorchJob, HyperPod and Slurm cannot drift apart."""

from __future__ import annotations

from typing import Any

from fsdpkit.jobs.spec import JobSpec


def output_dirs(spec: JobSpec, root: str) -> dict[str, str]:
    """Checkpoints and run outputs of this job under `root` (the mounted storage)."""
    return {"checkpoint_dir": f"{root}/{spec.name}/checkpoints", "run_dir": f"{root}/{spec.name}/run"}


def train_options(spec: JobSpec, root: str | None) -> dict[str, Any]:
    """The trainer's options for this job. With storage, checkpoints and metrics go to the shared
    volume and every start resumes from the newest checkpoint there: a restarted pod, a resubmitted
    job and HyperPod's auto-resume all continue instead of starting over."""
    opts = dict(spec.train)
    if root is not None:
        flat = _flatten(opts)
        dirs = output_dirs(spec, root)
        if "checkpoint_dir" not in flat:
            opts["checkpoint_dir"] = dirs["checkpoint_dir"]
        if "run_dir" not in flat:
            opts["run_dir"] = dirs["run_dir"]
        if "resume_from_checkpoint" not in flat and "resume" not in flat:
            opts["resume_from_checkpoint"] = "auto"
    return opts


def _flatten(doc: dict[str, Any]) -> dict[str, Any]:
    from fsdpkit.train.config import SECTIONS

    out: dict[str, Any] = {}
    for k, v in doc.items():
        out.update(v if k in SECTIONS and isinstance(v, dict) else {k: v})
    return out


def torchrun_args(spec: JobSpec, rdzv_endpoint: str, rdzv_id: str, nnodes: str | None = None) -> list[str]:
    """torchrun with c10d rendezvous only: no --master-addr (mixing the two is a classic hang)."""
    lo, hi = spec.node_range
    return [
        "torchrun",
        f"--nnodes={nnodes or (f'{lo}:{hi}' if spec.elastic else lo)}",
        f"--nproc-per-node={spec.procs}",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint={rdzv_endpoint}",
        f"--rdzv-id={rdzv_id}",
        f"--max-restarts={spec.max_restarts}",
    ]


def node_command(spec: JobSpec, rdzv_endpoint: str, rdzv_id: str, root: str | None,
                 nnodes: str | None = None) -> list[str]:
    """argv of the program on each node."""
    if spec.command is not None:
        return list(spec.command)
    from fsdpkit.train.config import to_flags

    return [*torchrun_args(spec, rdzv_endpoint, rdzv_id, nnodes), "-m", "fsdpkit.train",
            *to_flags(train_options(spec, root))]
