"""A C kernel for decode-sized projections on CPU (native_linear.c), compiled on first use and loaded with ctypes.

Why: at batch 1 a decode step is ~120 products of one vector with a weight matrix, so its speed is the speed of
reading the fp32 weights (538 MB for SmolLM2-135M). Measured on the 2-core dev machine (torch 2.13, SmolLM2's
shapes, weights cold in cache; the projection table of `dspark bench runtime` reproduces it): oneDNN's pre-packed
product reads them at ~20-23 GB/s for one row, this kernel at ~30 GB/s — the machine's read bandwidth. For more
rows the crossover with oneDNN's blocking moves with the machine, so models/kernel_choice.py measures it.

`kernel_bf16()` is the same kernel over bf16 weights and activations (fp32 sums through AVX512-BF16's dot
products, or on AVX2 through fp32 multiply-adds of the widened values; each output rounded once to bf16), for a
bf16 target: its one-token forward got 1.13x faster (results/native-cost-s39); on an AVX2-only CPU, where torch
packs no bf16 weights, it made a bf16 target faster than fp32 (results/bf16-avx2-s53).

The kernel is built once per source, flags and CPU into the dspark cache with the system C compiler (`$CC`, else
`cc`). With no compiler, a failed build, a failed self-check, or `DSPARK_NATIVE=0`, `kernel()` is None and callers
keep the torch path — slower, never wrong. Each output row is summed in a fixed order, so a row's result does not
depend on how many rows share the call or on the thread count (tests/test_native_linear.py).
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

log = logging.getLogger("dspark")
SOURCE = Path(__file__).with_name("native_linear.c")
HEADER = Path(__file__).with_name("native_simd.h")  # included by every kernel source
# Rows up to which a projection uses this kernel before models/kernel_choice.py has measured this machine's
# crossover with oneDNN's packed product (and for projections it does not measure, e.g. a drafter's): with
# 2 x 6 tiles the kernel won at 1-16 rows in results/kernels-s20; its predecessor lost from 4 rows in a faster
# phase (results/runtime-s16), so the default stays below that.
DEFAULT_ROWS = 3
FLAG_SETS = (["-O3", "-march=native", "-fopenmp"], ["-O3", "-march=native"], ["-O3"])


def _cpu_signature() -> str:
    """-march=native code must not run on another CPU that shares the cache directory."""
    try:
        flags = next((ln for ln in open("/proc/cpuinfo") if ln.startswith(("flags", "Features"))), "")
    except OSError:
        flags = ""
    return platform.machine() + platform.processor() + flags


@functools.cache
def source_hash() -> str:
    """Which version of the projection kernel this is: its step prices and crossover are measured per version."""
    return code_hash(kernel_source(SOURCE))


def kernel_source(path: Path) -> bytes:
    """A kernel's code as it is compiled, the shared header included: what its library and its hashes key on."""
    return HEADER.read_bytes() + path.read_bytes()


_C_COMMENT = re.compile(rb"/\*.*?\*/|//[^\n]*", re.DOTALL)


def code_hash(source: bytes) -> str:
    """A C source's hash with its comments and layout left out: what keys the measurements made with a kernel
    (routes, speed profiles), so that editing a comment does not send every machine back to measuring them
    (a comment edit in session 39 did). The kernels hold no string literals, where this could strip code. The
    library itself is keyed by the whole source (``_build``)."""
    return hashlib.sha256(b" ".join(_C_COMMENT.sub(b" ", source).split())).hexdigest()


def _build(cache_dir: Path, source_path: Path = SOURCE, extra_flags: tuple[str, ...] = ()) -> Path | None:
    cc = shutil.which(os.environ.get("CC", "cc"))
    if cc is None:
        log.info("no C compiler found; using torch's kernels instead of %s", source_path.name)
        return None
    source = kernel_source(source_path)
    errors = []
    for flags in ([*f, *extra_flags] for f in FLAG_SETS):
        key = hashlib.sha256(source + " ".join([cc, *flags, _cpu_signature()]).encode()).hexdigest()[:16]
        out = cache_dir / f"{source_path.stem}-{key}.so"
        if out.exists():
            return out
        cache_dir.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=cache_dir)
        os.close(fd)
        # -I: a source compared from elsewhere (an earlier version from git) finds the shared header too
        cmd = [cc, *flags, "-shared", "-fPIC", "-I", str(HEADER.parent), "-o", tmp, str(source_path), "-lm"]
        try:
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
        except (OSError, subprocess.TimeoutExpired) as exc:
            done = subprocess.CompletedProcess(cmd, 1, "", str(exc))
        if done.returncode == 0:
            os.replace(tmp, out)  # atomic: a concurrent or interrupted build never leaves a partial library
            return out
        os.unlink(tmp)
        errors.append(f"{' '.join(flags)}: {done.stderr.strip()[-300:]}")
    log.warning("could not build %s; using torch's kernels:\n%s", source_path.name, "\n".join(errors))
    return None


