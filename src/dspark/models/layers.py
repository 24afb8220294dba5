"""Small tensor functions of the decoder: RMSNorm, rotary tables, gated MLP activation."""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from . import native as native_kernel
from . import native_norm
from .config import RopeSpec


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x: [..., d]; weight already folded to (1 + w) for Gemma-style norms at load time. A decode step's rows go
    through one C call (models/native_norm.py): torch's composite costs ~20 µs a call there."""
    if native_norm.usable(x, weight):
        return native_norm.rms_norm(x, weight, eps)
    return F.rms_norm(x, (x.shape[-1],), weight, eps)


def inv_frequencies(spec: RopeSpec, head_dim: int) -> tuple[torch.Tensor, float]:
    """Inverse frequencies [head_dim / 2] and the cos/sin scale of one rotary variant (fp64 for accuracy)."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim
    inv = 1.0 / (spec.theta ** exponents)
    scale = 1.0
    if spec.rope_type == "linear":
        inv = inv / spec.factor
    elif spec.rope_type == "llama3":
        inv = _llama3_frequencies(inv, spec)
    elif spec.rope_type == "yarn":
        inv, scale = _yarn_frequencies(inv, spec, head_dim)
    return inv, scale


def _llama3_frequencies(inv: torch.Tensor, spec: RopeSpec) -> torch.Tensor:
    # Long wavelengths are slowed by `factor`, short ones kept, and the band between blended smoothly.
    low_wavelen = spec.original_max_position / spec.low_freq_factor
    high_wavelen = spec.original_max_position / spec.high_freq_factor
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > low_wavelen, inv / spec.factor, inv)
    smooth = (spec.original_max_position / wavelen - spec.low_freq_factor) / (
        spec.high_freq_factor - spec.low_freq_factor)
    blended = (1 - smooth) * scaled / spec.factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, blended, scaled)


def _yarn_frequencies(inv: torch.Tensor, spec: RopeSpec, head_dim: int) -> tuple[torch.Tensor, float]:
    def correction_dim(rotations: float) -> float:
        return head_dim * math.log(spec.original_max_position / (rotations * 2 * math.pi)) / (2 * math.log(spec.theta))

    low, high = correction_dim(spec.beta_fast), correction_dim(spec.beta_slow)
    if spec.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001  # avoid a zero-width ramp
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float64) - low) / (high - low)).clamp(0, 1)
    extrapolation = 1 - ramp  # high-frequency dims keep their original frequency
    inv = (inv / spec.factor) * (1 - extrapolation) + inv * extrapolation
    scale = spec.attention_factor
    if scale is None:
        scale = 0.1 * math.log(spec.factor) + 1.0 if spec.factor > 1 else 1.0
    return inv, float(scale)


class RotaryTable:
    """cos/sin rows for positions, grown on demand (a 128K-position table would cost hundreds of MB)."""

    def __init__(self, spec: RopeSpec, head_dim: int, dtype: torch.dtype, device: torch.device | str = "cpu"):
        self.inv, self.scale = inv_frequencies(spec, head_dim)
        self.dtype, self.device = dtype, torch.device(device)
        self.cos = torch.empty(0, head_dim, dtype=dtype, device=device)
        self.sin = torch.empty(0, head_dim, dtype=dtype, device=device)

    def _grow(self, needed: int) -> None:
        size = max(needed, 2 * self.cos.shape[0], 256)
        angles = torch.outer(torch.arange(size, dtype=torch.float64), self.inv)  # [size, hd/2]
        sin = angles.sin()
        angles = torch.cat([angles, angles], dim=-1)  # rotate-half layout
        # Angles in fp64 on the CPU, then one copy: the same table on every device.
        self.cos = (angles.cos() * self.scale).to(self.device, self.dtype)
        # Sign folded in (see apply_rotary): [-sin, +sin] over the two halves.
        self.sin = (torch.cat([-sin, sin], dim=-1) * self.scale).to(self.device, self.dtype)

    def lookup(self, positions: torch.Tensor, max_position: int) -> tuple[torch.Tensor, torch.Tensor]:
        """positions: [N] -> cos, signed sin: [N, 1, hd] (broadcast over heads)."""
        if max_position >= self.cos.shape[0]:
            self._grow(max_position + 1)
        return self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [N, heads, hd]; rotate-half convention (the HF layout, after undoing GGUF's interleave).

    HF's cat(-x2, x1) * sin equals roll(x, half) * [-sin, sin] bit for bit (a sign flip is exact); the table
    stores the signed sin, so a rotation is 4 kernels instead of 7 (per-op cost dominates at decode).
    """
    return (x * cos).add_(x.roll(x.shape[-1] // 2, -1).mul_(sin))


def activation(name: str):
    if name == "gelu_tanh":
        return lambda x: F.gelu(x, approximate="tanh")
    return F.silu


def _pack(weight: torch.Tensor) -> torch.Tensor | None:
    """oneDNN's pre-packed layout of W, or None where this torch build lacks the (inductor) op."""
    try:
        packed = torch.ops.mkldnn._reorder_linear_weight(weight, None)
        probe = torch.ops.mkldnn._linear_pointwise(weight.new_zeros(1, weight.shape[1]), packed, None, "none", [], "")
        return packed if probe.shape == (1, weight.shape[0]) else None
    except (AttributeError, RuntimeError):
        return None


class Projection:
    """y = x · Wᵀ through oneDNN with W pre-packed once.

    On CPU the kernel matters more than the arithmetic. Measured on the 2-core dev machine (torch 2.13, fp32,
    SmolLM2's 30 layers of projections, weights cold in cache): plain `F.linear` takes 35 / 56 / 51 / 65 ms
    for 1 / 2 / 8 / 16 rows — uneven, and worse for 2 rows than for 8; with pre-packed weights
    `_linear_pointwise` takes 19 / 22 / 18 / 24 ms. The LM head (49,152 × 576) drops from 10 / 48 ms to
    5 / 5 ms at 1 / 8 rows. That flat cost up to ~16 rows is what makes verifying drafts nearly free.
    The packed copy doubles weight memory, so the loader enables it only for small models.
    For a few rows (decode, short verify blocks) our C kernel (models/native.py) reads the weights faster still,
    up to `native_rows` rows: native.DEFAULT_ROWS, or the crossover models/kernel_choice.py measured.
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None, packed: bool = False,
                 native: bool = False):
        self.weight = weight  # [out, in], dense: the reference layout, also read by drafter initialisation
        self.bias = bias
        self.packed = _pack(weight) if packed else None
        self.native = native and native_kernel.usable(weight) and (bias is None or bias.is_contiguous())
        self.native_rows = native_kernel.DEFAULT_ROWS  # measured per machine by kernel_choice.tune
        self.pad_to: dict[int, int] = {}  # oneDNN calls of these row counts run padded (kernel_choice.tune)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.shape[0]
        if rows == 0 or x.requires_grad:  # neither fast kernel has a backward
            return F.linear(x, self.weight, self.bias)
        if self.native and rows <= self.native_rows:
            return native_kernel.linear(x, self.weight, self.bias)
        if self.packed is None:
            return F.linear(x, self.weight, self.bias)
        return self.packed_linear(x)

    def packed_linear(self, x: torch.Tensor, size: int | None = None) -> torch.Tensor:
        """oneDNN's product with the pre-packed weight, rows padded to `size`, else to where `pad_to` says a few rows
        run faster (oneDNN takes a slower path for 1-2 rows on the dev CPU: kernel_choice.py), else to a bucket."""
        rows = x.shape[0]
        size = size or self.pad_to.get(rows) or bucket_rows(rows)
        if size != rows:
            x = torch.cat([x, x.new_zeros(size - rows, x.shape[1])])
        return torch.ops.mkldnn._linear_pointwise(x.contiguous(), self.packed, self.bias, "none", [], "")[:rows]


def bucket_rows(rows: int) -> int:
    """oneDNN caches one primitive per input shape; a serving engine sees every row count, so resident memory
    crept up with each new shape. Rounding row counts up to a few sizes bounds the set (54 sizes up to 1,024
    rows). Padding is not free: padded to 16, a 10-row verify step (two requests verifying 4 drafts each) cost as
    much as a 16-row one, 49.8 against 43.8 ms padded to 12 (scripts/step_shape_cost.py), so below 64 rows the
    buckets are 4 wide, and above they grow with the rows so that padding stays under 1/8 of them. With 16-row
    buckets from 33 rows and 128-row ones from 129, a 34-row step (32 requests, two drafts; padded to 48) cost
    59.8 ms against 48.1 padded to 36, and a 140-token prefill beside 8 decoding rows (148, padded to 256) 158
    against 112 ms padded to 160 (scripts/bucket_cost.py, results/buckets-s24). The price is memory: once every
    size up to 1,024 rows has run, resident memory has grown by 189 MB, against 97 MB for the 27 coarser sizes
    (SmolLM2-135M on the dev CPU, `scripts/bucket_cost.py --rss`)."""
    if rows <= 8:
        return rows
    step = (4 if rows <= 64 else 8 if rows <= 128 else 16 if rows <= 256 else 32 if rows <= 512
            else 64 if rows <= 1024 else 128)
    return -(-rows // step) * step
