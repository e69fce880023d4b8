"""Experiment trackers, sinks like metrics.jsonl and TensorBoard (observe.sinks): Weights & Biases
and MLflow, optional extras. Rank 0 logs what metrics.jsonl gets (train and validation rows, and a
marker at every start), plus the resolved config. A run resumed in the same run directory
continues the same tracker run: the ids are kept in RUN_DIR/trackers.json. API keys stay in the
environment, where each library reads them; nothing here writes or logs one."""

from __future__ import annotations

import json
import os
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from fsdpkit.errors import UserError
from fsdpkit.train.observe.sinks import Sink

IDS = "trackers.json"
# The trainer's step is the x-axis: a resumed run repeats steps after its last checkpoint, which a
# tracker's own strictly increasing step would drop.
STEP_KEY = "trainer/step"


def flatten(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def _numbers(metrics: dict[str, Any]) -> dict[str, float]:
    return {k: float(v) for k, v in metrics.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}


def _extra(name: str) -> UserError:
    return UserError(f"--tracker {name} needs the {name} package: pip install 'fsdpkit[{name}]' (and in the image)")


class WandbTracker:
    name = "wandb"

    def __init__(self, run_dir: Path, project: str, config: dict[str, Any], ids: dict[str, Any], attempt: int):
        try:
            import wandb
        except ImportError:
            raise _extra("wandb") from None
        run_id = ids.setdefault("wandb", {}).setdefault("id", uuid.uuid4().hex[:12])
        # console off: the trainer's stdout stays as it is (HyperPod's log rules read it).
        self.run = wandb.init(project=project, name=run_dir.resolve().name, id=run_id, resume="allow",
                              dir=str(run_dir), settings=wandb.Settings(console="off", silent=True))
        self.run.config.update(config, allow_val_change=True)
        self.run.define_metric(STEP_KEY)
        for kind in ("train", "val", "start"):
            self.run.define_metric(f"{kind}/*", step_metric=STEP_KEY)

    def log(self, kind: str, metrics: dict[str, Any]) -> None:
        row = {f"{kind}/{k}": v for k, v in _numbers(metrics).items() if k != "step"}
        self.run.log({STEP_KEY: metrics["step"], **row})

    def close(self, ok: bool) -> None:
        self.run.finish(exit_code=0 if ok else 1)


class MlflowTracker:
    name = "mlflow"

    def __init__(self, run_dir: Path, project: str, config: dict[str, Any], ids: dict[str, Any], attempt: int):
        try:
            from mlflow.entities import Param, RunTag
            from mlflow.tracking import MlflowClient
        except ImportError:
            raise _extra("mlflow") from None
        uri = mlflow_uri()
        if uri.startswith("file:"):
            # MLflow 3 refuses a file store unless opted in; naming one is that choice.
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        self.client = MlflowClient(uri)
        mine = ids.setdefault("mlflow", {})
        if "run_id" in mine:
            self.run_id = mine["run_id"]
            self.client.update_run(self.run_id, status="RUNNING")
        else:
            exp = self.client.get_experiment_by_name(project)
            exp_id = exp.experiment_id if exp else self.client.create_experiment(project)
            self.run_id = mine["run_id"] = self.client.create_run(exp_id, run_name=run_dir.resolve().name).info.run_id
        # MLflow refuses to change a logged param: a resumed run logs only the new ones, and what it
        # changed (resume_from_checkpoint, max_steps) as tags of its attempt.
        logged = self.client.get_run(self.run_id).data.params
        flat = {k: str(v)[:6000] for k, v in flatten(config).items()}
        changed = [RunTag(f"attempt{attempt}.{k}", v[:5000]) for k, v in flat.items() if k in logged and logged[k] != v]
        new = [Param(k, v) for k, v in flat.items() if k not in logged]
        for i in range(0, len(new), 100):  # MLflow takes at most 100 params per batch
            self.client.log_batch(self.run_id, params=new[i:i + 100])
        self.client.log_batch(self.run_id, tags=[*changed, RunTag("fsdpkit.attempts", str(attempt + 1))])

    def log(self, kind: str, metrics: dict[str, Any]) -> None:
        from mlflow.entities import Metric

        now, step = int(time.time() * 1000), int(metrics["step"])
        self.client.log_batch(self.run_id, metrics=[Metric(f"{kind}/{k}", v, now, step)
                                                    for k, v in _numbers(metrics).items() if k != "step"])

    def close(self, ok: bool) -> None:
        self.client.set_terminated(self.run_id, "FINISHED" if ok else "FAILED")


OPEN: dict[str, Callable[..., Sink]] = {"wandb": WandbTracker, "mlflow": MlflowTracker}


def mlflow_uri() -> str:
    """Where MLflow's runs go: MLFLOW_TRACKING_URI, which a run with --tracker mlflow must set."""
    uri = os.environ.get("MLFLOW_TRACKING_URI")
    if not uri:
        raise UserError("--tracker mlflow: set MLFLOW_TRACKING_URI (an MLflow server, a SageMaker managed MLflow "
                        "tracking server ARN, or file:DIR)")
    return uri


def check_trackers(names: tuple[str, ...]) -> None:
    """What the trackers asked for need from this environment, before the run starts (a tracker
    that cannot open would stop the run once its model was built, its config.yaml written)."""
    if "mlflow" in names:
        mlflow_uri()


def open_trackers(names: tuple[str, ...], run_dir: Path, project: str, config: dict[str, Any],
                  attempt: int) -> list[Sink]:
    """The trackers a run asked for, as sinks, opened with the run's ids (kept in RUN_DIR/trackers.json
    so a resumed run continues the same tracker run)."""
    if not names:  # no tracker asked for: no ids file either
        return []
    path = run_dir / IDS
    ids = json.loads(path.read_text()) if path.is_file() else {}
    opened = [OPEN[n](run_dir, project, config, ids, attempt) for n in names]
    path.write_text(json.dumps(ids, indent=2) + "\n")
    return opened
