"""Block attention with KV injection, driven by token-level indices instead of a dense mask.

Every block (one anchor) attends to (a) the context keys of its own sequence at positions strictly before its
anchor and (b) the γ keys of its own block, bidirectionally. A packed batch holds G sequences, each with A
blocks; the two key sets are scored separately — [A·γ × T] against the sequence's context, [γ × γ] inside each
block — and share one softmax. Memory is O(G·A·γ·(T + γ)); no [S × S] mask or cross-sequence scores exist.
"""
from __future__ import annotations

import torch


def block_attention(q: torch.Tensor, kb: torch.Tensor, vb: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor,
                    ctx_visible: torch.Tensor, scale: float) -> torch.Tensor:
    """q: [G, A, γq, H, hd], the queries of a block's first γq ≤ γ slots; kb, vb: [G, A, γ, kvH, hd] (block
    keys); kc, vc: [G, T, kvH, hd] (context keys); ctx_visible: [G, A, T] bool (context position t < the block's
    anchor) -> [G, A, γq, H, hd]."""
    G, A, S, H, hd = q.shape
    kv_heads = kb.shape[3]
    rep = H // kv_heads
    # Query heads grouped by the KV head they share (GQA), so K/V are never repeated in memory.
    qg = q.reshape(G, A, S, kv_heads, rep, hd) * scale
    s_ctx = torch.einsum("gaskrd,gtkd->gaskrt", qg, kc)  # [G, A, γ, kvH, rep, T]
    s_ctx = s_ctx.masked_fill(~ctx_visible[:, :, None, None, None, :], float("-inf"))
    s_blk = torch.einsum("gaskrd,gajkd->gaskrj", qg, kb)  # [G, A, γ, kvH, rep, γ]
    # The block keys are always visible, so no row is fully masked (no NaN from the softmax).
    p = torch.cat([s_ctx, s_blk], dim=-1).softmax(dim=-1)
    p_ctx, p_blk = p.split([kc.shape[1], kb.shape[2]], dim=-1)
    out = torch.einsum("gaskrt,gtkd->gaskrd", p_ctx, vc) + torch.einsum("gaskrj,gajkd->gaskrd", p_blk, vb)
    return out.reshape(G, A, S, H, hd)
