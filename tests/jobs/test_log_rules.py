"""HyperPod's log-monitoring rules, written from the trainer's own lines, evaluated by HyperPod's
own evaluator (hyperpod-elastic-agent's LogEvaluator, what runs on every node) on the logs a real
two-node run writes, and on crafted lines of a run that never starts, hangs, goes nan or diverges."""

from __future__ import annotations

import math
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
from ports import free_port

from fsdpkit.jobs import hyperpod, log_rules
from fsdpkit.jobs.resolved import load_job
from fsdpkit.plan.grace import MIN_HANG_S

from conftest import FAST, ROOT
from manifest_schemas import IMAGE, hyperpod_log_evaluator


def spec(**hp):
    return load_job(None, [("name", "rules"), ("backend", "hyperpod"), ("image", IMAGE), ("nodes", 2),
                            ("instance_type", "ml.p5.48xlarge"), ("storage", {"claim": "fsx"}),
                            ("train", {"preset": "tiny"}), ("hyperpod", hp)])


def evaluate(rule, lines, **times):
    """Feed `lines` (text, or None for a tick without a line) to the agent's evaluator of `rule`,
    its time limits shortened to `times` seconds; the last state."""
    Evaluator = hyperpod_log_evaluator()
    ev = Evaluator({**rule, **times})
    state = None
    for line in lines:
        if line == "sleep":
            time.sleep(1.2)
            line = None
        state, _ = ev.evaluate(line)
    return state.value


