"""Evaluation after training (`fsdpkit eval`): an exported model scored on named tasks by
EleutherAI's lm-evaluation-harness (the optional `eval` extra), the scores written into the run's
record (summary.json's `eval`, read by `fsdpkit report`) and beside it in full (eval.json).

The harness loads the export as any Hugging Face model (its `hf` model type), so what is scored
is exactly what `fsdpkit export` hands on. Tasks are the harness's own names, or task files in
`include_path` (a local task runs offline: its data files are local)."""

from __future__ import annotations

import importlib
import json
import logging
import math
import os
from pathlib import Path
from typing import Any

import torch

from fsdpkit.errors import Unreachable, UserError
from fsdpkit.readers import reading
from fsdpkit.train.data.hub import hub_endpoint, hub_reachable

log = logging.getLogger(__name__)

# Written by `fsdpkit export` beside the weights: which run and checkpoint they came from.
PROVENANCE = "fsdpkit_export.json"


def _harness() -> tuple[Any, Any]:
    """lm_eval and its TaskManager (an optional extra: imported when asked for, with a clear error)."""
    try:
        return importlib.import_module("lm_eval"), importlib.import_module("lm_eval.tasks").TaskManager
    except ImportError:
        raise UserError("eval: needs lm-evaluation-harness: pip install 'fsdpkit[eval]'") from None


def run_dir_of(model: Path) -> Path | None:
    """The run an export came from (its provenance file), if that run directory is still here."""
    file = model / PROVENANCE
    if not file.is_file():
        return None
    with reading(file, "eval"):
        run = json.loads(file.read_text()).get("run_dir")
    return Path(run) if run and Path(run).is_dir() else None


def scores_of(results: dict[str, Any]) -> dict[str, dict[str, float]]:
    """Each task's metrics as plain numbers: `acc` for the harness's `acc,none`; standard errors and
    the harness's aliases dropped, a metric it could not compute (NaN, "N/A") left out."""
    out: dict[str, dict[str, float]] = {}
    for task, metrics in results.items():
        kept = {}
        for key, value in metrics.items():
            name, _, flt = key.partition(",")
            if name == "alias" or name.endswith("_stderr") or not isinstance(value, (int, float)):
                continue
            if isinstance(value, float) and math.isnan(value):
                continue
            kept[name if flt in ("", "none") else f"{name},{flt}"] = float(value)
        out[task] = kept
    return out


def evaluate(model: Path, tasks: list[str], include_path: Path | None = None, limit: float | None = None,
             num_fewshot: int | None = None, batch_size: int = 8, device: str = "auto", dtype: str = "fp32",
             run_dir: Path | None = None, seed: int = 1234) -> dict[str, Any]:
    """Score `model` (an exported Hugging Face directory) on `tasks`; with a run directory (given,
    or the one the export came from) the scores go into its summary.json and eval.json."""
    if not (model / "config.json").is_file():
        raise UserError(f"eval: {model} is not a Hugging Face model directory (no config.json); "
                        "export a checkpoint first: fsdpkit export CHECKPOINT OUT")
    if not any((model / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json")):
        raise UserError(f"eval: {model} has no tokenizer files (a run on the embedded byte tokenizer exports none); "
                        "the harness needs a Hugging Face tokenizer: train with --tokenizer")
    if include_path is not None and not include_path.is_dir():
        raise UserError(f"eval: --include-path {include_path} is not a directory")
    run_dir = run_dir or run_dir_of(model)
    told_offline = os.environ.get("HF_HUB_OFFLINE") == "1"
    offline = told_offline or not hub_reachable()
    if offline:
        # Cached task data only: the hub client would retry each file for half a minute first.
        os.environ.update(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1")
    lm_eval, task_manager = _harness()
    manager = task_manager(include_path=str(include_path) if include_path else None)
    unknown = [t for t in tasks if t not in manager.all_tasks]
    if unknown:
        raise UserError(f"eval: unknown task {unknown[0]!r}; name a task of lm-evaluation-harness (lm-eval ls tasks) "
                        "or a task file in --include-path")
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    log.info(f"fsdpkit: evaluating {model} on {', '.join(tasks)} ({device})")
    try:
        out = lm_eval.simple_evaluate(
            model="hf", model_args={"pretrained": str(model), "dtype": {"fp32": "float32", "bf16": "bfloat16"}[dtype]},
            tasks=tasks, task_manager=manager, limit=limit, num_fewshot=num_fewshot, batch_size=batch_size,
            device=device, log_samples=False, random_seed=seed, numpy_random_seed=seed, torch_random_seed=seed,
            fewshot_random_seed=seed)
    except (OSError, ValueError) as e:   # a dataset the harness cannot fetch offline, say
        first = str(e).splitlines()[0]
        if offline and ("Hub" in first or "offline" in first.lower()):   # task data not in the cache
            if told_offline:
                raise UserError(f"eval: {', '.join(tasks)} needs data that is not cached here, and HF_HUB_OFFLINE=1 "
                                f"keeps the hub out ({first}); unset HF_HUB_OFFLINE, or use a local task with "
                                "--include-path") from None
            raise Unreachable(f"eval: {', '.join(tasks)} needs data that is not cached here, and the Hugging Face hub "
                              f"({hub_endpoint()}) cannot be reached ({first}); run where the hub can be reached "
                              "once (the data is then cached), or use a local task with --include-path") from None
        raise UserError(f"eval: the harness stopped: {first}") from None
    scores = scores_of(out["results"] if out else {})
    record = {"model": str(model), "tasks": scores, "limit": limit, "num_fewshot": num_fewshot,
              "harness": f"lm-eval {getattr(lm_eval, '__version__', '?')}"}
    if run_dir is not None:
        _record(run_dir, record, out)
    return {**record, "run_dir": str(run_dir) if run_dir else None}


def _record(run_dir: Path, record: dict[str, Any], full: Any) -> None:
    """summary.json's `eval` (tasks merged with earlier evaluations) and the harness's whole result
    in eval.json; each written whole through a temporary file. A run without summary.json has not
    finished: its scores go to eval.json alone."""
    summary_file = run_dir / "summary.json"
    files: list[tuple[Path, Any]] = [(run_dir / "eval.json", full)]
    if not summary_file.is_file():
        log.warning(f"eval: {run_dir} has no summary.json (the run has not finished); scores are in eval.json only")
        summary: dict[str, Any] = {}
    else:
        with reading(summary_file, "eval"):
            summary = json.loads(summary_file.read_text())
        files.append((summary_file, summary))
    earlier = (summary.get("eval") or {}).get("tasks") or {}
    summary["eval"] = {**record, "tasks": {**earlier, **record["tasks"]}}
    for file, doc in files:
        tmp = file.with_name(f".{file.name}.tmp")
        tmp.write_text(json.dumps(doc, indent=2, default=str) + "\n")
        os.replace(tmp, file)
