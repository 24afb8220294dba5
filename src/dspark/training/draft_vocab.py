"""Choosing a drafter's draft vocabulary from its training data.

The drafter can only propose tokens it has rows for, so the subset should hold the tokens the target actually
emits: rank by how often each token appears among the assistant (loss-masked) tokens of the training set, then
by how often it appears anywhere (prompts are what answers quote), then by id, so the choice is deterministic.
Tokens that must always be draftable (end-of-sequence ids) are forced in.
"""
from __future__ import annotations

import torch

from .features import TokenizedData


def select_draft_vocab(data: TokenizedData, size: int, vocab_size: int, always: tuple[int, ...] = ()) -> torch.Tensor:
    """-> [size] sorted token ids."""
    if not 1 < size < vocab_size:
        raise ValueError(f"a draft vocabulary needs between 2 and {vocab_size - 1} tokens, got {size}")
    answer = torch.zeros(vocab_size, dtype=torch.float64)
    anywhere = torch.zeros(vocab_size, dtype=torch.float64)
    for ids, mask in zip(data.ids, data.masks):
        answer.index_add_(0, ids[mask], torch.ones(int(mask.sum()), dtype=torch.float64))
        anywhere.index_add_(0, ids, torch.ones(len(ids), dtype=torch.float64))
    forced = torch.tensor(sorted({int(t) for t in always if 0 <= int(t) < vocab_size}), dtype=torch.long)
    # One sort key: answer count dominates, then the whole-sequence count, then the lower id.
    key = answer * (anywhere.max() + 1) + anywhere - torch.arange(vocab_size, dtype=torch.float64) / vocab_size
    key[forced] = float("inf")
    return key.topk(size).indices.sort().values


def coverage(data: TokenizedData, ids: torch.Tensor) -> float:
    """Fraction of the assistant tokens of `data` that the vocabulary `ids` can propose."""
    inside = torch.zeros(int(max(int(ids.max()), max((int(s.max()) for s in data.ids), default=0))) + 1,
                         dtype=torch.bool)
    inside[ids] = True
    hit = total = 0
    for seq, mask in zip(data.ids, data.masks):
        hit += int(inside[seq[mask]].sum())
        total += int(mask.sum())
    return hit / max(total, 1)
