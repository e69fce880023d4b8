"""EFA proven, not assumed: the verdict read from NCCL's own INFO lines (recorded logs of both
outcomes, and of a node without EFA), the rule that stops a run, and a real 2-rank run that stops
before its first step (exit 2, one line) when the NCCL log shows sockets."""

from __future__ import annotations

import io
import json
import os
from unittest import mock

import pytest

from fsdpkit.errors import UserError
from fsdpkit.jobs.health import check_network_log
from fsdpkit.train.observe import nccl_log
from fsdpkit.train.parallel.network import decide, efa_expected

from conftest import FAST, ROOT, cli_here, read_metrics, run_cli

LOGS = ROOT / "tests" / "data" / "nccl"


def verdict(name: str) -> nccl_log.NetworkVerdict:
    return nccl_log.read((LOGS / name).read_text())


def test_efa_is_read_from_nccl_and_aws_ofi_nccl_lines():
    v = verdict("p5-efa.log")
    assert (v.transport, v.provider, v.nics, v.plugin, v.nccl) == ("efa", "efa", 32, "1.14.0", "2.21.5+cuda12.4")
    assert v.line() == "fsdpkit: network: efa (NCCL 2.21.5+cuda12.4, aws-ofi-nccl 1.14.0, provider efa, 32 NICs)"
    legacy = verdict("p4d-efa-legacy.log")   # plugin named "AWS Libfabric", "Selected Provider is efa"
    assert (legacy.transport, legacy.provider, legacy.nics) == ("efa", "efa", 4)


@pytest.mark.parametrize("name", ["p5-socket-fallback.log", "g5-no-efa.log"])
def test_socket_fallback_is_read_with_its_cause(name):
    v = verdict(name)
    assert v.transport == "socket" and v.nics == 1
    assert "libnccl-net.so not found" in v.detail


@pytest.mark.parametrize("name", ["p5-efa.log", "p5-socket-fallback.log", "p4d-efa-legacy.log"])
def test_the_trainer_line_reads_back_to_the_same_verdict(name):
    v = verdict(name)
    assert nccl_log.from_trainer_log(f"2026-11-23T10:00:00Z {v.line()}\nBatch 1 Loss: 3.1") == v


def test_job_logs_check_network_takes_the_trainer_line_or_nccls():
    assert check_network_log(verdict("p5-efa.log").line())[0] == "pass"
    assert check_network_log(verdict("p5-socket-fallback.log").line())[0] == "fail"
    assert check_network_log((LOGS / "p5-socket-fallback.log").read_text())[0] == "fail"
    assert check_network_log("Batch 1 Loss: 3.0")[0] == "unknown"


EFA, SOCKET, NO_EFA = verdict("p5-efa.log"), verdict("p5-socket-fallback.log"), verdict("g5-no-efa.log")


@pytest.mark.parametrize(("verdicts", "require", "nodes", "expected", "stops"), [
    ([EFA, EFA], "auto", 2, True, False),          # p5, two nodes on EFA: runs
    ([EFA, SOCKET], "auto", 2, True, True),        # one node fell back to sockets: stops
    ([SOCKET, SOCKET], "auto", 1, True, False),    # one node: NVLink carries the traffic, no need
    ([NO_EFA, NO_EFA], "auto", 2, False, False),   # g5.2xlarge has no EFA: sockets are expected
    ([NO_EFA, NO_EFA], "on", 2, False, True),      # ... unless EFA is demanded
    ([EFA, SOCKET], "off", 2, True, False),
], ids=["efa", "fallback", "one-node", "no-efa-node", "required", "off"])
def test_a_socket_fallback_where_efa_was_expected_stops_the_run(verdicts, require, nodes, expected, stops):
    if stops:
        with pytest.raises(UserError, match="require_efa: NCCL chose socket, not EFA, on rank"):
            decide(verdicts, require, nodes, expected)
    else:
        # The run goes on, reporting its worst rank.
        assert decide(verdicts, require, nodes, expected) == next((v for v in verdicts if v.transport != "efa"),
                                                                  verdicts[0])


