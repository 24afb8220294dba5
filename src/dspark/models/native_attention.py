"""Ragged attention for decode and verification segments in one C call per layer (native_attention.c).

Why: the torch path (transformer.Transformer._segment_attention, kept as the reference) runs one
scaled_dot_product_attention per request per layer, plus two cache writes and a copy; at 16 one-token requests
that loop cost more than the attention itself (`scripts/segment_cost.py` prints both paths side by side). The
kernel writes each request's new keys and values into its own cache and attends over them, one task per
(request, KV head), so the per-request KV layout (and its O(1) rollback) is unchanged.

Used for segments of at most `max_queries(dtype)` tokens on fp32 or bf16 CPU caches (bf16 computed in fp32, each
output rounded to bf16); longer segments (prefill chunks) keep torch's flash kernel, which is faster there. Like
models/native.py: no compiler, a failed build or self-check, or `DSPARK_NATIVE=0` leave the torch path — slower,
never wrong.
"""
from __future__ import annotations

import ctypes
import functools
import logging
from pathlib import Path
from typing import Sequence

import torch

from . import native

log = logging.getLogger("dspark")
SOURCE = Path(__file__).with_name("native_attention.c")
MAX_QUERIES = 32  # beyond this a segment is a prefill chunk: torch's blocked flash kernel wins there
# torch's bf16 flash kernel multiplies in bf16 and overtakes this one at fewer queries. SmolLM2 steps, torch vs
# this kernel: one request of 8 tokens 24.6 vs 24.6 ms, of 12 tokens 28.1 vs 30.0 ms, of 16 tokens 31.1 vs 35.0 ms;
# 16 requests of 1 token 65.5 vs 42.3 ms (`scripts/segment_cost.py --dtype bfloat16 --kernel-limit 32`,
# results/segment-cost-s35). Verification blocks of the default depth 7 are 8 tokens. On the Intel Xeon, after
# session 47's kernel changes, this kernel is ahead up to 16 queries (1 x 12: 26.0 vs 25.1 ms, 1 x 16: 27.9 vs 26.4;
# results/segment-cost-s47/bfloat16-limit32.txt); the limit stays until the EPYC's crossover is measured again.
MAX_QUERIES_BF16 = 8

_L, _P = ctypes.c_long, ctypes.c_void_p
_ARGTYPES = [_P, _L, _P, _L, _P, _L, _P, _L, _P, _L, _L, _L, _L, _L, _L, ctypes.c_float, ctypes.c_float, ctypes.c_int,
             ctypes.c_int]
DTYPES = (torch.float32, torch.bfloat16)
CFLAGS = ("-ffp-contract=off",)


def source_hash() -> str:
    """Which version of the kernel this is: a speed profile measured with another one is stale (comments and
    layout aside: ``native.code_hash``)."""
    return native.code_hash(native.kernel_source(SOURCE))


def segment_table(caches: Sequence, rows: Sequence[int], starts: Sequence[int], lengths: Sequence[int]) -> torch.Tensor:
    """The per-forward description of the kernel's segments: int64 [7, n] (see dspark_ragged_attention). Built once
    per forward, after the caches reserved their positions (a reallocation moves their buffers)."""
    return torch.tensor([list(rows), list(starts), list(lengths), [c.k.data_ptr() for c in caches],
                         [c.v.data_ptr() for c in caches], [c.capacity for c in caches], [0] * len(caches)],
                        dtype=torch.int64)


def attend(fn, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, table: torch.Tensor,
           layer: int, window: int | None, scale: float, softcap: float | None) -> None:
    """q [N, H, hd], k/v [N, kvH, hd] (row-strided views are fine, heads contiguous) -> out [N, H, hd] rows of the
    table's segments; their new keys/values are written into the caches first. All of them and the table's caches
    share one dtype of DTYPES."""
    for t in (q, k, v, out):
        if t.dtype not in DTYPES or t.dtype != q.dtype or t.stride(-1) != 1 or t.stride(-2) != t.shape[-1]:
            raise ValueError("the native attention kernel needs fp32 or bf16 tensors of one dtype with contiguous "
                             "heads")
    n_seg = table.shape[1]
    failed = fn(q.data_ptr(), q.stride(0), k.data_ptr(), k.stride(0), v.data_ptr(), v.stride(0), out.data_ptr(),
                out.stride(0), table.data_ptr(), n_seg, layer, q.shape[1], k.shape[1], q.shape[2], window or 0,
                scale, softcap or 0.0, torch.get_num_threads(), int(q.dtype == torch.bfloat16))
    if failed:
        raise MemoryError(f"native attention: {failed} of {n_seg * k.shape[1]} tasks could not allocate scratch")


