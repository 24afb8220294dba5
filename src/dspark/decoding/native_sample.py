"""The two-level inverse-CDF draw in one C call (native_sample.c); ``sampling.sample_from`` uses it for fp32 rows
on CPU whose vocabulary it splits into blocks.

Why: torch's fp64 block masses widen every probability first — 286 µs of a 431 µs draw for 16 rows of 49,152
tokens, against ~50 µs here (`scripts/sample_cost.py`). A plain step at C = 16 spent ~0.8 % of its time there.

The kernel sums each block in another (fixed) order than torch, so a mass can differ in its last fp64 bits; a
token differs only where a uniform lands within such a rounding of a block's edge (~1e-16 of the mass). The tests
check it draws the tokens of the full fp64 CDF search and of the torch path on awkward rows, never a token of
zero mass, and the same token for a row whatever else shares the call. As models/native.py: no compiler, a failed
build or self-check, or ``DSPARK_NATIVE=0`` leave the torch path — slower, never wrong.
"""
from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch

from ..models import native

SOURCE = Path(__file__).with_name("native_sample.c")
BLOCK = 256  # native_sample.c's BLOCK, sampling.CDF_BLOCK


@functools.cache
def kernel(cache_dir: str | None = None):
    """The C function, or None where it cannot be used. Cached per process."""
    fn = native.load_function(SOURCE, "dspark_sample_blocks", cache_dir)
    if fn is None:
        return None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_long, ctypes.c_long, ctypes.c_long, ctypes.c_void_p, ctypes.c_void_p,
                   ctypes.c_int]
    fn.restype = None
    return fn if _self_check(fn) else None


def _self_check(fn) -> bool:
    """Guard against a miscompiled library: the tokens of a full fp64 CDF search on a few rows."""
    g = torch.Generator().manual_seed(0)
    probs = torch.softmax(torch.randn(5, 8 * BLOCK, generator=g) * 3, -1)
    probs[4] = 0.0
    probs[4, 3 * BLOCK - 1] = 1.0  # all the mass on a block's last token
    u = torch.rand(5, generator=g, dtype=torch.float64)
    cdf = probs.double().cumsum(-1)
    want = torch.searchsorted(cdf, (u * cdf[:, -1]).unsqueeze(-1), right=True).squeeze(-1)
    return torch.equal(_call(fn, probs, u), want)


