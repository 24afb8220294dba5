"""A DSpark block's left-to-right Markov-head draws in one C call (decoding/native_sample.c: dspark_markov_draws).

Why: the torch loop of `DSparkDrafter.sample_block` makes ~9 calls a slot (the W1 row, its bf16 copy, the W2
product, the add, the draw, the draft-vocabulary map, ...), 60-70 a block, and right after a target forward each
small torch call costs 20-80 µs on the Intel dev CPU (results/post-forward-ops-s48): Markov steps, draws and the
map took 0.9 ms of a batch-1 round at T = 0, 1.4 ms at T = 1 (results/round-phases-s46). The kernel runs the same
steps in C; the W2 product goes through the projection kernel the torch path calls for one or two rows
(models/native_linear.c), so there the
logits are the same bits and greedy drafts the same tokens. A sampled slot's softmax is the kernel's own (its exp a
few ulp from torch's), written to the probability buffer verification reads, and the token is drawn from exactly
that row (invariant 1): lossless as before, with q moved by float rounding.

When: a Markov head whose W2 projection was given an inference kernel (draft_kernels.attach) that is our C kernel
for its dtype; every request greedy or temperature-only (no top-k, top-p or min-p: those stay in torch's
`to_probs`); a draft vocabulary the two-level draw splits into blocks (sampling.by_blocks). Elsewhere, or with
``DSPARK_NATIVE=0``, the torch loop runs: the slow reference (tests/drafters/test_markov_draws.py).
"""
from __future__ import annotations

import ctypes
import functools

import torch

from ..decoding import native_sample
from ..decoding.sampling import by_blocks
from ..models import native
from .draft_kernels import attached


@functools.cache
def kernel():
    """dspark_markov_draws, or None where the sampling library is unusable here. Cached per process."""
    if native_sample.kernel() is None or native_sample.argmax_kernel() is None:
        return None  # the draws it shares with them failed their self-checks (or nothing built)
    fn = native.load_function(native_sample.SOURCE, "dspark_markov_draws")
    if fn is None:
        return None
    p, n, i = ctypes.c_void_p, ctypes.c_long, ctypes.c_int
    fn.argtypes = [p, n, n, p, n, p, i, p, p, p, p, p, p, n, n, p, n, n, n, i]
    fn.restype = ctypes.c_int
    return fn


def _product(head, rows: int = 1) -> tuple[torch.Tensor, object, bool] | None:
    """(W2 as the C kernel reads it, that kernel, bf16?) where the torch path's W2 product of ``rows`` rows (the
    requests drafted) is our C kernel."""
    fast = attached(head, "w2")
    if fast is None or fast.version != head.w2.weight._version:
        return None
    if fast.wide is not None and fast.wide.native and fast.bf16_serves(rows):  # bf16 C (draft_kernels.FastLinear)
        return fast.wide.weight, native.kernel_bf16(), True
    if (fast.wide is None or fast.c_rows) and native.usable(fast.weight):
        return fast.weight, native.kernel(), False
    return None


def serves(model) -> bool:
    """Whether this drafter's Markov draws can run in the kernel (the requests' sampling settings aside)."""
    head = model.head
    return (getattr(head, "kind", None) == "markov" and kernel() is not None and by_blocks(model.draft_vocab_size)
            and head.w1.weight.dtype == torch.float32 and head.w1.weight.is_contiguous()
            and _product(head) is not None)


def price_tag(model) -> str:
    """What the speed profile's drafter key adds where the kernel serves: its code's hash (it sets drafting's price)."""
    return f"-md{native.code_hash(native.kernel_source(native_sample.SOURCE))[:8]}" if serves(model) else ""


def applies(model, base: torch.Tensor, requests) -> bool:
    return (not torch.is_grad_enabled() and base.device.type == "cpu" and base.dtype == torch.float32
            and base.stride(-1) == 1 and by_blocks(base.shape[-1])
            and all(r.params.greedy or (r.params.top_k == 0 and r.params.top_p >= 1 and r.params.min_p == 0)
                    for r in requests)
            and serves(model))


def draw_block(model, base: torch.Tensor, anchor_ids: torch.Tensor, requests,
               probs: torch.Tensor | None) -> torch.Tensor:
    """base: [R, g, Vd] fp32 logits U_k; anchor_ids: [R] target ids; probs: [R, g, Vd] to fill (None: every request
    greedy) -> [R, g] drafted target ids. The caller checked `applies`."""
    R, g, vocab = base.shape
    head = model.head
    w2, linear, bf16 = _product(head, R)
    temperature = torch.tensor([float(r.params.temperature) for r in requests], dtype=torch.float32)
    u = torch.full((R, g), 0.5, dtype=torch.float64)
    for i, r in enumerate(requests):  # g uniforms a sampled request, from its own generator, in slot order
        if not r.params.greedy:
            torch.rand(g, generator=r.generator, dtype=torch.float64, out=u[i])
    anchor = anchor_ids.to(torch.int64).contiguous()
    ids = None if model.vocab_ids is None else model.vocab_ids.to(torch.int64).contiguous()
    tokens = torch.empty(R, g, dtype=torch.int64)
    w1 = head.w1.weight.detach()
    ps = (0, 0) if probs is None else (probs.stride(0), probs.stride(1))
    status = kernel()(base.data_ptr(), base.stride(0), base.stride(1), w1.data_ptr(), w1.shape[1], w2.data_ptr(),
                      int(bf16), ctypes.cast(linear, ctypes.c_void_p).value, None if ids is None else ids.data_ptr(),
                      anchor.data_ptr(), temperature.data_ptr(), u.data_ptr(),
                      None if probs is None else probs.data_ptr(), *ps, tokens.data_ptr(), R, g, vocab,
                      torch.get_num_threads())
    if status:
        raise MemoryError("dspark_markov_draws: out of memory")
    return tokens
