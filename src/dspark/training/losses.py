"""DSpark training losses over the blocks of a packed batch.

Per slot k = 1..γ with weight w_k = exp(−(k−1)/decay), only over each block's contiguous valid prefix:
  CE   = −Σ w_k log q_k(y_k)                       (Markov/RNN head teacher-forced on y)
  TV   =  Σ w_k ‖q_k − p_k‖₁                        (p_k: target softmax at T = 1)
  CONF =  Σ w_k BCE(c_k, 1 − ½‖q_k − p_k‖₁)         (soft label: the slot's acceptance probability, detached)
  SOFT = −Σ w_k Σ_v p_k(v) log q_k(v)               (forward KL to p_k up to its entropy; optional, α = 0)
  L = (α_ce·CE + α_tv·TV + α_conf·CONF + α_soft·SOFT) / Σ w_k   (denominator summed over the optimizer step)
TV is the objective acceptance depends on, but from a diffuse q its gradient is tiny (∂‖q−p‖₁/∂logit_v
scales with q_v); SOFT gives every token of p a gradient and is what EAGLE-style drafters train on. Measured
on SmolLM2 (README, training section): adding it raised top-1 agreement but lowered T = 1 acceptance, so the
shipped recipe keeps α_soft = 0; the term is always computed because the training log reports it.
p_k is recomputed from the cached final hidden state only at the sampled slot positions, through the frozen
target LM head — the "hidden-state communication" that keeps [S × V] target logits off the disk.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from ..drafters.dspark_model import DSparkModel
from .packing import Batch

STAT_KEYS = ("ce", "tv", "conf", "soft", "den", "top1")


def slot_weights(block_size: int, decay: float, device: torch.device | str = "cpu") -> torch.Tensor:
    """[γ] w_k = exp(−(k−1)/decay)."""
    return torch.exp(-torch.arange(block_size, dtype=torch.float32, device=device) / decay)


def forward_hidden(model: DSparkModel, batch: Batch) -> torch.Tensor:
    """The drafter backbone over a packed batch -> h [G, A, γ, d] (after the final norm)."""
    feats = model.fuse_features(batch.features)  # [N, d]
    kv = model.context_kv(feats, batch.ctx_pos)  # per layer [N, kvH, hd]
    ctx_kv = [(k[batch.ctx_index], v[batch.ctx_index]) for k, v in kv]  # [G, T, kvH, hd]
    T = batch.ctx_index.shape[1]
    # [G, A, T]: strictly before the anchor
    visible = torch.arange(T, device=batch.anchors.device)[None, None, :] < batch.anchors.unsqueeze(-1)
    visible &= batch.block_valid.unsqueeze(-1)
    return model.backbone(batch.block_ids, batch.anchors, ctx_kv, visible)


def block_terms(model: DSparkModel, h: torch.Tensor, prev: torch.Tensor, labels: torch.Tensor,
                valid: torch.Tensor, target_hidden: torch.Tensor, weights: torch.Tensor) -> dict:
    """Weighted loss sums of B blocks. h, target_hidden: [B, γ, d]; prev, labels, valid: [B, γ]; weights: [γ].
    -> {ce, tv, conf, soft: scalar sums (with grad); den, top1: floats; accept: [γ] Σ(1 − ½‖q−p‖₁);
    count: [γ]}"""
    logits = model.base_logits(h)  # [B, γ, Vd] fp32
    if model.head is not None:
        logits = logits + model.head.block_bias(prev, h).float()
    logq = logits.log_softmax(-1)
    p, outside = target_probs(model, target_hidden)  # [B, γ, Vd], [B, γ]
    w = weights * valid  # [B, γ]
    local = model.to_local(labels)  # [B, γ]; −1: a label the draft vocabulary cannot produce (no CE term)
    ce = -(logq.gather(-1, local.clamp_min(0).unsqueeze(-1)).squeeze(-1) * w * (local >= 0)).sum()
    l1 = (logq.exp() - p).abs().sum(-1) + outside  # [B, γ] ‖q − p‖₁ over the whole vocabulary
    soft = -((p * logq).sum(-1) * w).sum()
    accept = (1 - 0.5 * l1.detach()).clamp(0, 1)
    conf = ce.new_zeros(())
    c = model.confidence_logits(h, prev)
    if c is not None:
        conf = (F.binary_cross_entropy_with_logits(c, accept, reduction="none") * w).sum()
    with torch.no_grad():
        top1 = ((logits.argmax(-1) == local) & valid).sum().item()
        vf = valid.float()
    return {"ce": ce, "tv": (l1 * w).sum(), "conf": conf, "soft": soft, "den": float(w.sum()), "top1": float(top1),
            "accept": (accept * vf).sum(0).cpu(), "count": vf.sum(0).cpu()}


@torch.no_grad()
def target_probs(model, target_hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The target's T = 1 distribution from its final hidden states [..., d] -> (p on the draft vocabulary
    [..., Vd], the mass outside it [...]). Normalised over the FULL vocabulary either way."""
    p = model.base_logits(target_hidden, full=True).softmax(-1)  # [..., V]
    if model.vocab_ids is None:
        return p, p.new_zeros(p.shape[:-1])
    p = p[..., model.vocab_ids]
    return p, (1 - p.sum(-1)).clamp_min(0)


