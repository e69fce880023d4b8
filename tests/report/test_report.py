"""`fsdpkit report` on real short runs: one killed and resumed, one plain, overlaid."""

from __future__ import annotations

import json

import pytest
from PIL import Image

from conftest import FAST, read_metrics, run_cli

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("runs")
    common = [*FAST, "--max_steps", "12", "--logging_freq", "2", "--validation_freq", "6", "--tensorboard", "0"]
    # Run A: SIGKILLed after step 7 (last checkpoint at 4), then resumed: steps 6 and 8 are logged twice.
    a = root / "a"
    flags = [*common, "--run_dir", str(a), "--checkpoint_dir", str(root / "ckpt-a"), "--checkpoint_freq", "4"]
    killed = run_cli("train", *flags, env={"FSDPKIT_FAULT": "kill:step=7"})
    assert killed.returncode != 0
    resumed = run_cli("train", *flags, "--resume_from_checkpoint", "auto")
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    b = root / "b"
    plain = run_cli("train", *common, "--run_dir", str(b), "--lr", "1e-3")
    assert plain.returncode == 0, plain.stderr[-2000:]
    return root, a, b


def test_report_overlays_runs_with_restarts_and_embeds_its_plots(runs):
    root, a, b = runs
    out = root / "report"
    r = run_cli("report", str(a), str(b), "--out", str(out), "--json")
    assert r.returncode == 0, r.stderr[-2000:]
    envelope = json.loads(r.stdout)
    assert envelope["ok"] and envelope["error"] is None
    data = envelope["data"]
    assert set(data["plots"]) == {"loss", "lr", "throughput", "mfu", "memory"}
    summaries = {s["name"]: s for s in data["runs"]}
    assert summaries["a"]["restarts"] == 1 and summaries["b"]["restarts"] == 0
    assert summaries["a"]["steps"] == summaries["b"]["steps"] == 12
    assert summaries["a"]["final_loss"] == read_metrics(a)[-1]["loss"]
    assert summaries["b"]["final_val_loss"] == read_metrics(b, "val")[-1]["val_loss"]
    page = (out / "report.html").read_text()
    assert page.count("data:image/png;base64,") == 5
    for stem, path in data["plots"].items():
        assert f'href="{stem}.png"' in page
        with Image.open(path) as img:
            assert img.format == "PNG" and img.size == (800, 450)
            lo, hi = img.convert("L").getextrema()
            assert hi - lo > 100  # lines drawn on the background, not a blank image


def test_report_reads_a_run_being_written(runs, tmp_path):
    """A half-written last line (the trainer mid-write) is skipped; the run shows as not finished."""
    _, a, _ = runs
    live = tmp_path / "live"
    live.mkdir()
    lines = (a / "metrics.jsonl").read_text().splitlines()[:3]
    (live / "metrics.jsonl").write_text("\n".join(lines) + '\n{"kind": "train", "step": 1')
    r = run_cli("report", str(live), "--json")
    assert r.returncode == 0, r.stderr[-2000:]
    [summary] = json.loads(r.stdout)["data"]["runs"]
    last_train = [json.loads(x) for x in lines if json.loads(x)["kind"] == "train"][-1]
    assert summary["finished"] is False and summary["steps"] == last_train["step"]
    assert (live / "report" / "report.html").is_file()


def test_report_on_a_directory_without_metrics_is_one_line(tmp_path):
    r = run_cli("report", str(tmp_path), "--json")
    assert r.returncode == 2
    error = json.loads(r.stdout)["error"]
    assert error["code"] == "bad_input" and "metrics.jsonl" in error["message"]
    r = run_cli("report", str(tmp_path))
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "metrics.jsonl" in r.stderr


def test_report_marks_each_resume_rounds_its_figures_and_plots_no_impossible_mfu(tmp_path):
    """A run stopped on SIGTERM and resumed repeats no step: its start markers still show the
    restart. An MFU over 100% (a wrong denominator) is neither plotted nor summarised."""
    rows = [{"kind": "start", "step": 0}]
    rows += [{"kind": "train", "step": s, "loss": 4.123456789 - s / 10, "lr": 1e-3, "tokens_per_s": 100.0,
              "mfu": 8.38, "peak_memory_gib": 0.5} for s in (2, 4)]
    rows += [{"kind": "start", "step": 4}]
    rows += [{"kind": "train", "step": s, "loss": 3.0 - s / 10, "lr": 1e-3, "tokens_per_s": 100.0, "mfu": 9.1,
              "peak_memory_gib": 0.5} for s in (6, 8)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    r = run_cli("report", str(tmp_path), "--json")
    assert r.returncode == 0, r.stderr[-2000:]
    data = json.loads(r.stdout)["data"]
    assert data["runs"][0]["restarts"] == 1 and data["runs"][0]["median_mfu"] is None
    assert "mfu" not in data["plots"]
    human = run_cli("report", str(tmp_path))
    assert f"{tmp_path.name}: 8 steps (running or stopped), loss 3.9235 -> 2.2000, restarted 1 time(s) (at step 4)" \
        in human.stdout


def test_report_plots_each_nodes_gpu_utilisation_next_to_the_trainers_tokens(runs, tmp_path):
    """What `fsdpkit metrics --out` wrote (per node series from Prometheus) over the same wall-clock
    time as run A: one more plot, with the trainer's tokens/s on its second axis."""
    _, a, _ = runs
    times = [r["time"] for r in read_metrics(a)]
    t0, t1 = min(times) - 60, max(times) + 60
    series = [[t0 + i * (t1 - t0) / 30, 95.0 if i > 1 else 0.0] for i in range(31)]
    cluster = {"job": "llama-tiny", "nodes": [
        {"node": "ip-10-1-0-11", "pod": "llama-tiny-master-0", "series": {"gpu_util_pct": series}},
        {"node": "ip-10-1-0-13", "pod": "llama-tiny-worker-1",
         "series": {"gpu_util_pct": [[t, v * 0.6] for t, v in series]}}]}
    (tmp_path / "cluster.json").write_text(json.dumps(cluster))
    r = run_cli("report", str(a), "--out", str(tmp_path / "out"), "--cluster-metrics", str(tmp_path / "cluster.json"),
                "--json")
    assert r.returncode == 0, r.stderr[-2000:]
    plots = json.loads(r.stdout)["data"]["plots"]
    assert set(plots) == {"loss", "lr", "throughput", "mfu", "memory", "cluster_gpu"}
    with Image.open(plots["cluster_gpu"]) as img:
        assert img.size == (800, 450) and len(img.convert("RGB").getcolors(1 << 16)) > 20  # lines and labels
    assert "GPU utilisation by node (Prometheus)" in (tmp_path / "out" / "report.html").read_text()
    bad = run_cli("report", str(a), "--out", str(tmp_path / "out"), "--cluster-metrics", str(tmp_path / "nope.json"))
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and "fsdpkit metrics JOB" in bad.stderr
