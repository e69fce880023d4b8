"""The benchmarks run (at smoke size) and produce their JSON."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

from conftest import ROOT

pytestmark = pytest.mark.slow


def test_data_and_checkpoint_benchmark_smoke(tmp_path):
    out = tmp_path / "result.json"
    r = subprocess.run([sys.executable, "-m", "benchmarks.data_and_checkpoint", "--smoke", "--out", str(out),
                        "--no-results-md"], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    result = json.loads(out.read_text())
    assert set(result["data"]["tokens_per_s"]) == {"embedded+bytes", "jsonl+bpe", "token-shards"}
    assert all(v > 0 for v in result["data"]["tokens_per_s"].values())
    assert result["training_tokens_per_s"] > 0
    ck = result["checkpoint"]
    for mode in ("sync", "async"):
        assert ck[mode]["bytes"] > 0 and ck[mode]["total_s"] >= ck[mode]["blocked_s"] > 0
    assert ck["load"]["seconds"] > 0
    assert result["env"]["date"] and result["env"]["torch"]


def test_train_throughput_benchmark_smoke(tmp_path):
    """Both trainers run under torchrun with FSDP on two ranks, fsdpkit also alone beside the
    transformers peer (eager here: its cold torch.compile is the benchmark's own cost, measured in
    its rows, not the smoke's); the JSON holds tokens/s, MFU and peak memory for each, and the
    fsdpkit / baseline and fsdpkit / peer ratios."""
    out = tmp_path / "throughput.json"
    r = subprocess.run([sys.executable, "-m", "benchmarks.train_throughput", "--smoke", "--out", str(out)],
                       cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    result = json.loads(out.read_text())
    rows = {(x["impl"], x["world"]): x for x in result["rows"]}
    assert set(rows) == {("fsdpkit", 2), ("baseline", 2), ("fsdpkit", 1), ("transformers", 1)}
    for row in rows.values():
        assert row["tokens_per_s"] > 0 and row["peak_memory_bytes"] > 0 and 0 < row["mfu"] < 1
        assert len(row["measured"]) == row["steps"]
    assert result["peak_flops"] > 0 and result["peak_flops_source"].startswith("measured")
    [ratio] = result["ratios"]
    assert ratio["world"] == 2 and ratio["speedup"] > 0 and ratio["memory_ratio"] > 0
    assert "fsdpkit / baseline" in r.stdout
    # The transformers peer (fp32 weights under autocast) beside fsdpkit's one process.
    [peer] = result["peer_ratios"]
    assert peer["peer"] == "transformers eager fp32 weights+autocast" and peer["speedup"] > 0


def test_optimizer_step_benchmark_smoke(tmp_path):
    """Every way of doing the step's tail is timed, with the bytes it must move: clipping inside the
    fused kernel moves a tenth less than clip_grad_norm_ followed by AdamW."""
    out = tmp_path / "optim.json"
    r = subprocess.run([sys.executable, "-m", "benchmarks.optimizer_step", "--smoke", "--out", str(out)],
                       cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    result = json.loads(out.read_text())
    rows = {row["case"]: row for row in result["rows"]}
    assert len(rows) == 5 and all(row["ms"] > 0 and row["gb_per_s"] > 0 for row in rows.values())
    before, ours = rows["clip_grad_norm_ + AdamW"], rows["clipped_step (clip inside fused AdamW)"]
    assert ours["bytes"] / before["bytes"] == 0.9
    assert result["params"] > 0 and result["env"]["torch"]


def test_lora_benchmark_smoke(tmp_path):
    """The three modes train from the same base: LoRA trains a fraction of the parameters and keeps a
    fraction of the optimizer state, and its step holds less memory; QLoRA trains the same adapters
    over a base whose projections take NF4's bytes, and holds less again."""
    out = tmp_path / "lora.json"
    r = subprocess.run([sys.executable, "-m", "benchmarks.lora_finetune", "--smoke", "--out", str(out)],
                       cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    full, lora, qlora = json.loads(out.read_text())["rows"]
    assert (full["mode"], lora["mode"], qlora["mode"]) == ("full", "lora", "qlora")
    assert full["params"] < lora["params"] == qlora["params"] and qlora["trainable"] == lora["trainable"]
    assert full["trainable"] == full["params"] and lora["trainable"] < full["trainable"] / 4
    assert lora["optimizer_bytes"] == 8 * lora["trainable"]   # AdamW's two fp32 moments, adapters alone
    assert lora["peak_bytes"] < full["peak_bytes"] and lora["tokens_per_s"] > 0
    # The tiny shape's 4 layers of projections (128 x 128 four times, 384 x 128 three times) at
    # 0.516 bytes a parameter instead of 4.
    projections = 4 * (4 * 128 * 128 + 3 * 384 * 128)
    assert lora["weight_bytes"] - qlora["weight_bytes"] == projections * (4 - (0.5 + 1 / 64 + 4 / 16384))
    assert qlora["peak_bytes"] < lora["peak_bytes"] and qlora["tokens_per_s"] > 0


def test_every_case_can_be_picked_with_select():
    """--select takes IMPL:LABEL:SEQxBATCH keys separated by commas: no label may hold one (a lent
    GPU's minutes were lost to a case that could not be named)."""
    from benchmarks.train_throughput import SECTIONS, gpu_plan, plan

    cases = gpu_plan(2) + plan(False, "cpu", "fp32", set(SECTIONS)) + plan(True, "cpu", "fp32", set(SECTIONS))
    keys = [f"{c['impl']}:{c['label']}:{c['seq']}x{c['batch']}" for c in cases]
    assert ",".join(keys).split(",") == keys
    assert any(c["fsdp"] for c in cases)  # fsdpkit as one FSDP rank, beside the unsharded one


def test_each_round_is_paired_with_the_baseline_run_of_the_same_round():
    """The pooled ratio takes the median of all rounds' steps; the per-round ratios pair each run of
    a case with its baseline's run of the same round (what a noisy machine's spread is read from),
    also when a case failed in one round."""
    from benchmarks import train_throughput as tt

    def run(impl: str, k: int, step_s: float) -> dict:
        c = tt.case("compare", impl, "debug", 512, 16, 1, "fp32")
        return tt.timed({**c, "round": k, "peak_memory_bytes": 1}, [step_s])

    raw = [run("fsdpkit", 0, 1.0), run("baseline", 0, 1.5), run("fsdpkit", 1, 1.0), run("baseline", 1, 1.2)]
    merged = tt.merge_rounds(raw)
    tt.per_round_speedups(raw, merged)
    [ratio] = tt.ratios(merged)
    assert ratio["speedup_per_round"] == pytest.approx([1.5, 1.2])
    assert ratio["speedup"] == pytest.approx(1.35)  # median step of the pooled rounds: 1.0 against 1.35
    assert ratio["text"] == "1.35x (rounds 1.20-1.50x)"
    assert "round" not in merged[0]
    assert tt.ratios(tt.merge_rounds(raw[:2]))[0]["text"] == "1.50x"  # one round: no range to show
    # fsdpkit's round 0 failed: its round 1 is paired with the baseline's round 1, not its round 0.
    raw = [run("baseline", 0, 1.5), run("fsdpkit", 1, 1.0), run("baseline", 1, 1.2), run("fsdpkit", 2, 1.0),
           run("baseline", 2, 1.1)]
    merged = tt.merge_rounds(raw)
    tt.per_round_speedups(raw, merged)
    assert tt.ratios(merged)[0]["speedup_per_round"] == pytest.approx([1.2, 1.1])


# Loaded by every Python process of the session (through PYTHONPATH, which gpu_session.sh must
# keep): a name lookup of anything but this machine is recorded and refused, as on a lent GPU
# machine, where nothing outside can be reached.
NETWORK_OFF = '''
import os, socket
with open(os.environ["NET_LOG"] + ".processes", "a") as f:
    f.write(f"{os.getpid()}\\n")
_local = {None, "localhost", "127.0.0.1", "::1", "0.0.0.0", socket.gethostname()}
_getaddrinfo = socket.getaddrinfo


def getaddrinfo(host, *args, **kwargs):
    if isinstance(host, bytes):
        host = host.decode()
    if host not in _local:
        with open(os.environ["NET_LOG"], "a") as f:
            f.write(f"{host}\\n")
        raise socket.gaierror(socket.EAI_NONAME, f"network is off: {host}")
    return _getaddrinfo(host, *args, **kwargs)


socket.getaddrinfo = getaddrinfo
'''


def test_gpu_session_runs_its_case_list_with_the_network_off(tmp_path):
    """benchmarks/gpu_session.sh's benchmark section on the CPU, every case set up as its worker
    would (configuration, tokenizer, data, first batch, a peer's transformers config) with name
    lookups refused: no case reaches the hub, the caller's PYTHONPATH reaches every process, and
    the compiled transformers peer is in the list with both kinds of weights."""
    from benchmarks.train_throughput import gpu_plan

    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(NETWORK_OFF)
    log = tmp_path / "net.log"
    env = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")}
    env.update(PYTHONPATH=str(site), NET_LOG=str(log), SECTIONS="bench", BENCH_ARGS="--dry-run",
               OUT=str(tmp_path / "out"), PYTHON=sys.executable, HF_HOME=str(tmp_path / "hf"))
    r = subprocess.run(["bash", "benchmarks/gpu_session.sh"], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=600)
    bench = (tmp_path / "out" / "bench.log").read_text()
    assert f"{len(gpu_plan(1))} cases set up" in bench, r.stdout[-3000:] + r.stderr[-3000:]
    assert not log.exists(), f"hub reached: {log.read_text()}"
    assert len((tmp_path / "net.log.processes").read_text().split()) >= 2  # the version line's and the bench's
    for weights in ("fp32 weights\\+autocast", "bf16 weights"):
        for shape in ("2048 x 4", "8192 x 1"):
            assert re.search(rf"transformers\+compile {weights} +llama3_2_1b seq {shape}: set up", bench)


def test_bad_input_benchmark_smoke(tmp_path):
    """The alias bomb and an oversized spec are each refused in one line, and the JSON holds the
    seconds and peak memory of each refusal beside a small valid spec's."""
    out = tmp_path / "bad_input.json"
    r = subprocess.run([sys.executable, "-m", "benchmarks.bad_input", "--smoke", "--out", str(out)],
                       cwd=ROOT, capture_output=True, text=True, timeout=300)
    rows = {row["case"]: row for row in json.loads(out.read_text())["rows"]}
    assert set(rows) == {"alias bomb in affinity", "6 MB spec"}, r.stdout + r.stderr
    for row in rows.values():
        assert row["exit_code"] == 2 and row["stderr_lines"] == 1 and row["line"].startswith("error: job spec: ")
        assert row["seconds"] > 0 and row["peak_mib"] > 0 and row["baseline_peak_mib"] > 0
    assert "aliases expand to more than" in rows["alias bomb in affinity"]["line"]
    assert "fsdpkit reads YAML files of up to 4 MiB" in rows["6 MB spec"]["line"]


def test_mfu_counts_the_shape_the_case_trained():
    """A case's own `--n-layers` and `--sliding-window` are the run's shape, so they are its FLOPs: a
    Mixtral with 2 of its 32 layers does about a sixteenth of the full model's work per token."""
    from benchmarks.train_throughput import add_mfu, case
    from fsdpkit.train.config import parse_args
    from fsdpkit.train.model.flops import flops_per_token

    def flops(preset: str, seq: int, *flags: str) -> float:
        row = case("gpu", "fsdpkit", preset, seq, 2, 1, "bf16", flags)
        row.update(tokens_per_s=1000.0, device="cuda")
        add_mfu(row, 1e15)
        assert row["mfu"] == pytest.approx(row["flops_per_token"] * 1000.0 / 1e15)
        return row["flops_per_token"]

    two = flops("mixtral_8x7b", 2048, "--n-layers", "2")
    assert two == flops_per_token(parse_args(["--preset", "mixtral_8x7b", "--n-layers", "2"]).shape, 2048)
    assert two < flops("mixtral_8x7b", 2048) / 10
    assert flops("mathstral_7b", 8192, "--n-layers", "4", "--sliding-window", "4096") < \
        flops("mathstral_7b", 8192, "--n-layers", "4", "--sliding-window", "0")


def test_a_row_measured_without_its_partner_is_still_recorded(tmp_path, monkeypatch):
    """A lease that measures only the peer or the baseline (its fsdpkit row came from an earlier
    one) still lands in RESULTS.md, named with its implementation; a paired row is not repeated."""
    from benchmarks import common
    from benchmarks import train_throughput as tt

    monkeypatch.setattr(common, "RESULTS_MD", tmp_path / "RESULTS.md")

    def row(impl: str, label: str, step_s: float) -> dict:
        c = tt.case("gpu", impl, "mathstral_7b", 8192, 1, 1, "bf16") | {"label": label}
        return tt.timed({**c, "peak_memory_bytes": 2**30, "mfu": 0.25}, [step_s])

    env = {"date": "2026-11-27", "device": "NVIDIA H200", "torch": "2.11", "commit": "abc1234"}
    tt.write_results_md({"env": env, "peak_flops": 989e12, "rows": [row("baseline", "window 4096", 0.5)]})
    text = (tmp_path / "RESULTS.md").read_text()
    assert "| gpu | baseline: window 4096 | mathstral_7b | 8192 x 1 | 1 | bf16 | 16,384 | 500 | 25.0% | 1,024 |" in text
    (tmp_path / "RESULTS.md").unlink()
    tt.write_results_md({"env": env, "peak_flops": 989e12,
                         "rows": [row("fsdpkit", "window 4096", 0.25), row("baseline", "window 4096", 0.5)]})
    text = (tmp_path / "RESULTS.md").read_text()
    assert "| 2.00x |" in text and "baseline: window 4096" not in text


def test_mutation_scores_count_a_mutant_no_test_reaches_as_surviving():
    """`make mutation`'s score per module from mutmut's own `results --all true` lines (3.8.1's
    format: functions `x_NAME`, methods `xǁClassǁNAME`)."""
    from benchmarks import mutation

    results = ("    fsdpkit.jobs.resolved.x__trainer__mutmut_1: killed\n"
               "    fsdpkit.jobs.resolved.xǁSourceǁto_dict__mutmut_2: no tests\n"
               "    fsdpkit.jobs.resolved.x_resolve__mutmut_3: survived\n"
               "    fsdpkit.jobs.resolved.x_resolve__mutmut_4: timeout\n"
               "    fsdpkit.plan.grace.x_write_seconds__mutmut_1: killed\n")
    by_module = mutation.parse(results)
    assert by_module == {"fsdpkit.jobs.resolved": {"killed": 1, "no tests": 1, "survived": 1, "timeout": 1},
                         "fsdpkit.plan.grace": {"killed": 1}}
    assert mutation.score(by_module["fsdpkit.jobs.resolved"]) == 50.0
    assert mutation.survivors(results) == ["fsdpkit.jobs.resolved.xǁSourceǁto_dict__mutmut_2",
                                           "fsdpkit.jobs.resolved.x_resolve__mutmut_3"]
