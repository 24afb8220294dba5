"""Inference kernels for the drafter's projections: the target's fast CPU paths, behind the training modules.

The drafter is trained with plain `nn.Linear`, whose CPU product (aten::mm) is slow on a few rows: at batch 1 on
the 2-core dev machine one DSpark proposal spent 1.7 ms of its 4.4 ms in the draft layer's four projections on
7 rows and 0.65 ms in four [1 × 64] · [64 × 16,384] Markov products, while the drafter's LM head — already on the
target's pre-packed oneDNN kernel — read 2.5× more weight bytes in 0.7 ms. `attach` gives each projection the
kernel the target uses for the same row count (`models.layers.Projection`: the C kernel up to the row limit
measured for the target, models/kernel_choice.py, pre-packed oneDNN above), for inference only:

* under autograd (training) the module's own `nn.Linear` runs, so gradients are unchanged;
* a packed copy is a snapshot of the weight; if the weight is changed in place afterwards (an optimizer step,
  `load_state_dict`) its version counter moves and the module's own product runs instead — never a stale result.

With `bf16=True` (the default where the CPU has native bf16 dot products, `bf16_is_fast`), products of
`BF16_MIN_ROWS` (3) rows or more read a bf16 copy of the weight through pre-packed oneDNN, with bf16 activations
and fp32 accumulation: on the dev machine's AVX512-BF16 cores that is 1.4-1.6x faster for the draft layer's
projections at 3-7 rows. Fewer rows go to our bf16 C kernel where the CPU has one (AVX512-BF16): with the weights
cold, as in an engine step, it was the fastest of the four paths (C or oneDNN, fp32 or bf16) at 1-2 rows for every
drafter projection on session 46's Intel Xeon — the Markov head's 0.300 -> 0.217 ms, the feature fusion's 0.387 ->
0.163 ms at one row against what ran before, fp32 oneDNN (scripts/bf16_projection_cost.py,
results/bf16-projections-s46). Without it, the fp32 C kernel (as on session 15's AMD EPYC, before the bf16 C kernel
existed). The shipped drafter's weights are stored in bf16, so the copy is exact and only the activations are
rounded; the Markov head's input, a row of its own bf16 table, is not rounded at all.

Where our bf16 C kernel is the only fast bf16 product (AVX2 without AVX512-BF16: oneDNN emulates bf16 and torch
packs no bf16 weights), `bf16=True` (opt-in there: `--drafter dspark@bf16`; `bf16_c_rows`) sends products of up to
`BF16_C_ROWS` rows to it and larger ones to the fp32 kernels: on session 54's AMD EPYC it was faster than both fp32
kernels on every drafter shape up to 8 rows but the K/V rows, a tie (draft LM head 3.33 -> 1.96 ms, Markov head 0.49 -> 0.23 ms at one
row; 1.05-1.2x at 8), while at 16 rows fp32 oneDNN won the heads' products (scripts/bf16_projection_cost.py,
results/bf16-projections-s54); a batch-1 proposal got 1.26-1.38x faster, two to eight requests 0.98-1.13x at depth 4-7
(scripts/propose_cost.py --ab-bf16, results/drafter-bf16-avx2-s54). It is not the default because a request's q
then depends on its batch: the same request drafts from bf16 products alone and from fp32 ones beside seven
others, a ~1e-2 logit difference that moves seeded draws (tests/test_calibrate_acceptance.py's batch-1 = batch-8
rounds fail with it); on AVX512-BF16 both routes are bf16 and differ only in summation order.

Either way the drafter's distribution q moves by float rounding (bf16: ~1e-2 in a logit), so a drafted token can
differ from the reference path where its top two logits nearly tie. Verification uses the probabilities the
drafter actually sampled from, so every path is lossless (tests/drafters/test_draft_kernels.py compares them).
"""
from __future__ import annotations

import torch
from torch import nn

from ..models import native as native_kernel
from ..models.layers import Projection

BF16_MIN_ROWS = 3  # below, the C kernels beat bf16 oneDNN on the draft layer's shapes (bf16_projection_cost.py)
BF16_C_ROWS = 8  # where only the bf16 C kernel is fast: its row limit (above, fp32 kernels; see the docstring)


def bf16_is_fast() -> bool:
    """Whether this CPU multiplies bf16 natively (AVX512-BF16 or AMX). Elsewhere oneDNN emulates bf16 products,
    which are then slower than fp32 ones."""
    cpu = torch.cpu
    has = [getattr(cpu, name, None) for name in ("_is_avx512_bf16_supported", "_is_amx_tile_supported")]
    return torch.backends.mkldnn.is_available() and any(f is not None and f() for f in has)


def bf16_c_rows() -> int | None:
    """``BF16_C_ROWS`` where our bf16 C kernel runs but bf16 oneDNN is not fast (AVX2): the drafter's bf16 products
    are then that kernel's, up to that many rows; None elsewhere (bf16 oneDNN serves, or no bf16 kernel is fast)."""
    return BF16_C_ROWS if not bf16_is_fast() and native_kernel.kernel_bf16() is not None else None


def bf16_projection(weight: torch.Tensor, native: bool = False, c_rows: int | None = None) -> Projection:
    """A product with bf16 weights: call it with bf16 activations; it returns bf16. Pre-packed oneDNN, and with
    `native` the bf16 C kernel below BF16_MIN_ROWS rows where the CPU has one; with `c_rows`, only the C kernel
    (its callers send it at most that many rows)."""
    bf16 = weight.detach().to(torch.bfloat16).contiguous()
    projection = Projection(bf16, packed=not c_rows, native=native or bool(c_rows))
    projection.native_rows = c_rows or BF16_MIN_ROWS - 1
    return projection


