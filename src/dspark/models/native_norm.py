"""RMSNorm in one C call (native_norm.c); `layers.rms_norm` uses it wherever it applies (CPU, fp32 or bf16).

Why: torch's CPU rms_norm is a composite of ~8 operators, 10-25 µs on one 576-wide row against ~4 µs here,
and a SmolLM2-135M step runs 61 of them (two a layer and the final norm): ~1 ms of a ~20 ms batch-1 step
(`scripts/norm_cost.py` times both). Prompts go through it too (rows in parallel): a token's norm must not depend
on how many rows shared its call, or the engine's batched prefill and one-request decoding could round a bf16
greedy tie differently.

The result equals torch's up to float rounding (a different summation order of the mean square; bf16 is computed
in fp32 and rounded once, as torch does), and a row's result does not depend on the other rows of the call
(tests/test_native_norm.py). Like models/native.py: no compiler, a failed build or self-check, or
`DSPARK_NATIVE=0` leave torch's rms_norm — slower, never wrong.
"""
from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch
import torch.nn.functional as F

from . import native

SOURCE = Path(__file__).with_name("native_norm.c")
_L, _P = ctypes.c_long, ctypes.c_void_p
DTYPES = (torch.float32, torch.bfloat16)


@functools.cache
def kernels(cache_dir: str | None = None):
    """{dtype: C function} or None where the kernel cannot be used. Cached per process."""
    f32 = native.load_function(SOURCE, "dspark_rms_norm_f32", cache_dir, extra_flags=("-ffp-contract=off",))
    bf16 = native.load_function(SOURCE, "dspark_rms_norm_bf16", cache_dir, extra_flags=("-ffp-contract=off",))
    if f32 is None or bf16 is None:
        return None
    f32.argtypes = bf16.argtypes = [_P, _L, _L, _L, _P, ctypes.c_float, _P, ctypes.c_int]
    f32.restype = bf16.restype = None
    fns = {torch.float32: f32, torch.bfloat16: bf16}
    return fns if _self_check(fns) else None


def _self_check(fns) -> bool:
    """Guard against a miscompiled library: compare with torch on awkward widths."""
    g = torch.Generator().manual_seed(0)
    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 1e-2)):
        for m, d in ((1, 7), (3, 20), (2, 576)):
            x, w = torch.randn(m, d, generator=g).to(dtype), torch.randn(d, generator=g).to(dtype)
            got = _call(fns, x, w, 1e-5)
            if not torch.allclose(got.float(), F.rms_norm(x, (d,), w, 1e-5).float(), rtol=tol, atol=tol):
                return False
    return True


def _call(fns, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    rows, d = x.shape
    y = torch.empty(rows, d, dtype=x.dtype)
    fns[x.dtype](x.data_ptr(), rows, x.stride(0), d, weight.data_ptr(), eps, y.data_ptr(), torch.get_num_threads())
    return y


def serves(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether a model of this dtype on this device has its norms computed here (what its speed profile is keyed by)."""
    return device.type == "cpu" and dtype in DTYPES and kernels() is not None


def usable(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """A 2-D input with contiguous rows that `serves` covers, a contiguous weight of its dtype, no autograd."""
    return (x.dim() == 2 and x.dtype == weight.dtype and x.stride(1) == 1 and weight.is_contiguous()
            and not (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad))
            and serves(x.dtype, x.device))


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [rows, d] -> [rows, d]; the caller checked `usable(x, weight)`."""
    return _call(kernels(), x, weight, eps)
