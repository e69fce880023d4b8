"""Progress on a Kubeflow TrainJob's own status (Trainer 2.2 and later, feature gate TrainJobStatus).

Where the controller runs its status server, it injects into every pod of a TrainJob the
endpoint (KUBEFLOW_TRAINER_SERVER_URL), its CA certificate and a projected service-account token
(paths in KUBEFLOW_TRAINER_SERVER_CA_CERT and KUBEFLOW_TRAINER_SERVER_TOKEN). Rank 0 posts
`{"trainerStatus": {...}}` there, and the controller writes it to `status.trainerStatus`, where
`kubectl get trainjob` and `fsdpkit job status` read it: the share of steps done, the time left at
this attempt's pace, and the newest metric line's figures.

Posts are at most one every MIN_INTERVAL_S (the Kubeflow SDK's own throttle; the server rate-limits
too), and the run's end is always posted. The controller need not be up: a failed post is said once
per outage and training goes on. Standard library only: the trainer runs in a bare container.
"""

from __future__ import annotations

import json
import logging
import math
import os
import ssl
import time
import urllib.request
from collections.abc import Callable, Mapping
from datetime import datetime, timezone
from typing import Any

log = logging.getLogger(__name__)

ENV_URL = "KUBEFLOW_TRAINER_SERVER_URL"
ENV_CA_CERT = "KUBEFLOW_TRAINER_SERVER_CA_CERT"
ENV_TOKEN = "KUBEFLOW_TRAINER_SERVER_TOKEN"
MIN_INTERVAL_S = 5.0
TIMEOUT_S = 5.0
# The metric line's figures the status carries (the CRD allows 256, each value at most 64 characters).
FIGURES = {"train": ("loss", "lr", "grad_norm", "tokens_per_s", "mfu", "peak_memory_gib"), "val": ("val_loss",)}


def _text(value: Any) -> str:
    """A metric value as the CRD wants it: a string of 1-64 characters."""
    if isinstance(value, float):
        return f"{value:.6g}"
    return str(value)[:64]


class TrainJobStatusSink:
    """A metrics sink that posts the run's progress to the TrainJob's status server."""

    name = "trainjob-status"

    def __init__(self, url: str, ca_cert: str | None, token_path: str, total_steps: int,
                 clock: Callable[[], float] = time.monotonic):
        self.url, self.token_path, self.total = url, token_path, total_steps
        self.context = ssl.create_default_context(cafile=ca_cert) if ca_cert and os.path.isfile(ca_cert) else None
        self.clock = clock
        self.figures: dict[str, str] = {}
        self.step = 0
        self.start: tuple[int, float] | None = None  # (step, time) this attempt began at
        self.posted_at = -math.inf
        self.failing = False

    @classmethod
    def from_env(cls, total_steps: int, env: Mapping[str, str] = os.environ) -> TrainJobStatusSink | None:
        """The sink where the controller injected its endpoint; None elsewhere."""
        url, token = env.get(ENV_URL), env.get(ENV_TOKEN)
        if not url or not token:
            return None
        return cls(url, env.get(ENV_CA_CERT), token, total_steps)

    def log(self, kind: str, metrics: dict[str, Any]) -> None:
        now = self.clock()
        self.step = int(metrics.get("step", self.step))
        if kind == "start":
            self.start = (self.step, now)
            return
        self.figures.update({k: _text(metrics[k]) for k in FIGURES.get(kind, ()) if metrics.get(k) is not None})
        if now - self.posted_at >= MIN_INTERVAL_S:
            self._post(self.status(now))

    def close(self, ok: bool) -> None:
        self._post(self.status(self.clock(), finished=ok and self.step >= self.total))

    def status(self, now: float, finished: bool = False) -> dict[str, Any]:
        """trainerStatus as the CRD has it (trainer.kubeflow.org/v1alpha1)."""
        done = 100 if finished else min(100, max(0, math.floor(100 * self.step / self.total))) if self.total else 0
        out: dict[str, Any] = {"progressPercentage": done}
        if finished:
            out["estimatedRemainingSeconds"] = 0
        elif self.start is not None and self.step > self.start[0]:
            per_step = (now - self.start[1]) / (self.step - self.start[0])
            out["estimatedRemainingSeconds"] = max(0, round(per_step * (self.total - self.step)))
        figures = {"step": str(self.step), "total_steps": str(self.total), **self.figures}
        out["metrics"] = [{"name": k, "value": v} for k, v in figures.items()]
        out["lastUpdatedTime"] = datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
        return out

    def _post(self, status: dict[str, Any]) -> None:
        self.posted_at = self.clock()
        try:
            # The projected token rotates: read it for each post.
            with open(self.token_path) as f:
                token = f.read().strip()
            request = urllib.request.Request(
                self.url, data=json.dumps({"trainerStatus": status}).encode(), method="POST",
                headers={"Authorization": f"Bearer {token}", "Content-Type": "application/json"})
            with urllib.request.urlopen(request, timeout=TIMEOUT_S, context=self.context) as response:
                response.read()
        except Exception as e:  # the status is a side channel: training never waits on it
            if not self.failing:
                detail = str(e).splitlines()[0][:160] if str(e) else ""
                log.warning(f"TrainJob status: the controller at {self.url} did not take the progress "
                            f"({type(e).__name__}: {detail}); training goes on, and later steps try again")
            self.failing = True
            return
        self.failing = False