def _self_check(fn, dtype: torch.dtype = torch.float32) -> bool:
    """Guard against a miscompiled or ABI-mismatched library: compare with fp64 on awkward shapes (bf16: inputs
    rounded to bf16 first, the output within a bf16 rounding plus the fp32 sums' error)."""
    g = torch.Generator().manual_seed(0)
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=1e-2, atol=1e-2)
    for m, n, k in ((1, 7, 13), (3, 9, 40), (5, 4, 8), (4, 30, 19), (2, 26, 48)):  # blocks, tiles, leftovers
        x, w, b = (torch.randn(*s, generator=g).to(dtype) for s in ((m, k), (n, k), (n,)))
        y = torch.empty(m, n, dtype=dtype)
        fn(x.data_ptr(), m, w.data_ptr(), b.data_ptr(), n, k, y.data_ptr(), 1)
        if not torch.allclose(y.double(), x.double() @ w.double().T + b.double(), **tol):
            return False
    return True


def load_library(source: Path, cache_dir: str | None = None, extra_flags: tuple[str, ...] = ()):
    """The library built from `source` into the dspark cache (with `extra_flags` after each flag set), or None (no
    compiler, failed build or load, or `DSPARK_NATIVE=0`)."""
    if os.environ.get("DSPARK_NATIVE", "1") == "0":
        return None
    from .loader import cache_root

    path = _build(Path(cache_dir) if cache_dir else cache_root() / "native", source, extra_flags)
    if path is None:
        return None
    try:
        return ctypes.CDLL(str(path))
    except OSError as exc:
        log.warning("could not load %s (%s); using torch's kernels", path, exc)
        return None


def load_function(source: Path, symbol: str, cache_dir: str | None = None, extra_flags: tuple[str, ...] = ()):
    """`symbol` from `load_library(source, ...)`, or None. The caller sets the signature and runs its own
    self-check."""
    lib = load_library(source, cache_dir, extra_flags)
    try:
        return None if lib is None else getattr(lib, symbol)
    except AttributeError as exc:
        log.warning("%s has no %s (%s); using torch's kernels", source.name, symbol, exc)
        return None


_ARGTYPES = [ctypes.c_void_p, ctypes.c_long, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_long, ctypes.c_long,
             ctypes.c_void_p, ctypes.c_int]
CFLAGS = ("-ffp-contract=off",)  # the source places every fused multiply-add itself (see its header)


@functools.cache
def kernel(cache_dir: str | None = None):
    """The loaded C function, or None where it cannot be used (see the module docstring). Cached per process."""
    fn = load_function(SOURCE, "dspark_linear", cache_dir, extra_flags=CFLAGS)
    if fn is None:
        return None
    fn.argtypes, fn.restype = _ARGTYPES, None
    if not _self_check(fn):
        log.warning("the native projection kernel failed its self-check; using torch's kernels")
        return None
    return fn


@functools.cache
def kernel_bf16(cache_dir: str | None = None):
    """The bf16 entry of the same library (bf16 x, W, bias and y; fp32 sums of the exact products), or None where
    the CPU has neither AVX512-BF16 nor AVX2 or the fp32 kernel is unusable. Cached per process."""
    lib = load_library(SOURCE, cache_dir, extra_flags=CFLAGS) if kernel(cache_dir) is not None else None
    if lib is None or not lib.dspark_linear_bf16_supported():
        return None
    fn = lib.dspark_linear_bf16
    fn.argtypes, fn.restype = _ARGTYPES, None
    if not _self_check(fn, torch.bfloat16):
        log.warning("the native bf16 projection kernel failed its self-check; using torch's kernels")
        return None
    return fn


def _kernel_for(dtype: torch.dtype):
    return kernel() if dtype == torch.float32 else kernel_bf16() if dtype == torch.bfloat16 else None


def usable(weight: torch.Tensor) -> bool:
    return weight.device.type == "cpu" and weight.is_contiguous() and not weight.requires_grad \
        and _kernel_for(weight.dtype) is not None


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] · weight [N, K]ᵀ (+ bias [N]) -> [M, N] on CPU, all of the weight's dtype (fp32 or bf16; a bias
    contiguous); the caller checked `usable(weight)`. No conversions here: ~1 µs a call, 121 calls a SmolLM2 step."""
    x = x.contiguous()
    y = torch.empty(x.shape[0], weight.shape[0], dtype=weight.dtype)
    _kernel_for(weight.dtype)(x.data_ptr(), x.shape[0], weight.data_ptr(), None if bias is None else bias.data_ptr(),
                              weight.shape[0], weight.shape[1], y.data_ptr(), torch.get_num_threads())
    return y
