"""The trainer's performance switches compute what the plain path computes, and save what they claim."""

from __future__ import annotations

import mmap

import pytest
import torch
import torch.nn.functional as F

from fsdpkit.errors import UserError
from fsdpkit.train.config import parse_args
from fsdpkit.train.model.attention import causal_attention
from fsdpkit.train.model.transformer import chunked_cross_entropy, loss_chunk_size
from fsdpkit.train.observe.metrics import peak_memory_bytes, reset_peak_memory
from fsdpkit.train.optim import build_optimizer


@pytest.mark.parametrize("seq,kv_heads", [(200, 4), (512, 2), (700, 1)])
def test_grouped_causal_attention_equals_the_explicit_softmax_with_gradients(seq, kv_heads):
    """Each K/V head serves its group of query heads; compared with the textbook formula in fp64."""
    torch.manual_seed(0)
    q = torch.randn(2, 4, seq, 16, requires_grad=True)
    k, v = (torch.randn(2, kv_heads, seq, 16, requires_grad=True) for _ in range(2))
    grad = torch.randn(2, 4, seq, 16)
    out = causal_attention(q, k, v)
    ek, ev = (t.double().repeat_interleave(4 // kv_heads, dim=1) for t in (k, v))
    scores = (q.double() @ ek.transpose(-1, -2)) / 16 ** 0.5
    scores = scores.masked_fill(torch.ones(seq, seq, dtype=torch.bool).triu(1), float("-inf"))
    ref = scores.softmax(-1) @ ev
    torch.testing.assert_close(out.double(), ref, atol=2e-6, rtol=1e-5)
    for ours, theirs in zip(torch.autograd.grad(out, (q, k, v), grad),
                            torch.autograd.grad(ref, (q, k, v), grad.double()), strict=True):
        torch.testing.assert_close(ours.double(), theirs.double(), atol=1e-5, rtol=1e-5)


def _head_and_data(vocab: int, n: int = 96, dim: int = 32):
    torch.manual_seed(0)
    head = torch.nn.Linear(dim, vocab, bias=False)
    h = torch.randn(n, dim, requires_grad=True)
    targets = torch.randint(0, vocab, (n,))
    targets[::7] = -100  # ignored positions count in neither numerator nor denominator
    return head, h, targets


def test_chunked_cross_entropy_equals_the_full_one():
    head, h, targets = _head_and_data(50)
    full = chunked_cross_entropy(head, h, targets, 0)
    ref = F.cross_entropy(head(h).float(), targets, ignore_index=-100)
    torch.testing.assert_close(full, ref)
    g_full = torch.autograd.grad(full, (h, head.weight))
    chunked = chunked_cross_entropy(head, h, targets, 13)  # chunks that do not divide the tokens
    torch.testing.assert_close(chunked, ref)
    for a, b in zip(torch.autograd.grad(chunked, (h, head.weight)), g_full, strict=True):
        torch.testing.assert_close(a, b)


def test_chunked_cross_entropy_never_keeps_the_full_logits():
    """What autograd saves for backward: with chunks, one chunk's inputs; without, all fp32 logits."""
    head, h, targets = _head_and_data(4096, n=512)

    def saved_bytes(chunk: int) -> int:
        total = 0

        def pack(t: torch.Tensor) -> torch.Tensor:
            nonlocal total
            total += t.numel() * t.element_size()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            chunked_cross_entropy(head, h, targets, chunk)
        return total

    logits = 512 * 4096 * 4
    assert saved_bytes(0) >= logits
    assert saved_bytes(64) < logits / 4


def test_default_loss_chunk_bounds_the_logits_of_a_chunk():
    assert loss_chunk_size(128256, None) * 128256 * 4 <= 2**28
    assert loss_chunk_size(258, None) > 100_000  # a byte vocabulary is never chunked in practice
    assert loss_chunk_size(32000, 0) == 0
    # Compiled, the loss is one fused kernel over unchunked logits unless a size is asked for.
    assert loss_chunk_size(128256, None, compiled=True) == 0
    assert loss_chunk_size(128256, 512, compiled=True) == 512


def test_planner_counts_the_compiled_unchunked_loss_in_the_compute_dtype():
    from fsdpkit.plan.memory import loss_bytes
    from fsdpkit.plan.workload import workload

    def kept(*flags):
        cfg = parse_args(["--preset", "llama3_2_1b", "--device", "cuda", "--seq_len", "2048",
                          "--train_batch_size", "4", *flags])
        return loss_bytes(workload(cfg, 1, "cuda"))[0]

    logits = 2048 * 4 * 128256
    assert kept("--compile", "1") == 2 * logits                         # bf16 logits, kept for backward
    # Eager: only log-softmax's fp32 output is saved for backward; the bf16 logits and their fp32
    # copy are freed in forward (measured: tests/plan/test_plan.py, tensor peaks at an 8192 vocabulary).
    assert kept("--compile", "0", "--loss_chunk_tokens", "0") == 4 * logits
    assert kept("--compile", "0") == 0                                  # chunks, recomputed in backward


def test_fused_and_foreach_adamw_take_the_same_step():
    torch.manual_seed(0)
    init = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2)).state_dict()
    results = []
    for fused in ("1", "0"):
        model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2))
        model.load_state_dict(init)
        opt = build_optimizer(model, parse_args(["--fused_optimizer", fused]).optim)
        for _ in range(3):
            model(torch.ones(4, 8)).square().sum().backward()
            opt.step()
            opt.zero_grad()
        results.append([p.detach() for p in model.parameters()])
    for a, b in zip(*results, strict=True):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)