def reference(q, k_cache, v_cache, start: int, length: int, window: int | None, scale: float,
              softcap: float | None) -> torch.Tensor:
    """Plain torch attention of one segment: q [n, H, hd]; caches [kvH, T, hd] holding its new rows -> [n, H, hd]."""
    end = start + length
    q_pos = torch.arange(start, end).unsqueeze(1)
    k_pos = torch.arange(end).unsqueeze(0)
    mask = (k_pos <= q_pos) & ((k_pos > q_pos - window) if window else True)  # [n, T]
    groups = q.shape[1] // k_cache.shape[0]
    keys = k_cache[:, :end].repeat_interleave(groups, 0)  # [H, T, hd]
    values = v_cache[:, :end].repeat_interleave(groups, 0)
    scores = q.transpose(0, 1).double() @ keys.double().transpose(-1, -2) * scale  # [H, n, T]
    if softcap:
        scores = torch.tanh(scores / softcap) * softcap
    scores = scores.masked_fill(~mask, float("-inf"))
    return (scores.softmax(-1) @ values.double()).transpose(0, 1).float()


def _self_check(fn) -> bool:
    """Against fp64 torch on awkward shapes (GQA, a window, a softcap, a head size not a multiple of 8), fp32 and
    bf16 (whose outputs are within a bf16 rounding of the reference)."""
    g = torch.Generator().manual_seed(0)
    cases = ((4, 2, 12, None, None, torch.float32), (6, 3, 16, 3, None, torch.float32),
             (2, 1, 8, None, 5.0, torch.float32), (6, 2, 20, 4, None, torch.bfloat16))
    for heads, kv_heads, hd, window, softcap, dtype in cases:
        tol = dict(rtol=1e-4, atol=1e-5) if dtype == torch.float32 else dict(rtol=1e-2, atol=1e-2)
        caches = [_Cache(*(torch.randn(2, kv_heads, 12, hd, generator=g).to(dtype) for _ in "kv")) for _ in range(2)]
        starts, lengths = [5, 0], [3, 2]
        n = sum(lengths)
        q, k, v = (torch.randn(n, h, hd, generator=g).to(dtype) for h in (heads, kv_heads, kv_heads))
        out = torch.empty(n, heads, hd, dtype=dtype)
        table = segment_table(caches, [0, 3], starts, lengths)
        attend(fn, q, k, v, out, table, 1, window, hd ** -0.5, softcap)
        for c, row, start, length in zip(caches, [0, 3], starts, lengths):
            want = reference(q[row:row + length].float(), c.k[1].float(), c.v[1].float(), start, length, window,
                             hd ** -0.5, softcap)
            written = torch.equal(c.k[1][:, start:start + length], k[row:row + length].transpose(0, 1))
            if not written or not torch.allclose(out[row:row + length].float(), want, **tol):
                return False
    return True


class _Cache:
    def __init__(self, k: torch.Tensor, v: torch.Tensor):
        self.k, self.v = k, v  # [L, kvH, cap, hd]

    @property
    def capacity(self) -> int:
        return self.k.shape[2]


@functools.cache
def kernel(cache_dir: str | None = None):
    """The loaded C function, or None where it cannot be used. Cached per process."""
    # contraction off: the source places every fused multiply-add itself (see its header)
    fn = native.load_function(SOURCE, "dspark_ragged_attention", cache_dir, extra_flags=CFLAGS)
    if fn is None:
        return None
    fn.argtypes, fn.restype = _ARGTYPES, ctypes.c_int
    if not _self_check(fn):
        log.warning("the native attention kernel failed its self-check; using torch's attention")
        return None
    return fn


def max_queries(dtype: torch.dtype) -> int:
    """The longest segment this kernel attends for caches of `dtype`; longer ones go to torch."""
    return MAX_QUERIES_BF16 if dtype == torch.bfloat16 else MAX_QUERIES


def usable(cache_dtype: torch.dtype, device: torch.device) -> bool:
    return device.type == "cpu" and cache_dtype in DTYPES and kernel() is not None


__all__ = ["DTYPES", "MAX_QUERIES", "MAX_QUERIES_BF16", "attend", "kernel", "max_queries", "reference", "segment_table",
           "source_hash", "usable"]