@pytest.fixture(scope="module")
def node_logs(tmp_path_factory):
    """stdout of local rank 0 on each of two nodes, from a real two-node run on 127.0.0.1 written
    the way HyperPod's agent has it written (--tee 3 under --log-dir), and rank 0's console."""
    tmp = tmp_path_factory.mktemp("two-nodes")
    port = free_port()
    torchrun = Path(sys.executable).parent / "fsdpkit-torchrun"
    procs = [subprocess.Popen(
        [str(torchrun), "--nnodes=2", "--nproc-per-node=1", "--rdzv-backend=c10d",
         f"--rdzv-endpoint=127.0.0.1:{port}", "--rdzv-id=rules", f"--log-dir={tmp / f'node{i}'}", "--tee=3",
         "-m", "fsdpkit.train", *FAST, "--max_steps", "6", "--logging_freq", "2", "--tensorboard", "0",
         "--run_dir", str(tmp / "run")],
        cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        text=True) for i in range(2)]
    outs = [p.communicate(timeout=300)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    files = [sorted((tmp / f"node{i}").rglob("stdout.log")) for i in range(2)]
    assert all(len(f) == 1 for f in files), files
    return [f[0].read_text().splitlines() for f in files]


def test_every_node_says_each_logged_step(node_logs):
    # Which agent's worker became rank 0 is the rendezvous's choice: tell them apart by their lines.
    node1, rank0 = sorted(node_logs, key=lambda lines: any(ln.startswith("Batch ") and "Validation" in ln
                                                           for ln in lines))
    assert [ln.split(" Loss")[0] for ln in rank0 if ln.startswith("Batch ") and "Validation" not in ln] == \
        ["Batch 2", "Batch 4", "Batch 6"]
    assert [ln.split(" Loss")[0] for ln in node1 if ln.startswith("Batch ")] == ["Batch 2", "Batch 4", "Batch 6"]
    assert all(ln.endswith("node 1") for ln in node1 if ln.startswith("Batch "))


def test_a_real_run_is_healthy_on_every_node(node_logs):
    rules = log_rules.log_monitoring(spec())
    assert [r["name"] for r in rules] == ["fsdpkit-started", "fsdpkit-progress", "fsdpkit-loss"]
    for lines in node_logs:
        for rule in rules:
            assert evaluate(rule, lines) == "HEALTHY", (rule["name"], lines[-3:])


def test_every_node_s_last_line_ends_the_rules(node_logs):
    """Each node's first process ends with the trainer's last line, and each rule stops there: a node
    that waits after it (for its launcher, for the other nodes) is not a hang. Without the stop
    pattern the same wait would read as one."""
    rules = log_rules.log_monitoring(spec())
    for lines in node_logs:
        assert re.match(rules[0]["stopPattern"], next(ln for ln in reversed(lines) if ln.startswith("fsdpkit: ")))
        for rule in rules:
            assert evaluate(rule, [*lines, "sleep"], expectedRecurringFrequencyInSeconds=1) == "HEALTHY", rule["name"]
        unstopped = {k: v for k, v in rules[1].items() if k != "stopPattern"}
        assert evaluate(unstopped, [*lines, "sleep"], expectedRecurringFrequencyInSeconds=1) == "HANGING"


def test_the_rules_trip_where_the_run_goes_wrong(node_logs):
    started, progress, loss = log_rules.log_monitoring(spec())
    step = next(ln for ln in node_logs[0] if ln.startswith("Batch "))
    before_first_step = node_logs[0][:node_logs[0].index(step)]
    nan = step.replace(step.split("Loss: ")[1].split(",")[0], "nan")
    diverged = step.replace(step.split("Loss: ")[1].split(",")[0], "31.25000")
    # Never started: only start-up lines, past the start limit.
    assert evaluate(started, [*before_first_step, "sleep"], expectedStartCutOffInSeconds=1) == "HANGING"
    # Hung: a step, then nothing past the hang limit.
    assert evaluate(progress, [step, "sleep"], expectedRecurringFrequencyInSeconds=1) == "HANGING"
    # Went nan: step lines keep coming, but none with a finite loss.
    assert evaluate(progress, [step, nan, "sleep", nan], expectedRecurringFrequencyInSeconds=1) == "HANGING"
    assert evaluate(started, [step, nan, "sleep", nan], expectedStartCutOffInSeconds=1) == "HEALTHY"
    assert evaluate(progress, [nan, "sleep", nan], expectedStartCutOffInSeconds=1) == "HANGING"
    # Diverged: above the threshold on 3 lines in a row (2 are not enough).
    assert loss["metricThreshold"] == math.ceil(2 * math.log(258))
    assert evaluate(loss, [diverged, diverged, step]) == "HEALTHY"
    assert evaluate(loss, [diverged, diverged, diverged]) == "SLOW"


def test_rules_follow_the_spec_and_the_plan():
    default = {r["name"]: r for r in log_rules.log_monitoring(spec())}
    assert default["fsdpkit-started"]["expectedStartCutOffInSeconds"] == 1800
    assert default["fsdpkit-progress"]["expectedRecurringFrequencyInSeconds"] == MIN_HANG_S == 600
    # An 8B model on 2 p5 nodes: five logging windows of 100 steps at the planned 1.40 s, 1.5 x the
    # 963.6 s write of its 96.4 GB checkpoint at 100 MB/s, and 60 s: 2205 s, in whole minutes.
    big = load_job(None, [("name", "big"), ("backend", "hyperpod"), ("image", IMAGE), ("nodes", 2),
                           ("instance_type", "ml.p5.48xlarge"), ("storage", {"claim": "fsx", "write_mb_per_s": 100}),
                           ("train", {"preset": "llama3_1_8b", "logging_freq": 100})])
    hang = {r["name"]: r for r in log_rules.log_monitoring(big)}["fsdpkit-progress"]
    assert big.trainer.step_s == pytest.approx(1.39916, abs=1e-5)
    assert hang["expectedRecurringFrequencyInSeconds"] == 2220 and hang["expectedStartCutOffInSeconds"] == 1800 + 2220
    custom = {r["name"]: r for r in log_rules.log_monitoring(spec(start_timeout=600, hang_timeout=900,
                                                                      loss_threshold=30))}
    assert custom["fsdpkit-started"]["expectedStartCutOffInSeconds"] == 600
    assert custom["fsdpkit-progress"]["expectedRecurringFrequencyInSeconds"] == 900
    assert custom["fsdpkit-loss"]["metricThreshold"] == 30
    assert log_rules.log_monitoring(spec(log_monitoring=False)) == []
    job = hyperpod.render(spec(log_monitoring=False))[-1]
    assert "logMonitoringConfiguration" not in job["spec"]["runPolicy"]