@pytest.mark.skipif(not __import__("pathlib").Path("/proc/self/clear_refs").exists(), reason="Linux only")
def test_peak_memory_window_is_reset():
    cpu = torch.device("cpu")
    reset_peak_memory(cpu)
    before = peak_memory_bytes(cpu)
    # Fresh anonymous pages, touched one by one: a tensor could reuse memory the allocator already
    # holds resident (an earlier test in this process may have kept freed memory mapped).
    size = 200 << 20
    block = mmap.mmap(-1, size)
    for offset in range(0, size, mmap.PAGESIZE):
        block[offset] = 1
    assert peak_memory_bytes(cpu) - before > 150e6
    block.close()
    reset_peak_memory(cpu)
    assert peak_memory_bytes(cpu) - before < 100e6


# One step's activations: blocks of 1-30 MiB (under glibc's 32 MiB mmap ceiling), ~370 MiB in all,
# allocated and touched (a forward), then all freed (a backward); minor faults counted per step.
_STEPS = """
import resource, sys, torch
from fsdpkit.train.runtime.host_memory import keep_freed_memory
if sys.argv[1] == "1":
    assert keep_freed_memory()
sizes = [(1 + (7 * i) % 30) << 18 for i in range(24)]  # float32 elements: 1..30 MiB each
faults = []
for step in range(8):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    held = [torch.ones(n) for n in sizes]
    del held
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(faults)
"""


@pytest.mark.skipif(not __import__("sys").platform.startswith("linux"), reason="glibc only")
def test_keeping_freed_host_memory_removes_the_page_faults_of_each_step():
    """With freed memory kept, a step that frees and re-allocates its activations maps in no new
    memory after the first steps. With glibc's defaults the second step faults its activations in
    again (the mmap threshold starts at 128 KiB); what follows varies from run to run (glibc's
    adaptive threshold sometimes settles, sometimes trims every step: seen 0, 70k and 87k faults per
    step), so only that second step is compared. The trainer reports the same count per step
    (host_page_faults_per_step)."""
    import ast
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}  # glibc's own knobs off

    def faults(keep: str) -> list[int]:
        r = subprocess.run([sys.executable, "-c", _STEPS, keep], env=env, check=True, capture_output=True, text=True)
        return ast.literal_eval(r.stdout.strip().splitlines()[-1])

    kept, default = faults("1"), faults("0")
    pages = 370 * 2**20 // 4096  # one step's activations, in 4 KiB pages
    assert default[1] > pages // 2, default
    assert kept[1] < default[1] / 10, (kept, default)
    # The heap's layout takes a few steps to settle as small allocations land between the big ones, and
    # on some machines a 12 MiB block keeps being mapped in every other step (CI: [93716, 2816, 3072,
    # 3072, 0, 3072, ...]); with glibc's defaults it is the whole step. So: all later steps together
    # map in less than a quarter of one step's activations, and no single one more than a tenth.
    assert sum(kept[1:]) < pages // 4, kept  # seen: 4,000-15,000 of 94,720
    assert max(kept[1:]) < pages // 10, kept  # seen: at most 7,168


def test_float8_on_the_cpu_is_refused_up_front():
    with pytest.raises(UserError, match="float8"):
        parse_args(["--float8", "1", "--device", "cpu"])


def test_glibc_settings_from_the_environment_are_left_alone(monkeypatch):
    from fsdpkit.train.runtime.host_memory import keep_freed_memory

    monkeypatch.setenv("MALLOC_TRIM_THRESHOLD_", "131072")
    assert keep_freed_memory() is False


def test_validation_runs_in_slices_of_the_training_batch_with_the_same_loss():
    """A validation batch larger than the training micro-batch is cut into slices of it, so
    validation never needs more memory than a training step, and the loss does not change."""
    from fsdpkit.train.model.transformer import Transformer
    from fsdpkit.train.objective import NextToken
    from fsdpkit.train.runtime import dist
    from fsdpkit.train.validation import Validator

    rt = dist.setup("cpu")
    losses, seen = {}, {}
    for rows in (4, 3):
        cfg = parse_args(["--preset", "tiny", "--seq_len", "32", "--val_batch_size", "4", "--train_batch_size",
                          str(rows), "--validation_batches", "2"])
        model = Transformer(cfg.shape, rope_len=32)
        model.init_weights(seed=0)
        seen[rows] = []
        model.register_forward_pre_hook(lambda _m, args, rows=rows: seen[rows].append(args[0].shape[0]))
        losses[rows] = Validator(cfg.data, cfg.log.validation_batches, cfg.seed, cfg.parallel, rt, NextToken())(model)
    assert seen == {4: [4, 4], 3: [3, 1, 3, 1]}
    assert losses[3] == pytest.approx(losses[4], rel=1e-6)
