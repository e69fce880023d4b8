"""`fsdpkit metrics`: prometheus-api-client against a local HTTP server that answers PromQL range
queries with recorded DCGM responses, and checks every request's SigV4 signature the way a
workspace of Amazon Managed Prometheus does (a bad one gets 403). The job's lifetime comes from
the job's status in kmock."""

from __future__ import annotations

import json

import pytest

from fsdpkit.jobs.prometheus import query

from conftest import run_cli
from job_specs import GROUP, PLURAL, VERSION, job_cli, set_conditions, write_spec
from prometheus_server import RecordedPrometheus

START, END = 1795401600, 1795401600 + 1800  # 2026-11-23 02:40 to 03:10 UTC

@pytest.fixture
def prometheus():
    p = RecordedPrometheus("s3cr3t-key", "session-token")
    yield p
    p.close()


@pytest.fixture
def finished_job(kube, tmp_path):
    """A job that ran for 30 minutes, as its operator recorded it."""
    from kubernetes import client

    assert job_cli(kube, "submit", str(write_spec(tmp_path))).returncode == 0
    set_conditions(kube, "llama-tiny", "Created", "Running", "Succeeded")
    client.CustomObjectsApi(kube.api()).patch_namespaced_custom_object_status(
        GROUP, VERSION, "default", PLURAL, "llama-tiny",
        {"status": {"startTime": "2026-11-23T02:40:00Z", "completionTime": "2026-11-23T03:10:00Z"}})
    return kube


def metrics(kube, prometheus, tmp_path, secret="s3cr3t-key", *extra):
    env = {**kube.env, "AWS_ACCESS_KEY_ID": "AKIDEXAMPLE", "AWS_SECRET_ACCESS_KEY": secret,
           "AWS_SESSION_TOKEN": "session-token", "AWS_REGION": "us-west-2",
           "AWS_CONFIG_FILE": str(tmp_path / "none"), "AWS_SHARED_CREDENTIALS_FILE": str(tmp_path / "none")}
    return run_cli("metrics", "llama-tiny", "--prometheus", prometheus.url, "--sigv4", *extra, env=env)


def test_per_node_utilisation_over_the_jobs_lifetime_signed_with_sigv4(finished_job, prometheus, tmp_path):
    out = tmp_path / "cluster-metrics.json"
    r = metrics(finished_job, prometheus, tmp_path, "s3cr3t-key", "--json", "--out", str(out))
    env = json.loads(r.stdout)
    # Both range queries, signed, for the job's pods over its recorded lifetime.
    assert [(p["query"], p["start"], p["end"], p["step"], ok) for p, ok in prometheus.requests] == [
        (query("DCGM_FI_DEV_GPU_UTIL", "llama-tiny", "default"), str(START), str(END), "15s", True),
        (query("DCGM_FI_DEV_FB_USED", "llama-tiny", "default"), str(START), str(END), "15s", True)]
    assert prometheus.requests[0][0]["query"] == \
        'avg by(Hostname,pod)(DCGM_FI_DEV_GPU_UTIL{namespace="default",pod=~"llama-tiny-.*"})'
    data = env["data"]
    nodes = {n["pod"]: n for n in data["nodes"]}
    assert {n["node"] for n in nodes.values()} == {"ip-10-1-0-11", "ip-10-1-0-12", "ip-10-1-0-13"}
    master = nodes["llama-tiny-master-0"]
    assert master["gpu_util_pct"] == {"mean": 89.8, "min": 0.0, "max": 97.0}
    assert master["gpu_mem_used_mib"]["max"] == 71264.0 and len(master["series"]["gpu_util_pct"]) == 31
    # The node at about 58% against the others' 95%: a straggler over the whole run; exit 1.
    assert r.returncode == 1 and env["ok"] is False
    assert [(f["kind"], f["pod"]) for f in data["findings"]] == [("straggler", "llama-tiny-worker-1")]
    assert json.loads(out.read_text())["nodes"] == data["nodes"]
    assert "AKIDEXAMPLE" not in r.stdout and "s3cr3t" not in r.stdout + r.stderr
    human = metrics(finished_job, prometheus, tmp_path)
    assert "  llama-tiny-worker-1 on ip-10-1-0-13: GPU 54% (min 0, max 59), memory up to 69.6 GiB per GPU  ▁▁▅" \
        in human.stdout


def test_a_wrong_signature_is_refused_in_one_line(finished_job, prometheus, tmp_path):
    r = metrics(finished_job, prometheus, tmp_path, "not-the-key", "--json")
    assert [ok for _, ok in prometheus.requests] == [False]
    env = json.loads(r.stdout)
    assert r.returncode == 3 and env["error"]["code"] == "access_denied"
    assert env["error"]["hint"] == "grant aps:QueryMetrics to your IAM role or user"
    assert "Traceback" not in r.stderr
