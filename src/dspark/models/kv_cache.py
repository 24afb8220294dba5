"""Per-request KV cache: contiguous buffers with a length pointer, so rollback is O(1).

A speculative round writes the anchor and ℓ drafts at positions start..start+ℓ, then keeps only the
accepted prefix: `truncate(start + accepted + 1)`. Nothing is copied; later writes overwrite the rest.
"""
from __future__ import annotations

import copy

import torch


class KVCache:
    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                 capacity: int = 256, max_capacity: int | None = None,
                 device: torch.device | str = "cpu"):
        self.shape = (num_layers, num_kv_heads, head_dim)
        self.dtype = dtype
        self.max_capacity = max_capacity
        self.length = 0  # positions 0..length-1 hold valid keys/values
        # [L, kvH, cap, hd]
        self.k = torch.empty(num_layers, num_kv_heads, capacity, head_dim, dtype=dtype, device=device)
        self.v = torch.empty_like(self.k)

    @property
    def capacity(self) -> int:
        return self.k.shape[2]

    def nbytes(self) -> int:
        return self.k.numel() * self.k.element_size() * 2

    def reserve(self, length: int) -> None:
        """Make room for `length` positions (amortised doubling keeps per-step cost flat)."""
        if length <= self.capacity:
            return
        if self.max_capacity is not None and length > self.max_capacity:
            raise ValueError(f"sequence of {length} tokens exceeds the context window of {self.max_capacity}")
        new_cap = max(length, 2 * self.capacity)
        if self.max_capacity is not None:
            new_cap = min(new_cap, self.max_capacity)
        layers, heads, head_dim = self.shape
        k = torch.empty(layers, heads, new_cap, head_dim, dtype=self.dtype, device=self.k.device)
        v = torch.empty_like(k)
        k[:, :, : self.length] = self.k[:, :, : self.length]
        v[:, :, : self.length] = self.v[:, :, : self.length]
        self.k, self.v = k, v

    def compact(self) -> int:
        """Give back the room past ``length`` when it is most of the buffer; returns the capacity left. A finished
        request kept as a prefix donor only ever lends the positions it computed, and its reservation was sized for
        ``max_new_tokens`` that an early stop left unused (2,048 reserved for a 40-token answer). The copy is skipped
        while the room is small: a donor is made at every finish, and copying a whole cache there for a few spare
        positions would cost serving more than it frees."""
        keep = max(self.length, 1)
        if self.capacity - keep > max(keep, 64):
            # clone, not a slice: a view would keep the whole buffer alive
            self.k = self.k[:, :, :keep].clone(memory_format=torch.contiguous_format)
            self.v = self.v[:, :, :keep].clone(memory_format=torch.contiguous_format)
        return self.capacity

    def clone(self) -> KVCache:
        """An independent copy: same contents, length and capacity."""
        other = copy.copy(self)
        other.k, other.v = self.k.clone(), self.v.clone()
        return other

    def copy_prefix(self, source: KVCache, length: int) -> None:
        """Take `source`'s first `length` positions (a shared prompt prefix) as this cache's whole contents."""
        if length > source.length:
            raise ValueError(f"cannot copy {length} positions from a cache holding {source.length}")
        self.reserve(length)
        self.k[:, :, :length] = source.k[:, :, :length]
        self.v[:, :, :length] = source.v[:, :, :length]
        self.length = length

    def begin_write(self, start: int, count: int) -> None:
        """Claim positions start..start+count-1; anything at or after `start` is discarded."""
        if start > self.length:
            raise ValueError(f"write at position {start} leaves a gap after cached length {self.length}")
        self.reserve(start + count)
        self.length = start + count

    def truncate(self, length: int) -> None:
        """Roll back to the first `length` positions."""
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot truncate a cache of length {self.length} to {length}")
        self.length = length
