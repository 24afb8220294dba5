"""Per-request draft context: the draft layers' K/V of every committed target position.

The fused features are projected to K/V once, when the tokens are observed, so a draft step only projects its
own γ slots. Like the target's KV cache it is a growable buffer with a length pointer: rollback is O(1).
"""
from __future__ import annotations

import torch


class DraftContext:
    def __init__(self, num_layers: int, kv_heads: int, head_dim: int, capacity: int = 256,
                 dtype: torch.dtype = torch.float32):
        self.k = torch.empty(num_layers, capacity, kv_heads, head_dim, dtype=dtype)  # [nL, cap, kvH, hd]
        self.v = torch.empty_like(self.k)
        self.length = 0  # positions 0..length-1 are valid

    def _reserve(self, length: int) -> None:
        if length <= self.k.shape[1]:
            return
        cap = max(length, 2 * self.k.shape[1])  # amortised doubling
        k = self.k.new_empty(self.k.shape[0], cap, *self.k.shape[2:])
        v = torch.empty_like(k)
        k[:, : self.length], v[:, : self.length] = self.k[:, : self.length], self.v[:, : self.length]
        self.k, self.v = k, v

    def write(self, start: int, kv: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Drop positions >= start, then store kv (per layer k, v: [n, kvH, hd]) at start..start+n−1."""
        if start > self.length:
            raise ValueError(f"write at {start} leaves a gap after {self.length} positions")
        n = kv[0][0].shape[0]
        self._reserve(start + n)
        for i, (k, v) in enumerate(kv):
            self.k[i, start: start + n] = k
            self.v[i, start: start + n] = v
        self.length = start + n

    def copy_prefix(self, length: int) -> "DraftContext":
        """A new context holding this one's first `length` positions (a prompt prefix another request shares)."""
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot copy {length} positions from a draft context of length {self.length}")
        other = DraftContext.__new__(DraftContext)
        other.k, other.v = self.k[:, :length].clone(), self.v[:, :length].clone()
        other.length = length
        return other

    def truncate(self, length: int) -> None:
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot truncate a draft context of length {self.length} to {length}")
        self.length = length

    @staticmethod
    def batch(ctxs: list["DraftContext"], anchors: torch.Tensor):
        """-> per layer (kc, vc) [R, T, kvH, hd] with T = the longest context, and visibility [R, 1, T].

        One request uses views (no copy); several are padded into one tensor so the draft layers run once.
        """
        T = max(c.length for c in ctxs)
        visible = (torch.arange(T)[None, :] < anchors[:, None]).unsqueeze(1)  # [R, 1, T]
        if len(ctxs) == 1:
            c = ctxs[0]
            return [(c.k[i, :T][None], c.v[i, :T][None]) for i in range(c.k.shape[0])], visible
        n_layers, _, kv_heads, hd = ctxs[0].k.shape
        k = ctxs[0].k.new_zeros(n_layers, len(ctxs), T, kv_heads, hd)
        v = torch.zeros_like(k)
        for r, c in enumerate(ctxs):
            k[:, r, : c.length], v[:, r, : c.length] = c.k[:, : c.length], c.v[:, : c.length]
        return [(k[i], v[i]) for i in range(n_layers)], visible
