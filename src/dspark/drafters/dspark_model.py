"""The DSpark drafter network (also DFlash, which is the same backbone without the sequential/confidence heads).

Context: the hidden states of m target layers at each committed position, fused by Linear(m·d → d) + RMSNorm.
Backbone: N target-style decoder layers over one block of γ slots per anchor, input [anchor, MASK × (γ−1)]
embedded with the frozen target embedding. Each layer's attention takes queries from the block only and
keys/values from [context ; block] (KV injection: the same k/v projections applied to the fused context
features), RoPE at absolute positions (context at its own positions, slot k at anchor_pos + k). A block sees
the context strictly before its anchor and itself bidirectionally. Slot k predicts the token at anchor_pos+k+1.

Training and inference share every function here; only the layout differs ([G groups, A blocks] with G
sequences of a packed batch, or G requests with A = 1 at inference).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from ..models.layers import RotaryTable, apply_rotary, rms_norm
from ..models.transformer import Transformer
from .dspark_attention import block_attention
from .dspark_heads import ConfidenceHead, make_sequential_head
from .draft_kernels import attached, linear
from .frozen_target import DraftVocabMixin, FrozenTarget


def default_layer_ids(num_target_layers: int, count: int = 5) -> tuple[int, ...]:
    """`count` layers evenly spread from layer 1 to L−3 (DeepSpec's choice), clipped for very shallow targets."""
    lo = min(1, num_target_layers - 1)
    hi = max(lo, num_target_layers - 3)
    ids = {round(lo + i * (hi - lo) / max(count - 1, 1)) for i in range(count)}
    return tuple(sorted(ids))


@dataclass(frozen=True)
class DrafterArch:
    """What defines a drafter network, beyond the dimensions it inherits from its target."""

    drafter_type: str = "dspark"  # "dspark" | "dflash"
    layer_ids: tuple[int, ...] = ()  # target layers fused into the context features
    num_layers: int = 1  # draft decoder layers
    block_size: int = 7  # γ slots per block
    mask_token_id: int = 0
    head: str = "markov"  # "markov" | "rnn" | "none"
    rank: int = 64
    confidence: bool = True
    intermediate_size: int = 0  # 0 = the target's
    draft_vocab: int = 0  # > 0: the LM head covers only this many target tokens (see DraftVocabMixin)

    def to_dict(self) -> dict:
        return {**asdict(self), "layer_ids": list(self.layer_ids)}

    @staticmethod
    def from_dict(raw: dict) -> "DrafterArch":
        known = set(DrafterArch.__dataclass_fields__)
        unknown = set(raw) - known
        if unknown:
            raise ValueError(f"unknown drafter architecture fields {sorted(unknown)}; known: {sorted(known)}")
        return DrafterArch(**{**raw, "layer_ids": tuple(int(i) for i in raw.get("layer_ids", ()))})


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # the target's norm: one C call at inference (native_norm.py), torch's composite under autograd
        return rms_norm(x.reshape(-1, x.shape[-1]), self.weight, self.eps).view(x.shape)


class DraftLayer(nn.Module):
    """One target-style decoder layer whose attention injects the context K/V (see module docstring)."""

    def __init__(self, cfg, intermediate: int):
        super().__init__()
        d, hd = cfg.hidden_size, cfg.head_dim
        self.heads, self.kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, hd
        self.scale = cfg.query_scale or hd ** -0.5
        self.attn_norm, self.ffn_norm = RMSNorm(d, cfg.rms_eps), RMSNorm(d, cfg.rms_eps)
        self.qkv = nn.Linear(d, (cfg.num_heads + 2 * cfg.num_kv_heads) * hd, bias=cfg.attention_bias)
        self.o = nn.Linear(cfg.num_heads * hd, d, bias=False)
        self.gate_up = nn.Linear(d, 2 * intermediate, bias=False)
        self.down = nn.Linear(intermediate, d, bias=False)
        self.q_norm = RMSNorm(hd, cfg.rms_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(hd, cfg.rms_eps) if cfg.qk_norm else None
        self.post_attn_norm = RMSNorm(d, cfg.rms_eps) if cfg.gemma_norm else None  # Gemma sandwich norms
        self.post_ffn_norm = RMSNorm(d, cfg.rms_eps) if cfg.gemma_norm else None
        self.act = (lambda x: F.gelu(x, approximate="tanh")) if cfg.activation == "gelu_tanh" else F.silu

    def context_kv(self, feats: torch.Tensor, rope) -> tuple[torch.Tensor, torch.Tensor]:
        """feats: [N, d] fused context features -> k, v: [N, kvH, hd], k rotated at the context positions.

        No input norm: the fused features are already RMS-normalised (as in DeepSpec)."""
        n, q_dim, kv_dim = feats.shape[0], self.heads * self.head_dim, self.kv_heads * self.head_dim
        fast = attached(self, "kv")  # draft_kernels.attach: the k and v rows of qkv
        if fast is not None:
            kv = fast(feats)
        else:
            kv = F.linear(feats, self.qkv.weight[q_dim:], None if self.qkv.bias is None else self.qkv.bias[q_dim:])
        k, v = kv.split([kv_dim, kv_dim], dim=-1)
        k, v = k.view(n, self.kv_heads, self.head_dim), v.view(n, self.kv_heads, self.head_dim)
        if self.k_norm is not None:
            k = self.k_norm(k)
        return apply_rotary(k, *rope), v

    def forward(self, x: torch.Tensor, rope, kc, vc, ctx_visible, keep: int | None = None,
                mask_qkv: torch.Tensor | None = None) -> torch.Tensor:
        """x: [G, A, γ, d]; rope: cos/sin [G·A·γ, 1, hd]; kc, vc: [G, T, kvH, hd]; ctx_visible: [G, A, T]
        -> [G, A, keep, d]: the first `keep` slots (default all γ); every slot's keys still take part.
        `mask_qkv` [qkv] (inference, first layer only): the qkv projection of the normed mask-token embedding,
        which every slot after the anchor holds, so only the anchor's row is projected here."""
        G, A, S, d = x.shape
        keep = S if keep is None else keep
        if mask_qkv is None:
            qkv = linear(self, "qkv", self.attn_norm(x).reshape(-1, d)).view(G, A, S, -1)
        else:  # pre-RoPE, a slot's projection depends only on its token: the mask slots' rows are one row
            anchor = linear(self, "qkv", self.attn_norm(x[:, :, :1]).reshape(-1, d)).view(G, A, 1, -1)
            qkv = torch.cat([anchor, mask_qkv.expand(G, A, S - 1, -1)], dim=2)
        q, k, v = qkv.split([self.heads * self.head_dim, self.kv_heads * self.head_dim,
                             self.kv_heads * self.head_dim], dim=-1)
        q = q[:, :, :keep].reshape(G * A * keep, -1, self.head_dim)
        k, v = (t.reshape(G * A * S, -1, self.head_dim) for t in (k, v))
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q_rope = rope if keep == S else tuple(t.view(G * A, S, *t.shape[1:])[:, :keep].reshape(-1, *t.shape[1:])
                                              for t in rope)
        q, k = apply_rotary(q, *q_rope), apply_rotary(k, *rope)
        out = block_attention(q.view(G, A, keep, -1, self.head_dim), k.view(G, A, S, -1, self.head_dim),
                              v.view(G, A, S, -1, self.head_dim), kc, vc, ctx_visible, self.scale)
        h = linear(self, "o", out.reshape(G, A, keep, -1))
        if self.post_attn_norm is not None:
            h = self.post_attn_norm(h)
        x = x[:, :, :keep] + h
        gate, up = linear(self, "gate_up", self.ffn_norm(x)).chunk(2, dim=-1)
        h = linear(self, "down", self.act(gate) * up)
        if self.post_ffn_norm is not None:
            h = self.post_ffn_norm(h)
        return x + h


class DSparkModel(DraftVocabMixin, nn.Module):
    def __init__(self, arch: DrafterArch, target: Transformer):
        super().__init__()
        cfg = target.config
        if not arch.layer_ids or max(arch.layer_ids) >= cfg.num_layers or min(arch.layer_ids) < 0:
            raise ValueError(f"layer_ids {arch.layer_ids} must name layers of the {cfg.num_layers}-layer target")
        self.arch, self.target_config = arch, cfg
        d = cfg.hidden_size
        self.fuse = nn.Linear(len(arch.layer_ids) * d, d, bias=False)  # [m·d -> d]
        self.fuse_norm = RMSNorm(d, cfg.rms_eps)
        inter = arch.intermediate_size or cfg.intermediate_size
        self.layers = nn.ModuleList(DraftLayer(cfg, inter) for _ in range(arch.num_layers))
        self.final_norm = RMSNorm(d, cfg.rms_eps)
        self.head = make_sequential_head(arch.head, cfg.vocab_size, arch.rank, d, arch.draft_vocab or cfg.vocab_size)
        token_dim = self.head.rank if self.head is not None else 0
        self.confidence = ConfidenceHead(d, token_dim) if arch.confidence else None
        # Not registered as parameters or buffers: never trained, never written into the checkpoint.
        self.frozen = FrozenTarget(target.embed, target.lm_head.weight,
                                   float(cfg.hidden_size ** 0.5) if cfg.gemma_norm else None,
                                   cfg.final_logit_softcap,
                                   RotaryTable(cfg.rope, cfg.head_dim, torch.float32, target.embed.device))
        self._init_draft_vocab(arch, cfg.vocab_size)
        self.to(target.embed.device)

    # ------------------------------------------------------------------------------------------------
    def init_from_target(self, target: Transformer) -> list[int]:
        """Copy the last N target layers (and the final norm) into the draft layers where shapes match."""
        copied = []
        src_layers = target.layers[-len(self.layers):]
        with torch.no_grad():
            self.final_norm.weight.copy_(target.final_norm.float())
            for i, (dst, src) in enumerate(zip(self.layers, src_layers)):
                pairs = [(dst.qkv.weight, src.qkv.weight), (dst.o.weight, src.o.weight),
                         (dst.gate_up.weight, src.gate_up.weight), (dst.down.weight, src.down.weight),
                         (dst.attn_norm.weight, src.attn_norm), (dst.ffn_norm.weight, src.ffn_norm)]
                if dst.qkv.bias is not None and src.qkv.bias is not None:
                    pairs.append((dst.qkv.bias, src.qkv.bias))
                for a, b in ((dst.q_norm, src.q_norm), (dst.k_norm, src.k_norm),
                             (dst.post_attn_norm, src.post_attn_norm), (dst.post_ffn_norm, src.post_ffn_norm)):
                    if a is not None and b is not None:
                        pairs.append((a.weight, b))
                if all(a.shape == b.shape for a, b in pairs):
                    for a, b in pairs:
                        a.copy_(b.float())
                    copied.append(len(target.layers) - len(self.layers) + i)
        return copied

    def fuse_features(self, layer_states: torch.Tensor) -> torch.Tensor:
        """layer_states: [N, m, d] (the captured target layers, in layer_ids order) -> [N, d]."""
        return self.fuse_norm(linear(self, "fuse", layer_states.flatten(1).to(self.fuse.weight.dtype)))

    def context_kv(self, feats: torch.Tensor, positions: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """feats: [N, d] fused; positions: [N] -> per draft layer (k, v) [N, kvH, hd]."""
        rope = self.rope(positions)
        return [layer.context_kv(feats, rope) for layer in self.layers]

    def backbone(self, block_ids, anchors, ctx_kv, ctx_visible) -> torch.Tensor:
        """block_ids: [G, A, γ]; anchors: [G, A] anchor positions; ctx_kv: per layer (kc, vc) [G, T, kvH, hd];
        ctx_visible: [G, A, T] -> h: [G, A, γ, d] after the final norm."""
        slots = torch.arange(block_ids.shape[-1], device=block_ids.device)
        rope = self.rope((anchors.unsqueeze(-1) + slots).reshape(-1))
        x = self.embed_block(block_ids)
        for layer, (kc, vc) in zip(self.layers, ctx_kv):
            x = layer(x, rope, kc, vc, ctx_visible)
        return self.final_norm(x)

    def draft_states(self, anchor_ids: torch.Tensor, anchors: torch.Tensor, ctx_kv, ctx_visible,
                     keep: int) -> torch.Tensor:
        """Inference: `backbone` over blocks [anchor, mask, ..., mask] with only what the first `keep` slots
        need. anchor_ids, anchors: [R]; ctx_kv: per layer (kc, vc) [R, T, kvH, hd]; ctx_visible: [R, 1, T]
        -> h [R, keep, d]. Two things are not recomputed: the first layer's qkv of the mask slots (one cached
        row: their input is the same embedding) and, in the last layer, the attention, output projection and
        MLP of slots at or past `keep` (nothing after the last layer reads them). At one request and depth 1
        that leaves one row, not γ, through o, gate_up and down. Up to float rounding where a product's row count
        picks another kernel, this is `backbone(...)[:, 0, :keep]` (tests/drafters/test_dspark_drafter.py)."""
        R, S = anchor_ids.shape[0], self.arch.block_size
        block_ids = torch.full((R, 1, S), self.arch.mask_token_id, dtype=torch.long, device=anchor_ids.device)
        block_ids[:, 0, 0] = anchor_ids
        rope = self.rope((anchors[:, None] + torch.arange(S, device=anchors.device)).reshape(-1))
        x = self.embed_block(block_ids)  # [R, 1, γ, d]
        last = len(self.layers) - 1
        for i, (layer, (kc, vc)) in enumerate(zip(self.layers, ctx_kv)):
            x = layer(x, rope, kc, vc, ctx_visible, keep=keep if i == last else None,
                      mask_qkv=self._mask_qkv() if i == 0 and S > 1 else None)
        return self.final_norm(x)[:, 0]

    def _mask_qkv(self) -> torch.Tensor:
        """The first draft layer's qkv row for the mask token [qkv], cached while its inputs are unchanged."""
        layer = self.layers[0]
        inputs = [t for t in (self.frozen.embed, layer.attn_norm.weight, layer.qkv.weight, layer.qkv.bias)
                  if t is not None]
        key = tuple((t.data_ptr(), t._version, t.dtype) for t in inputs)
        cached = self.__dict__.get("_mask_qkv_cache")
        if cached is None or cached[0] != key:
            with torch.no_grad():
                x = self.embed_block(torch.tensor([self.arch.mask_token_id], device=self.frozen.embed.device))
                cached = (key, linear(layer, "qkv", layer.attn_norm(x)).reshape(-1))
            self.__dict__["_mask_qkv_cache"] = cached  # a plain attribute: not a parameter, buffer or state
        return cached[1]

    def prev_embedding(self, prev: torch.Tensor) -> torch.Tensor | None:
        return self.head.prev_embedding(prev) if self.head is not None else None

    def confidence_logits(self, h: torch.Tensor, prev: torch.Tensor) -> torch.Tensor | None:
        """h: [..., d]; prev: [...] the token before each slot -> raw confidence logits [...]."""
        if self.confidence is None:
            return None
        return self.confidence(h, self.prev_embedding(prev))
