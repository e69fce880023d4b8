"""`fsdpkit` entry point: dispatches to one module per verb, each with `main(argv) -> exit code`."""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from typing import cast

from fsdpkit import __version__
from fsdpkit.envelope import emit_error
from fsdpkit.extras import missing_extra

# verb -> (module with main(argv), help). Modules load lazily so `fsdpkit --help` stays fast.
VERBS = {
    "train": ("fsdpkit.train.launch", "train a model (embedded default with no flags; --nproc N for N processes)"),
    "plan": ("fsdpkit.cli.plan", "will a training config fit on an instance type, how fast, what to change"),
    "presets": ("fsdpkit.cli.presets", "list the model presets with their sizes and training recipes"),
    "ckpt": ("fsdpkit.cli.ckpt", "list and inspect checkpoints (ckpt list DIR, ckpt show CKPT)"),
    "export": ("fsdpkit.cli.export", "write a checkpoint as Hugging Face safetensors, or a LoRA run's adapters for "
               "PEFT (export SRC OUT [--to hf|peft])"),
    "eval": ("fsdpkit.cli.evaluate", "score an exported model with lm-evaluation-harness; scores go into the run's "
             "summary and report"),
    "data": ("fsdpkit.cli.data", "tokenise a dataset into token shards (data prepare)"),
    "tokenizer": ("fsdpkit.cli.data:tokenizer_main", "train a BPE tokenizer on local text (tokenizer train)"),
    "cluster": ("fsdpkit.cli.cluster", "provision an EKS cluster (config, create, addons install) and check it "
                "is ready to train"),
    "storage": ("fsdpkit.cli.storage", "FSx for Lustre for checkpoints and data, with its PersistentVolume"),
    "ray": ("fsdpkit.cli.ray", "KubeRay clusters from a job spec: ray create|status|delete|submit|exec"),
    "deploy": ("fsdpkit.cli.deploy", "check the cluster, ensure storage and secret, submit and watch a job"),
    "selftest": ("fsdpkit.train.selftest", "check this environment can train (--level quick|standard|full)"),
    "image": ("fsdpkit.cli.image", "write a Dockerfile on a known-good base; find PyTorch/CUDA/EFA conflicts"),
    "infra": ("fsdpkit.cli.infra", "AWS resources for image builds: infra create|status|delete|template"),
    "metrics": ("fsdpkit.cli.metrics", "each node's GPU use over a job's lifetime from Prometheus or Amazon Managed "
                "Prometheus (DCGM series)"),
    "report": ("fsdpkit.cli.report", "plot runs (loss, lr, tokens/s, MFU, memory, restarts) into an HTML page"),
    "mcp": ("fsdpkit.cli.mcp", "serve these commands as MCP tools over stdio for AI agents (fsdpkit skills install "
            "registers it)"),
    "skills": ("fsdpkit.cli.skills", "SKILL.md files for AI coding agents (Claude Code, OpenCode, Cursor, VS Code, "
               "Kiro, Codex): list|show|install"),
    "examples": ("fsdpkit.cli.examples", "example job specs shipped with fsdpkit: examples list|show NAME --out FILE"),
    "job": ("fsdpkit.cli.job", "render, submit and follow jobs: local, Kubeflow TrainJob or PyTorchJob, HyperPod, "
            "Slurm"),
}


NEXT_STEPS = """\
next steps:
  fsdpkit train                                  train the default job here (CPU or GPU, no network)
  fsdpkit train --nproc 2 --max-steps 100        the same as 2 FSDP2 processes
  fsdpkit presets                                models and the training recipe each carries
  fsdpkit plan --preset llama3_1_8b --instance-type p5.48xlarge --nodes 4
                                                 will it fit, how fast, what to change
  fsdpkit job init --backend trainjob --out job.yaml
                                                 a starter job spec, every field explained
  fsdpkit job render SPEC.yaml                   the manifests or script a job spec becomes
  fsdpkit COMMAND --help                         each command's options; --json on every command
"""


# A process whose reader went away ends as if SIGPIPE had ended it (128 + 13).
BROKEN_PIPE = 141


def main(argv: list[str] | None = None) -> int:
    """The command; a reader that goes away (`--json | head`) ends it quietly, without a traceback."""
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        code = _run(argv)
        sys.stdout.flush()   # inside: output still buffered would otherwise fail at exit, loudly
        return code
    except ModuleNotFoundError as e:   # reached wherever the verb imports it, at its start or deep inside
        if (err := missing_extra(e, " ".join(["fsdpkit", *argv[:1]]))) is None:
            raise
        return emit_error(err, "--json" in argv)
    except BrokenPipeError:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return BROKEN_PIPE


def _run(argv: list[str] | None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(prog="fsdpkit", description="FSDP2 training from laptop to cluster.",
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=NEXT_STEPS)
    parser.add_argument("--version", action="version", version=f"fsdpkit {__version__}")
    sub = parser.add_subparsers(dest="verb", metavar="COMMAND")
    for verb, (_module, help_text) in VERBS.items():
        sub.add_parser(verb, help=help_text, add_help=False)
    if not argv or argv[0] not in VERBS:
        parser.parse_args(argv or ["--help"])  # prints help or the usage error, then exits
        return 2
    module_name, _, func = VERBS[argv[0]][0].partition(":")
    return cast("int", getattr(importlib.import_module(module_name), func or "main")(argv[1:]))