def _call(fn, probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    rows, vocab = probs.shape
    u = uniforms.to(torch.float64).contiguous()
    tokens = torch.empty(rows, dtype=torch.int64)
    fn(probs.data_ptr(), rows, vocab, probs.stride(0), u.data_ptr(), tokens.data_ptr(), torch.get_num_threads())
    return tokens


def usable(probs: torch.Tensor) -> bool:
    """fp32 rows on CPU, each contiguous (rows may sit apart: the drafter's slot k of its [R, γ, V] buffer), whole
    blocks, no autograd, and a kernel that built."""
    return (probs.dim() == 2 and probs.dtype == torch.float32 and probs.device.type == "cpu"
            and probs.stride(1) == 1 and probs.stride(0) >= probs.shape[1] and probs.shape[1] % BLOCK == 0
            and not probs.requires_grad and kernel() is not None)


def sample_blocks(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """probs [R, V] (the caller checked ``usable``), uniforms [R] in [0, 1) -> tokens [R] int64."""
    return _call(kernel(), probs, uniforms)


def sample_next(probs: torch.Tensor, p_off: torch.Tensor, q: torch.Tensor | None, q_off: torch.Tensor,
                point: torch.Tensor, uniforms: torch.Tensor, qmap: torch.Tensor | None = None) -> torch.Tensor | None:
    """The token after each verified block (native_sample.c's dspark_sample_next; verify.draw_next's fast path), or
    None where the kernel cannot serve: probs / q fp32 CPU tensors whose last dimension is contiguous, rows found at
    the element offsets p_off / q_off [R] (q_off −1: no draft row), point [R] a point-mass draft token or −1; qmap
    [Vq] int64 (distinct ids): q's rows cover only these target tokens (a draft vocabulary), q = 0 elsewhere."""
    fn = next_kernel()
    vocab = probs.shape[-1]
    if fn is None or vocab % BLOCK or not all(t is None or (t.dtype == torch.float32 and t.device.type == "cpu"
                                                             and t.stride(-1) == 1 and not t.requires_grad)
                                              for t in (probs, q)):
        return None
    if qmap is not None and (q is None or qmap.dtype != torch.int64 or qmap.device.type != "cpu"
                             or qmap.shape != (q.shape[-1],) or not qmap.is_contiguous()):
        return None
    p_off, q_off, point = (o.to(torch.int64).contiguous() for o in (p_off, q_off, point))  # alive through the call
    u = uniforms.to(torch.float64).contiguous()
    tokens = torch.empty(len(u), dtype=torch.int64)
    fn(probs.data_ptr(), p_off.data_ptr(), None if q is None else q.data_ptr(), q_off.data_ptr(), point.data_ptr(),
       len(u), vocab, u.data_ptr(), tokens.data_ptr(), torch.get_num_threads(),
       None if qmap is None else qmap.data_ptr(), 0 if qmap is None else qmap.shape[0])
    if bool((tokens < 0).any()):
        raise MemoryError("native_sample: no memory for a residual row")
    return tokens


@functools.cache
def next_kernel(cache_dir: str | None = None):
    """dspark_sample_next, or None where the library did not build or its two-level draw failed its self-check."""
    if kernel(cache_dir) is None:
        return None
    fn = native.load_function(SOURCE, "dspark_sample_next", cache_dir)
    if fn is None:
        return None
    fn.argtypes = [ctypes.c_void_p] * 5 + [ctypes.c_long, ctypes.c_long, ctypes.c_void_p, ctypes.c_void_p,
                                           ctypes.c_int, ctypes.c_void_p, ctypes.c_long]
    fn.restype = None
    return fn if _next_self_check(fn) else None


def _next_self_check(fn) -> bool:
    """Rows 0-2 rejected (a draft distribution, a point mass, and q = p: no residual mass), row 3 the bonus: the
    tokens the two-level draw picks from torch's residual rows."""
    g = torch.Generator().manual_seed(1)
    p = torch.softmax(torch.randn(4, 16 * BLOCK, generator=g) * 3, -1)
    q = torch.softmax(torch.randn(4, 16 * BLOCK, generator=g) * 3, -1)
    q[2] = p[2]
    point = torch.tensor([-1, int(p[1].argmax()), -1, -1])
    u = torch.rand(4, generator=g, dtype=torch.float64)
    residual = (p - q).clamp(min=0)
    residual[1] = p[1]
    residual[1, point[1]] = (p[1, point[1]] - 1).clamp(min=0)
    want = _call(kernel(), torch.stack([residual[0], residual[1], p[2], p[3]]), u)
    p_off = torch.arange(4) * p.shape[1]
    q_off = torch.where(torch.tensor([True, False, True, False]), p_off, -1)
    tokens = torch.empty(4, dtype=torch.int64)
    fn(p.data_ptr(), p_off.data_ptr(), q.data_ptr(), q_off.data_ptr(), point.data_ptr(), 4, p.shape[1], u.data_ptr(),
       tokens.data_ptr(), 1, None, 0)
    if not torch.equal(tokens, want):
        return False
    # row 0 again, its draft row held in a draft vocabulary (every other token): the same residual, the same token
    qmap = torch.arange(0, p.shape[1], 2)
    compact = q[0, qmap].contiguous()
    full = torch.zeros_like(q[0])
    full[qmap] = compact
    want = _call(kernel(), (p[0] - full).clamp(min=0)[None], u[:1])
    one, at = torch.zeros(1, dtype=torch.int64), torch.zeros(1, dtype=torch.int64)  # alive through the call
    fn(p.data_ptr(), p_off.data_ptr(), compact.data_ptr(), at.data_ptr(), point.data_ptr(), 1, p.shape[1],
       u.data_ptr(), one.data_ptr(), 1, qmap.data_ptr(), qmap.shape[0])
    return torch.equal(one, want)


# ---------------------------------------------------------------------------------------------------------------
# The greedy draw: torch.argmax over the last dimension, in one C call (native_sample.c's dspark_argmax_rows).

@functools.cache
def argmax_kernel(cache_dir: str | None = None):
    """The C argmax, or None where it cannot be used (no compiler, a failed self-check). Cached per process."""
    fn = native.load_function(SOURCE, "dspark_argmax_rows", cache_dir)
    if fn is None:
        return None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_long, ctypes.c_long, ctypes.c_void_p, ctypes.c_int]
    fn.restype = None
    return fn if _argmax_self_check(fn) else None


def _argmax_self_check(fn) -> bool:
    """torch.argmax's tokens on rows with exact ties, a NaN, all -inf, +-0 and a tail past the lanes."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(6, 1003, generator=g)
    x[1, 7] = x[1, 900] = 50.0  # a tie: the first
    x[2, 500] = float("nan")
    x[3] = float("-inf")
    x[4] = 0.0
    x[4, 9] = -0.0
    x[5, 1002] = 60.0  # the maximum in the tail past the last whole 8 lanes
    return torch.equal(_argmax_call(fn, x), x.argmax(-1))


def _argmax_call(fn, x: torch.Tensor) -> torch.Tensor:
    out = torch.empty(x.shape[0], dtype=torch.int64)
    fn(x.data_ptr(), x.shape[0], x.shape[1], out.data_ptr(), torch.get_num_threads())
    return out


ARGMAX_MIN_VOCAB = 1024  # below, the C call's fixed cost (~8 µs) outweighs what it saves


def argmax(x: torch.Tensor) -> torch.Tensor:
    """x [..., V] -> [...] int64: the first index of each row's maximum (a NaN counts as the maximum), as
    ``x.argmax(-1)``; through the C kernel for fp32 CPU rows of at least ARGMAX_MIN_VOCAB, else torch's. Measured
    on session 46's Intel Xeon (2 threads): 8 rows of 49,152 logits 270 -> 61 µs, one row 68 -> 17 µs
    (scripts/greedy_draw_cost.py)."""
    fn = argmax_kernel() if (x.dtype == torch.float32 and x.device.type == "cpu" and x.dim() >= 1 and x.numel()
                             and x.shape[-1] >= ARGMAX_MIN_VOCAB and not x.requires_grad) else None
    if fn is None:
        return x.argmax(-1)
    rows = x.reshape(-1, x.shape[-1])  # a view where the rows are already contiguous, else one copy
    return _argmax_call(fn, rows.contiguous()).view(x.shape[:-1])