class FastLinear:
    """A `Projection` of ``weight[rows]`` (+ bias) standing in for an `nn.Linear` outside autograd."""

    def __init__(self, linear: nn.Linear, rows: slice | None = None, *, packed: bool, native: bool,
                 bf16: bool = False, native_rows: int | None = None, c_rows: int | None = None):
        self.linear, self.rows = linear, rows or slice(None)
        self.version = linear.weight._version
        self.weight = linear.weight.detach()[self.rows].contiguous()
        self.bias = None if linear.bias is None else linear.bias.detach()[self.rows].contiguous()
        self.packed, self.native, self.native_rows = packed, native, native_rows
        # bf16 weights from BF16_MIN_ROWS rows, and below too where the bf16 C kernel serves them (`wide.native`);
        # with `c_rows` (AVX2) up to c_rows rows, by the bf16 C kernel only
        self.wide = bf16_projection(self.weight, native=native, c_rows=c_rows) if bf16 else None
        self.c_rows = c_rows if self.wide is not None and self.wide.native else None
        if c_rows and self.c_rows is None:
            self.wide = None  # no bf16 C kernel for this weight after all: the fp32 kernels serve every row
        # fp32 product: built now, as the target's are (not on the first proposal), unless bf16 serves every row
        self._projection = None if self.bf16_serves_all else self._fp32_projection()

    @property
    def bf16_serves_all(self) -> bool:
        """Whether the bf16 copy serves every row count, so that no inference call needs the fp32 product."""
        return self.wide is not None and self.wide.native and not self.c_rows

    def bf16_serves(self, rows: int) -> bool:
        """Whether a product of ``rows`` rows reads the bf16 copy."""
        if self.wide is None:
            return False
        return rows <= self.c_rows if self.c_rows else self.wide.native or rows >= BF16_MIN_ROWS

    @property
    def projection(self) -> Projection:
        """The fp32 product; where ``bf16_serves_all``, built only when asked for (benchmarks), so its packed
        copy of the weights (fp32: ~25 MiB of projection weights for the shipped drafter) is not made for nothing."""
        if self._projection is None:
            self._projection = self._fp32_projection()
        return self._projection

    def _fp32_projection(self) -> Projection:
        projection = Projection(self.weight, self.bias, packed=self.packed, native=self.native)
        if self.native_rows is not None:
            projection.native_rows = self.native_rows
        return projection

    def usable(self, x: torch.Tensor) -> bool:
        weight = self.linear.weight
        return not (torch.is_grad_enabled() and (weight.requires_grad or x.requires_grad)) \
            and not self.linear.training and weight._version == self.version and x.dtype == weight.dtype

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x: [..., in] -> [..., out]."""
        if not self.usable(x):
            w = self.linear.weight[self.rows]
            return nn.functional.linear(x, w, None if self.linear.bias is None else self.linear.bias[self.rows])
        flat = x.reshape(-1, x.shape[-1])
        if self.bf16_serves(flat.shape[0]):
            out = self.wide(flat.to(torch.bfloat16)).float()
            if self.bias is not None:
                out += self.bias
        else:
            out = self.projection(flat)
        return out.view(*x.shape[:-1], -1)


def attached(module: nn.Module, name: str) -> FastLinear | None:
    """The inference kernel ``attach`` gave this module's projection ``name``, if any."""
    return module.__dict__.get("fast_linears", {}).get(name)


def linear(module: nn.Module, name: str, x: torch.Tensor) -> torch.Tensor:
    """``module.<name>(x)``, through its attached inference kernel when there is one."""
    fast = attached(module, name)
    return fast(x) if fast is not None else getattr(module, name)(x)


def attach(model: nn.Module, *, packed: bool, native: bool, bf16: bool = False, native_rows: int | None = None,
           c_rows: int | None = None) -> int:
    """Give every draft layer, the feature fusion and a Markov/RNN head's output projection an inference kernel
    (`bf16`: bf16 weights from 3 rows up, or up to `c_rows` rows by the bf16 C kernel only; `native_rows`: our fp32
    C kernel's row limit, the target's measured one). Returns how many projections got one (0: none wanted)."""
    if not (packed or native or bf16):
        return 0
    count = 0
    for module in model.modules():
        names = [n for n in ("qkv", "o", "gate_up", "down", "fuse", "w2") if isinstance(getattr(module, n, None),
                                                                                   nn.Linear)]
        if not names:
            continue
        fast = {n: FastLinear(getattr(module, n), packed=packed, native=native, bf16=bf16, native_rows=native_rows,
                              c_rows=c_rows) for n in names}
        if "qkv" in fast and hasattr(module, "heads"):  # the context K/V use only the k and v rows of qkv
            fast["kv"] = FastLinear(module.qkv, slice(module.heads * module.head_dim, None), packed=packed,
                                    native=native, bf16=bf16, native_rows=native_rows, c_rows=c_rows)
        module.__dict__["fast_linears"] = fast  # a plain attribute: not a submodule, never in the state dict
        count += len(fast)
    return count


def few_rows_on_bf16_c(model: nn.Module) -> bool:
    """Whether ``attach`` routed this model's few-row products to the bf16 C kernel (their price differs)."""
    return any(fast.bf16_serves_all for module in model.modules()
               for fast in module.__dict__.get("fast_linears", {}).values())


def detach(model: nn.Module) -> None:
    """Remove every attached kernel: the module's own products run again (the slow reference)."""
    for module in model.modules():
        module.__dict__.pop("fast_linears", None)
