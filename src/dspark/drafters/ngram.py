"""Model-free drafting by prompt lookup: continue the latest earlier occurrence of the trailing n-gram.

Its proposals are deterministic given the history, so q is a point mass and verification accepts a draft
with probability p(x) — still exactly lossless at any temperature.
"""
from __future__ import annotations

import numpy as np
import torch

from .base import DraftRequest, Drafter, Proposal, register_drafter


def lookup(tokens: np.ndarray, gamma: int, max_ngram: int, min_ngram: int) -> np.ndarray:
    """tokens: [L] history -> up to γ tokens that followed the most recent earlier match of its tail."""
    length = len(tokens)
    for n in range(min(max_ngram, length - 1), min_ngram - 1, -1):
        tail = tokens[length - n:]
        windows = np.lib.stride_tricks.sliding_window_view(tokens[: length - 1], n)  # [L-n, n]
        hits = np.flatnonzero((windows == tail).all(axis=1))
        if hits.size:
            start = int(hits[-1]) + n  # the most recent match is usually the most relevant one
            return tokens[start: start + gamma]
    return tokens[:0]


@register_drafter("ngram")
class NGramDrafter(Drafter):
    name = "ngram"

    def __init__(self, target=None, gamma: int = 7, max_ngram: int = 3, min_ngram: int = 1):
        super().__init__(gamma)
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")
        self.max_ngram, self.min_ngram = max_ngram, min_ngram

    def propose(self, requests: list[DraftRequest], depth: int | None = None) -> Proposal:
        gamma = self.slots(depth)
        out = torch.zeros(len(requests), gamma, dtype=torch.long)
        counts = torch.zeros(len(requests), dtype=torch.long)
        for r, req in enumerate(requests):
            found = lookup(np.asarray(req.tokens, dtype=np.int64), gamma, self.max_ngram, self.min_ngram)
            out[r, : len(found)] = torch.from_numpy(found)
            counts[r] = len(found)
        return Proposal(tokens=out, num_tokens=counts)
