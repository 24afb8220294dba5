"""Inference kernels for the drafter's projections: the target's fast CPU paths, behind the training modules.

The drafter is trained with plain `nn.Linear`, whose CPU product (aten::mm) is slow on a few rows: at batch 1 on
the 2-core dev machine one DSpark proposal spent 1.7 ms of its 4.4 ms in the draft layer's four projections on
7 rows and 0.65 ms in four [1 × 64] · [64 × 16,384] Markov products, while the drafter's LM head — already on the
target's pre-packed oneDNN kernel — read 2.5× more weight bytes in 0.7 ms. `attach` gives each projection the
kernel the target uses for the same row count (`models.layers.Projection`: the C kernel for 1–2 rows, pre-packed
oneDNN above), for inference only:

* under autograd (training) the module's own `nn.Linear` runs, so gradients are unchanged;
* a packed copy is a snapshot of the weight; if the weight is changed in place afterwards (an optimizer step,
  `load_state_dict`) its version counter moves and the module's own product runs instead — never a stale result.

The kernels sum in another order than aten::mm, so a drafted token can differ from the reference path at a float
near-tie; verification uses the probabilities the drafter actually sampled from, so either path is lossless
(tests/drafters/test_draft_kernels.py compares the two).
"""
from __future__ import annotations

import torch
from torch import nn

from ..models.layers import Projection


class FastLinear:
    """A `Projection` of ``weight[rows]`` (+ bias) standing in for an `nn.Linear` outside autograd."""

    def __init__(self, linear: nn.Linear, rows: slice | None = None, *, packed: bool, native: bool):
        self.linear, self.rows = linear, rows or slice(None)
        self.version = linear.weight._version
        weight = linear.weight.detach()[self.rows].contiguous()
        bias = None if linear.bias is None else linear.bias.detach()[self.rows].contiguous()
        self.projection = Projection(weight, bias, packed=packed, native=native)

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
        return self.projection(flat).view(*x.shape[:-1], -1)


def attached(module: nn.Module, name: str) -> FastLinear | None:
    """The inference kernel ``attach`` gave this module's projection ``name``, if any."""
    return module.__dict__.get("fast_linears", {}).get(name)


def linear(module: nn.Module, name: str, x: torch.Tensor) -> torch.Tensor:
    """``module.<name>(x)``, through its attached inference kernel when there is one."""
    fast = attached(module, name)
    return fast(x) if fast is not None else getattr(module, name)(x)


def attach(model: nn.Module, *, packed: bool, native: bool) -> int:
    """Give every draft layer, the feature fusion and a Markov/RNN head's output projection an inference kernel.
    Returns how many projections got one (0 when neither kernel is wanted)."""
    if not (packed or native):
        return 0
    count = 0
    for module in model.modules():
        names = [n for n in ("qkv", "o", "gate_up", "down", "fuse", "w2") if isinstance(getattr(module, n, None),
                                                                                   nn.Linear)]
        if not names:
            continue
        fast = {n: FastLinear(getattr(module, n), packed=packed, native=native) for n in names}
        if "qkv" in fast and hasattr(module, "heads"):  # the context K/V use only the k and v rows of qkv
            fast["kv"] = FastLinear(module.qkv, slice(module.heads * module.head_dim, None), packed=packed,
                                    native=native)
        module.__dict__["fast_linears"] = fast  # a plain attribute: not a submodule, never in the state dict
        count += len(fast)
    return count


def detach(model: nn.Module) -> None:
    """Remove every attached kernel: the module's own products run again (the slow reference)."""
    for module in model.modules():
        module.__dict__.pop("fast_linears", None)