def test_efa_is_expected_from_the_job_env_or_the_kernels_devices(tmp_path, monkeypatch):
    monkeypatch.delenv("FI_PROVIDER", raising=False)
    sysfs = tmp_path / "infiniband"
    (sysfs / "mlx5_0" / "device").mkdir(parents=True)
    (tmp_path / "drivers" / "mlx5_core").mkdir(parents=True)
    (sysfs / "mlx5_0" / "device" / "driver").symlink_to(tmp_path / "drivers" / "mlx5_core")
    assert not efa_expected(sysfs)
    (sysfs / "rdmap16s27" / "device").mkdir(parents=True)
    (tmp_path / "drivers" / "efa").mkdir()
    (sysfs / "rdmap16s27" / "device" / "driver").symlink_to(tmp_path / "drivers" / "efa")
    assert efa_expected(sysfs)
    monkeypatch.setenv("FI_PROVIDER", "efa")
    assert efa_expected(tmp_path / "nothing")


@pytest.mark.slow
@pytest.mark.parametrize(("log", "code"), [("p5-socket-fallback.log", 2), ("p5-efa.log", 0)], ids=["socket", "efa"])
def test_require_efa_on_stops_a_run_whose_nccl_log_shows_sockets(tmp_path, log, code):
    """Two real ranks under torchrun, each pointed at a recorded NCCL log through NCCL's own
    NCCL_DEBUG_FILE (gloo on this CPU never writes it): the run stops before its first step, in one
    line with exit 2, or trains and says which network it used."""
    nccl = tmp_path / "nccl.log"
    nccl.write_text((LOGS / log).read_text())
    r = run_cli("train", *FAST, "--nproc", "2", "--max_steps", "2", "--logging_freq", "1", "--tensorboard", "0",
                "--train_batch_size", "2", "--require_efa", "on", "--run_dir", str(tmp_path / "run"),
                env={"NCCL_DEBUG_FILE": str(nccl)})
    assert r.returncode == code, r.stderr[-3000:]
    if code:
        assert r.stderr.strip().splitlines() == [r.stderr.strip()]
        assert r.stderr.startswith("error: require_efa: NCCL chose socket, not EFA")
        assert not (tmp_path / "run" / "metrics.jsonl").exists()   # no step was spent
    else:
        assert verdict(log).line() in r.stdout
        assert [m["step"] for m in read_metrics(tmp_path / "run")] == [1, 2]


def test_require_efa_on_without_nccl_is_refused(tmp_path, cli):
    r = cli("train", *FAST, "--max_steps", "1", "--require_efa", "on", "--run_dir", str(tmp_path / "run"),
            env={k: v for k, v in os.environ.items() if k != "NCCL_DEBUG_FILE"})
    assert r.returncode == 2 and "require_efa: on, but this run has no NCCL log" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1


def test_job_check_network_reads_a_saved_log_file_or_standard_input(tmp_path):
    """A log saved from anywhere (kubectl logs, Slurm's output file, a HyperPod node's): the verdict
    without planting it in a job store; exit 1 for a fall-back to sockets, one line for no file."""
    ok = cli_here("job", "check-network", str(LOGS / "p5-efa.log"))
    assert (ok.returncode, ok.stdout) == (0, "network check: pass: NCCL is using EFA through aws-ofi-nccl (efa (NCCL "
                                             "2.21.5+cuda12.4, aws-ofi-nccl 1.14.0, provider efa, 32 NICs))\n")
    saved = tmp_path / "rank0.log"
    saved.write_text(f"2026-11-23T10:00:00Z {verdict('p5-socket-fallback.log').line()}\nBatch 1 Loss: 3.1\n")
    bad = cli_here("job", "check-network", str(saved), "--json")
    data = json.loads(bad.stdout)
    assert bad.returncode == 1 and data["data"]["verdict"] == "fail"
    assert data["error"]["message"].startswith("network check failed: NCCL fell back to TCP sockets")
    with mock.patch("sys.stdin", io.StringIO("Batch 1 Loss: 3.0\n")):
        unknown = cli_here("job", "check-network", "-")
    assert unknown.returncode == 0 and unknown.stdout.startswith("network check: unknown: no network verdict")
    gone = cli_here("job", "check-network", str(tmp_path / "none.log"))
    assert (gone.returncode, gone.stderr) == (2, f"error: check-network: {tmp_path / 'none.log'} is not a file; "
                                                 "pass a saved log (or - for standard input)\n")
