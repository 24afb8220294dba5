"""Anchor-bounded packing: many anchors per sequence, several sequences per batch, token-level indices.

An anchor is a position a inside assistant tokens whose next token is also an assistant token; it makes one
block of γ slots, slot j (0-based) predicting the token at a + j + 1. A block sees the context positions
strictly before a and itself; so a sequence contributes context rows only up to its last anchor (anchor-bounded)
and final hidden states only up to last anchor + γ − 1. The batch stores those rows flat, with their
(sequence, position) indices and a [G, T] gather index; attention masks are derived from positions on the fly
(`ctx_pos < anchor`), never materialised as an [S × S] matrix.

Planning (anchors, slot masks) needs only ids and masks, so the loss denominator of a whole optimizer step is
known before any feature is loaded — what makes gradient accumulation and multi-process training exact.
"""
from __future__ import annotations

from dataclasses import dataclass, fields

import torch

from .features import FeatureSource, SeqFeatures


@dataclass
class BlockPlan:
    index: int  # sequence index in the source
    anchors: torch.Tensor  # [A_i] sorted anchor positions
    slot_valid: torch.Tensor  # [A_i, γ] contiguous valid prefix of each block
    need: int  # positions whose features are needed: 0 .. last anchor + γ − 1


@dataclass
class Batch:
    features: torch.Tensor  # [N, m, d] captured target layers of the flat context rows
    ctx_seq: torch.Tensor  # [N] which sequence (0..G−1) each flat row belongs to
    ctx_pos: torch.Tensor  # [N] its position in that sequence
    ctx_index: torch.Tensor  # [G, T] flat row of (sequence g, position t); 0 where t is past g's context
    anchors: torch.Tensor  # [G, A] anchor positions (0 for padding blocks)
    block_valid: torch.Tensor  # [G, A]
    block_ids: torch.Tensor  # [G, A, γ] [anchor, MASK, ..., MASK]
    prev_ids: torch.Tensor  # [G, A, γ] teacher-forced previous tokens [anchor, y_1, ..., y_{γ−1}]
    labels: torch.Tensor  # [G, A, γ] y_j = token at anchor + j + 1
    slot_valid: torch.Tensor  # [G, A, γ]
    target_hidden: torch.Tensor  # [G, A, γ, d] target final hidden at anchor + j (predicts y_j)

    def to(self, device: torch.device) -> "Batch":
        return type(self)(*(getattr(self, f.name).to(device) for f in fields(self)))


def anchor_candidates(mask: torch.Tensor) -> torch.Tensor:
    """mask: [S] bool (assistant tokens) -> positions a with mask[a] and mask[a+1]."""
    return torch.nonzero(mask[:-1] & mask[1:]).flatten()


def sequence_generator(seed: int, epoch: int, index: int) -> torch.Generator:
    """Anchors depend only on (seed, epoch, sequence), not on process count, batch or resume point."""
    return torch.Generator().manual_seed((seed * 1_000_003 + epoch) * 1_000_033 + index)


def slot_mask(mask: torch.Tensor, anchors: torch.Tensor, block_size: int) -> torch.Tensor:
    """[A, γ]: slot j is valid while the labels at anchor+1 .. anchor+j+1 exist and are all assistant tokens."""
    pos = anchors.unsqueeze(1) + torch.arange(1, block_size + 1)  # [A, γ] label positions
    inside = pos < mask.shape[0]
    ok = inside & mask[pos.clamp(max=mask.shape[0] - 1)]
    return ok.long().cumprod(dim=1).bool()


def plan_sequence(index: int, mask: torch.Tensor, count: int, block_size: int,
                  generator: torch.Generator) -> BlockPlan:
    cand = anchor_candidates(mask)
    pick = torch.randperm(len(cand), generator=generator)[:count]
    anchors = cand[pick].sort().values
    need = int(anchors.max()) + block_size if len(anchors) else 0
    return BlockPlan(index, anchors, slot_mask(mask, anchors, block_size), min(need, mask.shape[0]))


def plan_batch(source: FeatureSource, indices: list[int], epoch: int, seed: int, anchors_per_seq: int,
               block_size: int) -> list[BlockPlan]:
    plans = [plan_sequence(i, source.sequence(i)[1], anchors_per_seq, block_size, sequence_generator(seed, epoch, i))
             for i in indices]
    return [p for p in plans if len(p.anchors)]


def collate(plans: list[BlockPlan], source: FeatureSource, feats: list[SeqFeatures], block_size: int,
            mask_token_id: int) -> Batch:
    G, A = len(plans), max(len(p.anchors) for p in plans)
    ctx_lens = [int(p.anchors.max()) for p in plans]  # context = positions strictly before the last anchor
    T = max(ctx_lens)
    starts = torch.tensor([0, *ctx_lens]).cumsum(0)
    ctx_index = torch.zeros(G, T, dtype=torch.long)
    anchors = torch.zeros(G, A, dtype=torch.long)
    block_valid = torch.zeros(G, A, dtype=torch.bool)
    labels = torch.zeros(G, A, block_size, dtype=torch.long)
    prev_ids = torch.zeros(G, A, block_size, dtype=torch.long)
    slot_valid = torch.zeros(G, A, block_size, dtype=torch.bool)
    d, dev = feats[0].final.shape[-1], feats[0].final.device
    target_hidden = torch.zeros(G, A, block_size, d, device=dev)  # features stay where the target made them
    for g, (plan, f, n) in enumerate(zip(plans, feats, ctx_lens)):
        ids = source.sequence(plan.index)[0]
        a = len(plan.anchors)
        ctx_index[g, :n] = torch.arange(starts[g], starts[g] + n)
        anchors[g, :a], block_valid[g, :a], slot_valid[g, :a] = plan.anchors, True, plan.slot_valid
        pos = plan.anchors.unsqueeze(1) + torch.arange(block_size)  # [a, γ] positions anchor + j
        labels[g, :a] = ids[(pos + 1).clamp(max=len(ids) - 1)]
        prev_ids[g, :a] = ids[pos.clamp(max=len(ids) - 1)]
        target_hidden[g, :a] = f.final[pos.clamp(max=f.final.shape[0] - 1).to(dev)]
    block_ids = torch.full((G, A, block_size), mask_token_id, dtype=torch.long)
    block_ids[:, :, 0] = prev_ids[:, :, 0]
    features = torch.cat([f.layers[:n] for f, n in zip(feats, ctx_lens)])  # [N, m, d]
    ctx_seq = torch.cat([torch.full((n,), g) for g, n in enumerate(ctx_lens)])
    ctx_pos = torch.cat([torch.arange(n) for n in ctx_lens])
    index = [t.to(dev) for t in (ctx_seq, ctx_pos, ctx_index, anchors, block_valid, block_ids, prev_ids, labels,
                                 slot_valid & block_valid.unsqueeze(-1))]
    return Batch(features, *index, target_hidden)


def load_batch(source: FeatureSource, plans: list[BlockPlan], block_size: int, mask_token_id: int) -> Batch:
    feats = source.features([p.index for p in plans], [p.need for p in plans])
    return collate(plans, source, feats, block_size, mask_token_id)
