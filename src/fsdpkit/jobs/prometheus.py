"""A job's GPUs over its lifetime, from Prometheus: the DCGM exporter's series (which HyperPod's
observability add-on and the NVIDIA GPU operator scrape, into Amazon Managed Prometheus or any
Prometheus), averaged per node and pod. AMP workspaces are queried with SigV4."""

from __future__ import annotations

import datetime as dt
import statistics
from typing import Any

from fsdpkit.errors import UserError
from fsdpkit.jobs.utilisation import stragglers

# What each node row holds -> the DCGM exporter's metric. With its Kubernetes mapping on (the Helm
# chart's default) each series carries the pod that holds the GPU, and Hostname is the node.
SERIES = {"gpu_util_pct": "DCGM_FI_DEV_GPU_UTIL", "gpu_mem_used_mib": "DCGM_FI_DEV_FB_USED"}
NODE_LABEL = "Hostname"


class PrometheusError(UserError):
    """Prometheus refused or could not be reached: a remote failure, exit code 3 like AWS's and the cluster's."""

    exit_code = 3


def query(metric: str, job: str, namespace: str) -> str:
    """Per node and pod, the mean over the pod's GPUs. Job pods are JOB-master-0, JOB-node-0-0-x,
    JOB-pod-1, ...; names are DNS labels, so only '.' needs escaping in the regex."""
    pods = job.replace(".", "\\\\.") + "-.*"
    return f'avg by({NODE_LABEL},pod)({metric}{{namespace="{namespace}",pod=~"{pods}"}})'


def _stats(values: list[float]) -> dict[str, float]:
    return {"mean": round(statistics.fmean(values), 1), "min": min(values), "max": max(values)}


def job_utilisation(url: str, job: str, namespace: str, start: dt.datetime, end: dt.datetime, step: int,
                    auth: Any = None) -> dict[str, Any]:
    """Per node: GPU utilisation and memory over [start, end] every `step` seconds (the series and
    their mean/min/max), and the nodes whose mean utilisation lies far from the job's median."""
    try:
        from prometheus_api_client import PrometheusConnect
        from prometheus_api_client.exceptions import PrometheusApiClientException
    except ImportError:
        raise UserError("fsdpkit metrics needs prometheus-api-client: pip install 'fsdpkit[cloud]'") from None
    import requests

    prom = PrometheusConnect(url=url, auth=auth, disable_ssl=False)
    rows: dict[tuple[str, str], dict[str, Any]] = {}
    for key, metric in SERIES.items():
        try:
            result = prom.custom_query_range(query(metric, job, namespace), start_time=start, end_time=end,
                                             step=f"{step}s")
        except PrometheusApiClientException as e:
            text = str(e)
            if "403" in text:
                raise PrometheusError(f"Prometheus at {url} refused the query (403): your role needs "
                                      "aps:QueryMetrics on the workspace",
                                      hint="grant aps:QueryMetrics to your IAM role or user",
                                      code="access_denied") from None
            raise PrometheusError(f"Prometheus at {url} failed the query for {metric}: {text.splitlines()[0][:200]}",
                                  code="failed") from None
        except requests.RequestException as e:
            raise PrometheusError(f"cannot reach Prometheus at {url} ({type(e).__name__}); check the URL and your "
                                  "network", code="unreachable") from None
        for series in result:
            labels = series.get("metric") or {}
            row = rows.setdefault((labels.get(NODE_LABEL, "?"), labels.get("pod", "?")),
                                  {"node": labels.get(NODE_LABEL), "pod": labels.get("pod"), "series": {}})
            points = [(float(t), float(v)) for t, v in series.get("values") or []]
            row["series"][key] = points
            if points:
                row[key] = _stats([v for _, v in points])
    nodes = sorted(rows.values(), key=lambda r: (r["pod"] or "", r["node"] or ""))
    means = [{"pod": r["pod"], "node": r["node"], "gpu_util_pct": r["gpu_util_pct"]["mean"]}
             for r in nodes if "gpu_util_pct" in r]
    return {"job": job, "namespace": namespace, "prometheus": url, "start": start.isoformat(),
            "end": end.isoformat(), "step_s": step, "nodes": nodes,
            "findings": [f.to_dict() for f in stragglers(means)]}
