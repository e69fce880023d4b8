"""fsdpkit's own CPU causal-attention kernel (kernels/causal_attention.cpp), built at first use.

Built with the system's C++ compiler for this machine's vector width (-march=native) into a small
shared library with no PyTorch headers, so a build takes seconds, and called through ctypes, which
lets go of the GIL for the call. The library is cached under ~/.cache/fsdpkit/kernels (or
$FSDPKIT_KERNEL_CACHE) by a hash of the source, the compiler and this CPU's flags: a home directory
shared between different machines never hands one a library built for another's instructions.
Each rank builds into its own temporary file and renames it into place, so ranks starting together
never see a half-written library. Where no compiler is found or the build fails, `library()` is
None and the caller keeps PyTorch's kernels (one warning says why).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from importlib import resources
from pathlib import Path

import torch
from torch import Tensor

log = logging.getLogger(__name__)

SOURCE = "causal_attention.cpp"
HEAD_DIMS = (32, 64, 128)  # the kernel's compiled head sizes; others fall back
FLAGS = ("-O3", "-march=native", "-std=c++17", "-shared", "-fPIC", "-pthread")


def _cache_dir() -> Path:
    return Path(os.environ.get("FSDPKIT_KERNEL_CACHE") or Path.home() / ".cache" / "fsdpkit" / "kernels")


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return platform.processor()


def _compiler() -> str | None:
    return os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++") or shutil.which("clang++")


def build(cache: Path | None = None) -> Path:
    """The compiled library's path, building it if this source, compiler and CPU have none yet.
    Raises RuntimeError (with the compiler's message) when it cannot be built."""
    cxx = _compiler()
    if cxx is None:
        raise RuntimeError("no C++ compiler found (set CXX, or install g++)")
    source = resources.files("fsdpkit.train.kernels").joinpath(SOURCE).read_bytes()
    version = subprocess.run([cxx, "--version"], capture_output=True, text=True).stdout
    key = hashlib.sha256(b"\0".join(x.encode() if isinstance(x, str) else x for x in
                                    (source, cxx, version, " ".join(FLAGS), _cpu_flags()))).hexdigest()[:16]
    cache = cache or _cache_dir()
    lib = cache / f"causal_attention-{key}.so"
    if lib.exists():
        return lib
    cache.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache) as tmp:
        src, out = Path(tmp) / SOURCE, Path(tmp) / lib.name
        src.write_bytes(source)
        r = subprocess.run([cxx, *FLAGS, str(src), "-o", str(out)], capture_output=True, text=True)
        if r.returncode != 0:
            raise RuntimeError(f"{cxx} failed: {r.stderr.strip()[-2000:]}")
        os.replace(out, lib)  # atomic: another rank either sees the whole library or none
    return lib


@functools.cache
def library() -> ctypes.CDLL | None:
    """The loaded kernel, or None (with one warning) where it cannot be built here."""
    try:
        lib = ctypes.CDLL(str(build()))
    except (RuntimeError, OSError) as e:
        log.warning("fsdpkit's CPU attention kernel is unavailable, using PyTorch's: %s", str(e).splitlines()[0])
        return None
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    lib.fsdpkit_attention_forward.argtypes = [ptr] * 6 + [i64] * 5 + [ctypes.c_float, ctypes.c_int]
    lib.fsdpkit_attention_backward.argtypes = [ptr] * 10 + [i64] * 5 + [ctypes.c_float, ctypes.c_int]
    lib.fsdpkit_attention_forward.restype = lib.fsdpkit_attention_backward.restype = ctypes.c_int
    return lib


def supports(q: Tensor) -> bool:
    return q.device.type == "cpu" and q.shape[-1] in HEAD_DIMS and library() is not None


def _dims(q: Tensor, k: Tensor) -> tuple[int, ...]:
    b, h, t, d = q.shape
    return b, h, k.shape[1], t, d


def _ready(t: Tensor) -> Tensor:
    """fp32 with the last dimension contiguous: the kernel reads any other strides as they are."""
    t = t.float()
    return t if t.stride(-1) == 1 else t.contiguous()


def _strides(*tensors: Tensor) -> ctypes.Array:
    flat = [s for t in tensors for s in t.stride()[:3]]
    return (ctypes.c_int64 * len(flat))(*flat)


def _check(rc: int, q: Tensor, k: Tensor) -> None:
    if rc:
        raise ValueError(f"the CPU attention kernel cannot take q {tuple(q.shape)} with k, v {tuple(k.shape)} "
                         f"(head sizes {HEAD_DIMS}; K/V heads must divide the query heads)")


def forward(q: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
    """fp32 output (contiguous) and log-sum-exp per query for q (B, H, T, D), k, v (B, H_kv, T, D)."""
    q, k, v = (_ready(t) for t in (q, k, v))
    out, lse = q.new_empty(q.shape), q.new_empty(q.shape[:3])
    _check(library().fsdpkit_attention_forward(q.data_ptr(), k.data_ptr(), v.data_ptr(), _strides(q, k, v),
                                               out.data_ptr(), lse.data_ptr(), *_dims(q, k), q.shape[-1] ** -0.5,
                                               torch.get_num_threads()), q, k)
    return out, lse


def backward(grad: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """fp32 gradients (contiguous) of q, k, v, from the forward's output and log-sum-exp."""
    grad, q, k, v, out = (_ready(t) for t in (grad, q, k, v, out))
    lse = lse.float().contiguous()
    dq, dk, dv = q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)
    _check(library().fsdpkit_attention_backward(
        grad.data_ptr(), q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(), _strides(grad, q, k, v, out),
        lse.data_ptr(), dq.data_ptr(), dk.data_ptr(), dv.data_ptr(), *_dims(q, k), q.shape[-1] ** -0.5,
        torch.get_num_threads()), q, k)
    return dq, dk, dv
