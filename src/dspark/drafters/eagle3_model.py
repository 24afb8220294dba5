"""The EAGLE-3 baseline network: one autoregressive decoder layer over fused target features.

Notation: x_t is the token at position t; f_t ∈ R^{m×d} the captured states of the m target layers `layer_ids`
at t (they predict x_{t+1}); g_t = fuse(f_t) ∈ R^d with fuse = Linear(m·d → d) (EAGLE-3's fc, no norm).

Alignment. Each draft row pairs a feature with the token that FOLLOWS its position:
    context entry t (committed tokens, t = 0..a−1):    u_t = [emb(x_{t+1}) ; g_t]       at RoPE position t
A chain from anchor a (x_a: the last emitted token, not yet in the target cache; the context ends at a−1):
    step 1:           u = [emb(x_a) ; g_{a−1}]      (= context entry a−1)   position a−1   q_1 predicts x_{a+1}
    step k = 2..γ:    u = [emb(x_{a+k−1}) ; h_{k−1}]                        position a+k−2  q_k predicts x_{a+k}
h_k ∈ R^d is the layer output BEFORE the final norm; it replaces g as the feature of the next step (EAGLE-3's
"own hidden state", which training-time test trains for). q_k = softmax(LM_head(final_norm(h_k))) in fp32 with
the frozen target head. Step k attends to context entries 0..a−1 (its own step 1 is entry a−1) and to the K/V of
the chain's steps 2..k; no other chain. So slot j = k−1 predicts x_{a+j+1}: the anchor/slot convention of
packing.py (a target distribution p at position a+j), which lets training reuse its anchors and batches.

The layer (shapes for N rows): e = RMSNorm_e(emb) [N, d], z = RMSNorm_g(feature) [N, d];
qkv = Linear(2d → (H + 2·kvH)·hd) of [e ; z] (GQA and RoPE like the target, optional q/k norms);
x = feature + o(attention) [N, d] (the residual stream is the feature); h = x + MLP(RMSNorm(x)).
"""
from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from ..models.layers import RotaryTable, activation, apply_rotary
from ..models.transformer import Transformer
from .dspark_model import DrafterArch, RMSNorm
from .frozen_target import DraftVocabMixin, FrozenTarget