def combine(terms: dict, den: float, alpha: tuple[float, ...]) -> torch.Tensor:
    """alpha: (ce, tv, conf) or (ce, tv, conf, soft) coefficients."""
    loss = alpha[0] * terms["ce"] + alpha[1] * terms["tv"] + alpha[2] * terms["conf"]
    if len(alpha) > 3 and alpha[3]:
        loss = loss + alpha[3] * terms["soft"]
    return loss / max(den, 1e-12)


def valid_blocks(batch: Batch, h: torch.Tensor):
    """Drop padding blocks -> h [B, γ, d], prev, labels, valid [B, γ], target_hidden [B, γ, d]."""
    keep = batch.block_valid
    return h[keep], batch.prev_ids[keep], batch.labels[keep], batch.slot_valid[keep], batch.target_hidden[keep]


def batch_loss(model: DSparkModel, batch: Batch, alpha=(0.1, 0.9, 1.0),
               decay: float = 4.0) -> tuple[torch.Tensor, dict]:
    """Loss of one batch normalised by its own denominator (evaluation and tests; training uses `backward`)."""
    h, prev, labels, valid, th = valid_blocks(batch, forward_hidden(model, batch))
    terms = block_terms(model, h, prev, labels, valid, th, slot_weights(h.shape[1], decay, h.device))
    return combine(terms, terms["den"], alpha), terms


def backward(model: DSparkModel, batch: Batch, den_total: float, alpha, decay: float, chunk_blocks: int) -> dict:
    """Accumulate gradients of (this batch's share of) the step loss; returns detached sums for logging.

    The LM-head part runs in chunks of blocks, each backpropagated at once into a detached copy of h, so only
    one chunk's [rows × V] tensors are alive; the backbone is then backpropagated once from h's gradient."""
    h, prev, labels, valid, th = valid_blocks(batch, forward_hidden(model, batch))
    weights = slot_weights(h.shape[1], decay, h.device)
    return chunked_backward(
        h, chunk_blocks,
        lambda hp, part: block_terms(model, hp, prev[part], labels[part], valid[part], th[part], weights),
        lambda terms: combine(terms, den_total, alpha))


def chunked_backward(h: torch.Tensor, chunk_blocks: int, chunk_terms, chunk_loss) -> dict:
    """Backpropagate a loss over blocks h [B, γ, d] whose LM-head part runs chunk by chunk: each chunk's loss is
    backpropagated at once into a detached copy of h (only one chunk's [rows × V] tensors alive), then the
    model below h once from the accumulated gradient. chunk_terms(h_part, part) -> terms (STAT_KEYS, accept,
    count); chunk_loss(terms) -> scalar. Returns the summed detached statistics."""
    hd = h.detach().requires_grad_(True)
    stats = {k: 0.0 for k in STAT_KEYS}
    stats["accept"] = torch.zeros(h.shape[1])
    stats["count"] = torch.zeros(h.shape[1])
    for s in range(0, h.shape[0], chunk_blocks):
        part = slice(s, s + chunk_blocks)
        terms = chunk_terms(hd[part], part)
        chunk_loss(terms).backward()
        for k in STAT_KEYS:
            stats[k] += terms[k].item() if torch.is_tensor(terms[k]) else terms[k]
        stats["accept"] += terms["accept"]
        stats["count"] += terms["count"]
    if hd.grad is not None:
        h.backward(hd.grad)
    return stats


def tau_estimate(accept: torch.Tensor, count: torch.Tensor) -> float:
    """Expected tokens per full-block round from mean per-slot acceptance: 1 + Σ_k Π_{i≤k} ᾱ_i."""
    mean = (accept / count.clamp_min(1)).tolist()
    tau, run = 1.0, 1.0
    for a in mean:
        run *= a
        tau += run
    return tau if math.isfinite(tau) else float("nan")
