"""Each node as the cluster sees it: `job watch` runs its sample script in every pod through the API
server's exec, here answered by a stand-in kubelet that runs the very command against a fake /sys
tree (bind-mounted over /sys/class in a mount namespace of its own) and a recorded nvidia-smi.
From that: per-node GPU and EFA rates, stragglers, and EFA that stays flat while the job trains."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
from pathlib import Path

import pytest

from fsdpkit.jobs.utilisation import EFA_COUNTERS, parse_gpu_util, parse_sample, sample_script, stragglers

from conftest import ROOT, run_cli
from job_specs import job_cli, set_conditions, stamp, write_spec

DATA = ROOT / "tests" / "data" / "efa"


def test_recorded_counters_give_the_nodes_efa_rate_and_gpus():
    busy = parse_sample((DATA / "p4d-training.txt").read_text(), window=5).to_dict()
    # 4 devices x 14.0 GB (sends, receives, RDMA reads and their responses) over 5.012 s.
    assert busy["efa_devices"] == 4 and busy["window_s"] == 5.01
    assert busy["efa_gbit_s"] == pytest.approx(4 * 14.0e9 * 8 / 5.012356571 / 1e9, abs=1e-3)
    assert busy["gpu_util_pct"] == 97.8 and busy["gpu_mem_used_gib"] == 290.8 and busy["gpu_mem_total_gib"] == 320.0
    flat = parse_sample((DATA / "p4d-flat.txt").read_text(), window=5).to_dict()
    assert flat["efa_devices"] == 4 and flat["efa_gbit_s"] == 0.0
    # A counter that went backwards (the device was reset) counts as nothing moved, not as negative.
    reset = (DATA / "p4d-training.txt").read_text().replace("efa rdmap16s27/ports/1 tx_bytes 912334201118",
                                                             "efa rdmap16s27/ports/1 tx_bytes 999999999999999")
    assert parse_sample(reset, 5).efa_bytes_per_s < parse_sample((DATA / "p4d-training.txt").read_text(),
                                                                  5).efa_bytes_per_s
    # No nvidia-smi, no /sys/class/infiniband: nothing seen, nothing invented.
    assert parse_sample("t 1.0\nt 6.0\n", 5).to_dict()["gpu_util_pct"] is None


def test_gpu_utilisation_output_is_parsed():
    text = "0, 97, 71234, 81559\n1, 95, 70988, 81559\nNVIDIA-SMI has failed\n"
    assert parse_gpu_util(text) == [{"gpu": 0, "util_pct": 97, "mem_used_mib": 71234, "mem_total_mib": 81559},
                                    {"gpu": 1, "util_pct": 95, "mem_used_mib": 70988, "mem_total_mib": 81559}]


def test_stragglers_are_far_from_the_median():
    nodes = [{"pod": "a", "gpu_util_pct": 97, "step_time_s": 2.0}, {"pod": "b", "gpu_util_pct": 95, "step_time_s": 2.1},
             {"pod": "c", "gpu_util_pct": 69, "step_time_s": 2.0}, {"pod": "d", "gpu_util_pct": 96, "step_time_s": 2.6}]
    found = [(f.pod, f.detail.split(" against")[0]) for f in stragglers(nodes)]
    assert found == [("c", "GPU utilisation 69%"), ("d", "step time 2.60 s")]
    assert stragglers(nodes[:1]) == []  # one node has no median to be far from


# -- the exec path, end to end -------------------------------------------------------------------------
BYTES_PER_S = 100_000_000  # per counter on a flowing node, as NCCL traffic would move them


class FakeNode:
    """One node's /sys/class/infiniband (4 EFA devices) and nvidia-smi. On a `flowing` node the
    sample script's own `sleep` is this node's: it sleeps, then moves every EFA counter on by
    BYTES_PER_S for each second slept, so the bytes in a window are exact however busy the machine."""

    def __init__(self, root: Path, gpu_util: int, flowing: bool):
        self.root = root
        for dev in ("rdmap16s27", "rdmap32s27", "rdmap144s27", "rdmap160s27"):
            counters = root / "class" / "infiniband" / dev / "ports" / "1" / "hw_counters"
            counters.mkdir(parents=True)
            for name in (*EFA_COUNTERS, "rx_drops"):
                (counters / name).write_text("1000\n")
        (root / "bin").mkdir()
        smi = root / "bin" / "nvidia-smi"
        rows = "".join(f"{i}, {gpu_util}, 61000, 81559\\n" for i in range(8))
        smi.write_text(f"#!/bin/sh\nprintf '{rows}'\n")
        smi.chmod(0o755)
        if flowing:
            # Runs inside the pod's mount namespace, where /sys/class is this node's tree.
            sleep = root / "bin" / "sleep"
            sleep.write_text(
                '#!/bin/sh\n/bin/sleep "$1" || exit\n'
                f'for c in {" ".join(EFA_COUNTERS)}; do for f in /sys/class/infiniband/*/ports/1/hw_counters/$c; do '
                f'read -r v < "$f"; echo $((v + {BYTES_PER_S} * $1)) > "$f.tmp"; mv "$f.tmp" "$f"; done; done\n')
            sleep.chmod(0o755)


@pytest.fixture
def nodes(kube, tmp_path):
    """Pods on fake nodes: the stand-in kubelet runs each exec'd command in a mount namespace where
    /sys/class is the pod's node's tree and nvidia-smi its recording."""
    if os.geteuid() != 0 or not shutil.which("unshare"):
        pytest.skip("the stand-in kubelet bind-mounts a fake /sys/class: needs root and unshare")
    fake: dict[str, FakeNode] = {}

    async def kubelet(pod, container, command):
        node = fake[pod]
        proc = await asyncio.create_subprocess_exec(
            "unshare", "--mount", "sh", "-c", 'mount --bind "$0" /sys/class && exec "$@"', str(node.root / "class"),
            *command, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.DEVNULL,
            env={"PATH": f"{node.root / 'bin'}:/usr/bin:/bin"})
        out, _ = await proc.communicate()
        return out, proc.returncode

    kube.serve_exec(kubelet)

    def add(name, rtype, index, node_name, gpu_util, flowing, seconds_per_step):
        fake[name] = FakeNode(tmp_path / name, gpu_util, flowing)
        kube.create("/api/v1/namespaces/default/pods", {
            "apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "namespace": "default", "labels": {
                "training.kubeflow.org/job-name": "llama-tiny", "training.kubeflow.org/replica-type": rtype,
                "training.kubeflow.org/replica-index": str(index)}},
            "spec": {"nodeName": node_name, "containers": [{"name": "pytorch", "image": "x", "resources": {
                "limits": {"nvidia.com/gpu": "8", "vpc.amazonaws.com/efa": "4"}}}]},
            "status": {"phase": "Running"}})
        # Rank 0's progress lines, or a node's own, one logging interval (10 steps) apart.
        lines = [f"{stamp(10 * seconds_per_step * (2 - i) + 3)} Batch {10 * (i + 1)} Loss: 3.{i}0000, " +
                 ("Speed: 1.0 samples/sec, lr: 0.0003, grad_norm: 1.0, tokens/s: 81234" if rtype == "master"
                  else f"node {index + 1}") for i in range(3)]
        kube.route(f"get /api/v1/namespaces/default/pods/{name}/log", ("\n".join(lines) + "\n").encode())

    return add


def watch(kube, *extra):
    r = job_cli(kube, "watch", "llama-tiny", "--once", "--json", "--sample-seconds", "1", *extra)
    assert r.stdout, r.stderr[-3000:]
    return r.returncode, json.loads(r.stdout)


@pytest.fixture
def running(kube, tmp_path):
    assert job_cli(kube, "submit", str(write_spec(tmp_path))).returncode == 0
    set_conditions(kube, "llama-tiny", "Created", "Running")
    return kube


def test_watch_samples_every_node_and_names_the_straggler(running, nodes):
    kube = running
    nodes("llama-tiny-master-0", "master", 0, "ip-10-1-0-11", 97, True, 2.0)
    nodes("llama-tiny-worker-0", "worker", 0, "ip-10-1-0-12", 95, True, 2.0)
    nodes("llama-tiny-worker-1", "worker", 1, "ip-10-1-0-13", 31, True, 3.0)
    code, env = watch(kube)
    snap = env["data"]
    by_pod = {n["pod"]: n for n in snap["nodes"]}
    assert set(by_pod) == {"llama-tiny-master-0", "llama-tiny-worker-0", "llama-tiny-worker-1"}
    # What the API server saw: one exec of the sample script per pod, in the training container.
    assert sorted((p, c, cmd[:2]) for p, c, cmd in kube.execs) == [
        (p, "pytorch", ["sh", "-c"]) for p in sorted(by_pod)]
    assert all(cmd[2] == sample_script(1) for _, _, cmd in kube.execs)
    for n in by_pod.values():
        assert n["node"].startswith("ip-10-1-0-1") and n["efa_devices"] == 4 and n["window_s"] >= 1
        # 6 counters x 4 devices moved 100 MB each in the window the script timed itself.
        assert n["efa_gbit_s"] == pytest.approx(24 * BYTES_PER_S * 8 / 1e9 / n["window_s"], rel=0.01), n
        assert n["gpu_mem_used_gib"] == pytest.approx(8 * 61000 / 1024, abs=0.1)
    assert (by_pod["llama-tiny-master-0"]["gpu_util_pct"], by_pod["llama-tiny-worker-1"]["gpu_util_pct"]) == (97, 31)
    assert by_pod["llama-tiny-worker-0"]["step_time_s"] == pytest.approx(2.0, abs=0.01)
    assert by_pod["llama-tiny-worker-1"]["step_time_s"] == pytest.approx(3.0, abs=0.01)
    # The straggler, by both signals, and nothing else: EFA flows everywhere.
    assert code == 1 and env["ok"] is False and env["error"]["code"] == "failed"
    assert [(f["kind"], f["pod"]) for f in snap["findings"]] == [("straggler", "llama-tiny-worker-1")] * 2
    assert "GPU utilisation 31% against a median of 95% across 3 nodes on node ip-10-1-0-13" in \
        snap["findings"][0]["detail"]
    assert "cordon" in snap["findings"][0]["fix"]
    human = run_cli("job", "watch", "llama-tiny", "--once", "--sample-seconds", "1", env=kube.env)
    assert "  llama-tiny-worker-1 on ip-10-1-0-13: GPU 31% 477/637 GiB, EFA " in human.stdout
    assert "! straggler llama-tiny-worker-1: step time 3.00 s against a median of 2.00 s" in human.stdout


def test_flat_efa_while_the_job_trains_is_flagged(running, nodes):
    kube = running
    nodes("llama-tiny-master-0", "master", 0, "ip-10-1-0-11", 97, False, 2.0)
    nodes("llama-tiny-worker-0", "worker", 0, "ip-10-1-0-12", 96, False, 2.0)
    code, env = watch(kube)
    snap = env["data"]
    assert [n["efa_gbit_s"] for n in snap["nodes"]] == [0.0, 0.0]
    assert code == 1 and {(f["kind"], f["pod"]) for f in snap["findings"]} == {
        ("efa_flat", "llama-tiny-master-0"), ("efa_flat", "llama-tiny-worker-0")}
    flat = snap["findings"][0]
    assert flat["detail"].startswith("EFA counters flat over 1") and "on 4 devices while the job trains" in \
        flat["detail"]
    assert "fsdpkit job logs llama-tiny --check-network" in flat["fix"]
    assert env["error"]["hint"] == flat["fix"]
    # Without sampling nothing is exec'd and nothing is claimed.
    before = len(kube.execs)
    code, env = watch(kube, "--no-sample")
    assert code == 0 and env["data"]["nodes"] == [] and len(kube.execs) == before
