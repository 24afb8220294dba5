"""EAGLE-3 training-time test (TTT): the γ-step chain of eagle3_model unrolled from every anchor of a packed batch.

Anchors, slots and the target distributions come from packing.py, as for DSpark: anchor a ≥ 1 (step 1 needs
g_{a−1}), slot j = k−1 predicts x_{a+j+1}. Step 1 reads the target feature g_{a−1}; step k > 1 reads the
drafter's own previous output h_{k−1} — the test-time situation, trained for here — with the data token
x_{a+k−1} teacher-forced (the data are the target's own generations). Each step is scored against the target's
distribution at the same position, p = softmax(LM_head(target final hidden at a+j)) at T = 1 (soft targets):
    L = Σ_blocks Σ_j w_j · (−Σ_v p_v log q_j,v) / Σ_step Σ_blocks Σ_j w_j·valid,     w_j = 0.8^j (j = k−1),
over each block's valid prefix (packing.slot_mask). Gradients flow through the whole unroll.

Batch: packing's Batch (context rows up to the last anchor, a [G, T] gather index, [G, A, γ] slot tensors) plus
ctx_next [N], the token x_{t+1} each context row t pairs with. Context K/V are projected once per row; a step
scores [G, A, T] context keys plus the chain's own ≤ γ keys: token-level indices, no [S × S] mask.
"""
from __future__ import annotations

from dataclasses import dataclass, fields

import torch

from ..drafters.eagle3_model import Eagle3Model
from . import packing
from .losses import chunked_backward, target_probs, valid_blocks
from .packing import Batch, BlockPlan

STEP_DECAY = 0.8


def step_weights(steps: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """[γ] w_j = 0.8^j: step k = j + 1 of the chain."""
    return STEP_DECAY ** torch.arange(steps, dtype=torch.float32, device=device)


@dataclass
class Eagle3Batch(Batch):
    ctx_next: torch.Tensor  # [N] token x_{t+1} of each flat context row (sequence, t)

    def to(self, device: torch.device) -> "Eagle3Batch":
        return Eagle3Batch(*(getattr(self, f.name).to(device) for f in fields(self)))


def plan_batch(source, indices: list[int], epoch: int, seed: int, anchors_per_seq: int,
               block_size: int) -> list[BlockPlan]:
    """packing.plan_batch without anchors at position 0 (no feature precedes them; never an inference anchor)."""
    plans = []
    for p in packing.plan_batch(source, indices, epoch, seed, anchors_per_seq, block_size):
        keep = p.anchors >= 1
        if bool(keep.all()):
            plans.append(p)
        elif bool(keep.any()):  # dropping the smallest anchor leaves `need` unchanged
            plans.append(BlockPlan(p.index, p.anchors[keep], p.slot_valid[keep], p.need))
    return plans


def load_batch(source, plans: list[BlockPlan], block_size: int, mask_token_id: int) -> Eagle3Batch:
    batch = packing.load_batch(source, plans, block_size, mask_token_id)
    # Context rows of sequence g are t = 0 .. max anchor − 1 (as in packing.collate); x_{t+1} exists for each.
    nxt = torch.cat([source.sequence(p.index)[0][1: int(p.anchors.max()) + 1] for p in plans])
    return Eagle3Batch(*(getattr(batch, f.name) for f in fields(Batch)), nxt.to(batch.ctx_pos.device))


def forward_hidden(model: Eagle3Model, batch: Eagle3Batch) -> torch.Tensor:
    """The TTT unroll over a packed batch -> final-normed h [G, A, γ, d]."""
    g = model.fuse_features(batch.features)  # [N, d]
    k, v = model.context_kv(g, batch.ctx_next, batch.ctx_pos)  # [N, kvH, hd]
    kc, vc = k[batch.ctx_index], v[batch.ctx_index]  # [G, T, kvH, hd]
    T = batch.ctx_index.shape[1]
    anchors = batch.anchors.clamp_min(1)  # padding blocks (anchor 0) see entry 0: no empty softmax row
    visible = torch.arange(T, device=anchors.device)[None, None, :] < anchors.unsqueeze(-1)  # [G, A, T]
    first = g[batch.ctx_index.gather(1, anchors - 1)]  # [G, A, d] g_{a−1}
    ids, steps = batch.prev_ids, batch.prev_ids.shape[-1]  # [G, A, γ] x_{a+j}: teacher forcing
    return model.chain(ids[..., 0], first, anchors - 1, kc, vc, visible, steps,
                       lambda j, h: ids[..., j + 1] if j + 1 < steps else None)


def block_terms(model: Eagle3Model, h: torch.Tensor, labels: torch.Tensor, valid: torch.Tensor,
                target_hidden: torch.Tensor, weights: torch.Tensor) -> dict:
    """Weighted sums over B blocks. h, target_hidden: [B, γ, d]; labels, valid: [B, γ]; weights: [γ].
    -> {ce: Σ w·(−Σ p log q) (with grad); tv: Σ w‖q−p‖₁; conf: 0; den, top1: floats; accept, count: [γ]}
    (accept: Σ (1 − ½‖q−p‖₁), the acceptance probability of each step given its teacher-forced prefix)."""
    logits = model.base_logits(h)  # [B, γ, Vd] fp32
    logq = logits.log_softmax(-1)
    p, outside = target_probs(model, target_hidden)  # [B, γ, Vd], [B, γ]: normalised over the full vocabulary
    w = weights * valid
    ce = -((p * logq).sum(-1) * w).sum()
    with torch.no_grad():
        l1 = (logq.exp() - p).abs().sum(-1) + outside  # [B, γ]
        accept = (1 - 0.5 * l1).clamp(0, 1)
        vf = valid.float()
        top1 = ((logits.argmax(-1) == model.to_local(labels)) & valid).sum().item()
    return {"ce": ce, "tv": float((l1 * w).sum()), "conf": 0.0, "soft": float(ce.detach()), "den": float(w.sum()),
            "top1": float(top1),
            "accept": (accept * vf).sum(0).cpu(), "count": vf.sum(0).cpu()}


def batch_loss(model: Eagle3Model, batch: Eagle3Batch) -> tuple[torch.Tensor, dict]:
    """TTT loss of one batch normalised by its own denominator (evaluation and tests)."""
    h, _, labels, valid, th = valid_blocks(batch, forward_hidden(model, batch))
    terms = block_terms(model, h, labels, valid, th, step_weights(h.shape[1], h.device))
    return terms["ce"] / max(terms["den"], 1e-12), terms


def backward(model: Eagle3Model, batch: Eagle3Batch, den_total: float, alpha=None, decay=None,
             chunk_blocks: int = 64) -> dict:
    """losses.backward's contract for the TTT loss (alpha and decay do not apply: the loss is the soft CE and
    the weights are 0.8^j). The LM-head part runs in chunks of blocks into a detached copy of h, then the unroll
    is backpropagated once from h's gradient."""
    h, _, labels, valid, th = valid_blocks(batch, forward_hidden(model, batch))
    weights = step_weights(h.shape[1], h.device)
    return chunked_backward(h, chunk_blocks,
                            lambda hp, part: block_terms(model, hp, labels[part], valid[part], th[part], weights),
                            lambda terms: terms["ce"] / max(den_total, 1e-12))