class Eagle3Layer(nn.Module):
    def __init__(self, cfg, intermediate: int):
        super().__init__()
        d, hd = cfg.hidden_size, cfg.head_dim
        self.heads, self.kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, hd
        self.scale = cfg.query_scale or hd ** -0.5
        self.embed_norm, self.feat_norm, self.ffn_norm = (RMSNorm(d, cfg.rms_eps) for _ in range(3))
        self.qkv = nn.Linear(2 * d, (cfg.num_heads + 2 * cfg.num_kv_heads) * hd, bias=cfg.attention_bias)
        self.o = nn.Linear(cfg.num_heads * hd, d, bias=False)
        self.gate_up = nn.Linear(d, 2 * intermediate, bias=False)
        self.down = nn.Linear(intermediate, d, bias=False)
        self.q_norm = RMSNorm(hd, cfg.rms_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(hd, cfg.rms_eps) if cfg.qk_norm else None
        self.act = activation(cfg.activation)

    def project(self, emb: torch.Tensor, feat: torch.Tensor, rope, with_q: bool = True):
        """emb, feat: [N, d]; rope: cos/sin [N, 1, hd] -> (q [N, H, hd] or None, k, v [N, kvH, hd]); q, k rotated."""
        x = torch.cat([self.embed_norm(emb), self.feat_norm(feat)], dim=-1)  # [N, 2d]
        q_dim, kv_dim = self.heads * self.head_dim, self.kv_heads * self.head_dim
        if with_q:
            q, k, v = self.qkv(x).split([q_dim, kv_dim, kv_dim], dim=-1)
        else:  # context rows need only K/V
            bias = None if self.qkv.bias is None else self.qkv.bias[q_dim:]
            (k, v), q = F.linear(x, self.qkv.weight[q_dim:], bias).split([kv_dim, kv_dim], dim=-1), None
        k, v = k.reshape(-1, self.kv_heads, self.head_dim), v.reshape(-1, self.kv_heads, self.head_dim)
        if self.k_norm is not None:
            k = self.k_norm(k)
        if q is not None:
            q = q.reshape(-1, self.heads, self.head_dim)
            q = apply_rotary(self.q_norm(q) if self.q_norm is not None else q, *rope)
        return q, apply_rotary(k, *rope), v

    def finish(self, feat: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        """feat: [N, d] (the residual input); attn: [N, H·hd] -> h [N, d], before the final norm."""
        x = feat + self.o(attn)
        gate, up = self.gate_up(self.ffn_norm(x)).chunk(2, dim=-1)
        return x + self.down(self.act(gate) * up)


def chain_attention(q, kc, vc, visible, kb, vb, scale: float) -> torch.Tensor:
    """One chain step per block. q: [G, A, H, hd]; kc, vc: [G, T, kvH, hd] context; visible: [G, A, T] bool;
    kb, vb: [G, A, J, kvH, hd] this chain's steps 2..k (J ≥ 0, all visible) -> [G, A, H, hd]. Scores are
    [G, A, H, T + J]: token-level, no [S × S] mask. A row must see at least one key (entry a−1)."""
    G, A, H, hd = q.shape
    kv_heads = kc.shape[2]
    qg = q.reshape(G, A, kv_heads, H // kv_heads, hd) * scale  # query heads grouped by their KV head (GQA)
    s_ctx = torch.einsum("gakrd,gtkd->gakrt", qg, kc).masked_fill(~visible[:, :, None, None, :], float("-inf"))
    s_blk = torch.einsum("gakrd,gajkd->gakrj", qg, kb)
    p_ctx, p_blk = torch.cat([s_ctx, s_blk], dim=-1).softmax(dim=-1).split([kc.shape[1], kb.shape[2]], dim=-1)
    out = torch.einsum("gakrt,gtkd->gakrd", p_ctx, vc) + torch.einsum("gakrj,gajkd->gakrd", p_blk, vb)
    return out.reshape(G, A, H, hd)


class Eagle3Model(DraftVocabMixin, nn.Module):
    """Parameters: fuse, layer, final_norm. Embedding, LM head and RoPE are the target's (frozen, not saved)."""

    def __init__(self, arch: DrafterArch, target: Transformer):
        super().__init__()
        cfg = target.config
        if not arch.layer_ids or max(arch.layer_ids) >= cfg.num_layers or min(arch.layer_ids) < 0:
            raise ValueError(f"layer_ids {arch.layer_ids} must name layers of the {cfg.num_layers}-layer target")
        if arch.drafter_type != "eagle3" or arch.num_layers != 1 or arch.head != "none" or arch.confidence:
            raise ValueError(f"an Eagle3 drafter has drafter_type 'eagle3', one layer, no head and no confidence "
                             f"head; got {arch}")
        self.arch, self.target_config = arch, cfg
        d = cfg.hidden_size
        self.fuse = nn.Linear(len(arch.layer_ids) * d, d, bias=False)  # [m·d -> d]
        self.layer = Eagle3Layer(cfg, arch.intermediate_size or cfg.intermediate_size)
        self.final_norm = RMSNorm(d, cfg.rms_eps)
        self.frozen = FrozenTarget(target.embed, target.lm_head.weight,
                                   float(d ** 0.5) if cfg.gemma_norm else None, cfg.final_logit_softcap,
                                   RotaryTable(cfg.rope, cfg.head_dim, torch.float32, target.embed.device))
        self._init_draft_vocab(arch, cfg.vocab_size)
        self.to(target.embed.device)

    def init_from_target(self, target: Transformer) -> list[int]:
        """Copy the target's last layer where shapes allow: o, MLP, FFN norm, and its attention norm + qkv into
        the feature half of our [emb ; feature] qkv (the embedding half keeps its random init); the final norm."""
        src = target.layers[-1]
        dst, d = self.layer, self.target_config.hidden_size
        with torch.no_grad():
            self.final_norm.weight.copy_(target.final_norm.float())
            pairs = [(dst.o.weight, src.o.weight), (dst.gate_up.weight, src.gate_up.weight),
                     (dst.down.weight, src.down.weight), (dst.ffn_norm.weight, src.ffn_norm),
                     (dst.feat_norm.weight, src.attn_norm), (dst.qkv.weight[:, d:], src.qkv.weight)]
            if not all(a.shape == b.shape for a, b in pairs):
                return []
            for a, b in pairs:
                a.copy_(b.float())
        return [len(target.layers) - 1]

    def fuse_features(self, layer_states: torch.Tensor) -> torch.Tensor:
        """layer_states: [N, m, d] (in layer_ids order) -> g: [N, d]."""
        return self.fuse(layer_states.flatten(1).to(self.fuse.weight.dtype))

    def context_kv(self, feats: torch.Tensor, next_ids: torch.Tensor, positions: torch.Tensor):
        """Context entries. feats: [N, d] g_t; next_ids: [N] x_{t+1}; positions: [N] t -> k, v [N, kvH, hd]."""
        _, k, v = self.layer.project(self.embed_block(next_ids), feats, self.rope(positions), with_q=False)
        return k, v

    def chain(self, ids: torch.Tensor, feat: torch.Tensor, pos: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor,
              visible: torch.Tensor, steps: int, emit: Callable[[int, torch.Tensor], torch.Tensor | None]):
        """Run `steps` chain steps for G×A blocks. ids: [G, A] x_a; feat: [G, A, d] g_{a−1}; pos: [G, A] a−1;
        kc, vc: [G, T, kvH, hd] context entries; visible: [G, A, T] (entry t < a).
        emit(j, final-normed h_j [G, A, d]) returns the ids of step j+1 (teacher-forced in training, sampled at
        inference). -> final-normed h [G, A, steps, d]."""
        G, A, d = feat.shape
        layer = self.layer
        kb = kc.new_zeros(G, A, 0, layer.kv_heads, layer.head_dim)
        vb = kb
        out = []
        for j in range(steps):
            q, k, v = layer.project(self.embed_block(ids).reshape(-1, d), feat.reshape(-1, d),
                                    self.rope((pos + j).reshape(-1)))
            if j > 0:  # step 1's K/V is context entry a−1 already
                kb = torch.cat([kb, k.view(G, A, 1, *k.shape[1:])], dim=2)
                vb = torch.cat([vb, v.view(G, A, 1, *v.shape[1:])], dim=2)
            attn = chain_attention(q.view(G, A, *q.shape[1:]), kc, vc, visible, kb, vb, layer.scale)
            feat = layer.finish(feat.reshape(-1, d), attn.reshape(G * A, -1)).view(G, A, d)
            out.append(self.final_norm(feat))
            ids = emit(j, out[-1])
        return torch.stack(out, dim=2)
