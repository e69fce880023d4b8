"""Evaluation after training (`fsdpkit eval`): an exported model scored on named tasks by
EleutherAI's lm-evaluation-harness (the optional `eval` extra), the scores written into the run's
record (summary.json's `eval`, read by `fsdpkit report`) and beside it in full (eval.json).

The harness loads the export as any Hugging Face model (its `hf` model type), so what is scored
is exactly what `fsdpkit export` hands on. Tasks are the harness's own names, or task files in
`include_path` (a local task runs offline: its data files are local)."""

from __future__ import annotations

import contextlib
import importlib
import json
import logging
import math
import os
import sys
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
    or the one the export came from) the scores go into its summary.json and eval.json, each task's
    as it finishes, so a failure later in the list keeps what was scored. What the harness prints
    goes to stderr: stdout is the caller's (`--json`)."""
    _check(model, tasks, include_path, run_dir)
    run_dir = run_dir or run_dir_of(model)
    told_offline = os.environ.get("HF_HUB_OFFLINE") == "1"
    offline = told_offline or not hub_reachable()
    if offline:
        # Cached task data only: the hub client would retry each file for half a minute first.
        os.environ.update(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1")
    lm_eval, task_manager = _harness()
    with contextlib.redirect_stdout(sys.stderr):
        manager = task_manager(include_path=str(include_path) if include_path else None)
        unknown = [t for t in tasks if t not in manager.all_tasks]
        if unknown:
            raise UserError(f"eval: unknown task {unknown[0]!r}; name a task of lm-evaluation-harness "
                            "(lm-eval ls tasks) or a task file in --include-path")
        if device == "auto":
            device = "cuda" if torch.cuda.is_available() else "cpu"
        lm = _load(lm_eval, model, dtype, batch_size, device)
        log.info(f"fsdpkit: evaluating {model} on {', '.join(tasks)} ({device})")
        record: dict[str, Any] = {"model": str(model), "tasks": {}, "limit": limit, "num_fewshot": num_fewshot,
                                  "harness": f"lm-eval {getattr(lm_eval, '__version__', '?')}"}
        full: dict[str, Any] = {}
        for task in tasks:
            try:
                out = lm_eval.simple_evaluate(
                    model=lm, tasks=[task], task_manager=manager, limit=limit, num_fewshot=num_fewshot,
                    log_samples=False, random_seed=seed, numpy_random_seed=seed, torch_random_seed=seed,
                    fewshot_random_seed=seed) or {}
            except Exception as e:   # whatever the harness raises for a task: one line
                raise _stopped(e, task, record, run_dir, offline, told_offline) from None
            record["tasks"].update(scores_of(out.get("results", {})))
            _merge(full, out)
            if run_dir is not None:
                _record(run_dir, record, full)
    return {**record, "run_dir": str(run_dir) if run_dir else None}


def _check(model: Path, tasks: list[str], include_path: Path | None, run_dir: Path | None) -> None:
    """What can be refused before the harness loads; the run directory made, before minutes of scoring."""
    if not tasks:
        raise UserError("eval: --tasks names no task; give one or more, comma-separated (lm-eval ls tasks)")
    if not (model / "config.json").is_file():
        raise UserError(f"eval: {model} is not a Hugging Face model directory (no config.json); "
                        "export a checkpoint first: fsdpkit export CHECKPOINT OUT")
    with reading(model / "config.json", "eval"):   # a damaged folder, told before the harness loads
        json.loads((model / "config.json").read_text())
    if not any((model / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json")):
        raise UserError(f"eval: {model} has no tokenizer files (a run on the embedded byte tokenizer exports none); "
                        "the harness needs a Hugging Face tokenizer: train with --tokenizer")
    if include_path is not None and not include_path.is_dir():
        raise UserError(f"eval: --include-path {include_path} is not a directory")
    if run_dir is not None:
        try:
            run_dir.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise UserError(f"eval: --run-dir {run_dir}: cannot create it ({e.strerror})") from None


def _load(lm_eval: Any, model: Path, dtype: str, batch_size: int, device: str) -> Any:
    """The harness's `hf` model over the export, loaded once for every task."""
    args = {"pretrained": str(model), "dtype": {"fp32": "float32", "bf16": "bfloat16"}[dtype]}
    try:
        return lm_eval.api.registry.get_model("hf").create_from_arg_obj(
            args, {"batch_size": batch_size, "max_batch_size": None, "device": device})
    except Exception as e:   # a folder transformers cannot load, whatever it raises
        raise UserError(f"eval: {model} does not load as a Hugging Face model ({_first_line(e)}); "
                        "export a checkpoint again: fsdpkit export CHECKPOINT OUT") from None


def _first_line(e: BaseException) -> str:
    """An exception's first line, and its cause's where it wraps one (datasets' "An error occurred
    while generating the dataset" says why only there)."""
    lines = str(e).strip().splitlines()
    first = lines[0] if lines else type(e).__name__
    cause = e.__cause__
    return f"{first}: {_first_line(cause)}" if cause is not None and cause is not e else first


def _stopped(e: Exception, task: str, record: dict[str, Any], run_dir: Path | None,
             offline: bool, told_offline: bool) -> UserError:
    """The one-line error for a task the harness could not score, saying what was kept."""
    first = _first_line(e)
    done = list(record["tasks"])
    kept = (f"; the scores of {', '.join(done)} are recorded in {run_dir}" if done and run_dir is not None else
            f"; {', '.join(done)} scored but recorded nowhere (pass --run-dir)" if done else "")
    if isinstance(e, (OSError, ValueError)) and offline and ("Hub" in first or "offline" in first.lower()):
        if told_offline:   # task data not in the cache
            return UserError(f"eval: {task} needs data that is not cached here, and HF_HUB_OFFLINE=1 keeps the hub "
                             f"out ({first}); unset HF_HUB_OFFLINE, or use a local task with --include-path{kept}")
        return Unreachable(f"eval: {task} needs data that is not cached here, and the Hugging Face hub "
                           f"({hub_endpoint()}) cannot be reached ({first}); run where the hub can be reached "
                           f"once (the data is then cached), or use a local task with --include-path{kept}")
    return UserError(f"eval: the harness stopped on {task} ({type(e).__name__}: {first}){kept}")


def _merge(full: dict[str, Any], out: dict[str, Any]) -> None:
    """One task's whole result into the run's: its per-task tables (results, configs, versions...)
    merged, the rest (the harness's config) the latest's."""
    for key, value in out.items():
        if isinstance(value, dict) and isinstance(full.get(key), dict):
            full[key] = {**full[key], **value}
        else:
            full[key] = value


def _record(run_dir: Path, record: dict[str, Any], full: Any) -> None:
    """summary.json's `eval` (tasks merged with earlier evaluations) and the harness's whole result
    in eval.json; each written whole through a temporary file. A run without summary.json has not
    finished: its scores go to eval.json alone."""
    summary_file = run_dir / "summary.json"
    files: list[tuple[Path, Any]] = [(run_dir / "eval.json", full)]
    if not summary_file.is_file():
        if not (run_dir / "eval.json").is_file():   # said once, at the first task's scores
            log.warning(f"eval: {run_dir} has no summary.json (the run has not finished, or is not a run); "
                        "scores are in eval.json only")
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
