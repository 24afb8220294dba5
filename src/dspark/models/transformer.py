"""Our own decoder forward for the Llama, Qwen3 and Gemma3 families.

One call runs a *flattened* ragged batch: the new tokens of many requests laid end to end, each request a
`Segment` (its KV cache, the position of its first new token, how many tokens). Linear layers run once over
all N tokens (projections fused: qkv, gate+up, since per-call overhead dominates on CPU at small N);
attention runs per segment against that request's cache — short segments (decode, verification) in one C call
per layer where the native kernel is usable (models/native_attention.py), the rest one torch call each, which
stays the reference. The HF classes are the reference in tests only.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import torch
import torch.nn.functional as F

from . import native_attention
from .config import ModelConfig
from .kv_cache import KVCache
from .layers import Projection, RotaryTable, activation, apply_rotary, rms_norm


@dataclass
class Segment:
    """The new tokens of one request inside a flattened batch: positions start .. start+length-1. cache=None: a
    whole sequence from position 0 whose keys are not kept (training features): see `_DensePlan`."""

    cache: KVCache | None
    start: int
    length: int


@dataclass
class _DensePlan:
    """Cache-less segments attend as one padded batch: row r of the flat batch sits at `index[r]` of a
    [B·S] layout (each sequence from its own row 0, padding after it), so one attention call per layer serves
    them all. Right padding needs no padding mask: a causal query never sees a key after it."""
    index: torch.Tensor  # [N]
    batch: int
    width: int
    masks: dict  # window -> [S, S] bool (None: plain causal, through the fused kernel's is_causal)


@dataclass
class ForwardOutput:
    logits: torch.Tensor | None  # [M, V] fp32, for the requested rows
    hidden: dict[int, torch.Tensor] = field(default_factory=dict)  # layer -> [N, d], before the final norm
    stacked: torch.Tensor | None = None  # [N, m, d]: the hidden_layers in the order asked for (hidden's views)
    final_hidden: torch.Tensor | None = None  # [M, d], after the final norm (what the LM head sees)


@dataclass
class _AttentionPlan:
    """Who attends how in one forward: the native kernel's segment table (None: no kernel segments) and the
    segments left to torch, each with its first row and its key view per attention window."""
    native: torch.Tensor | None
    loop: list[tuple[int, Segment, dict]]
    dense: _DensePlan | None = None


@dataclass
class LayerWeights:
    attn_norm: torch.Tensor
    qkv: Projection  # W: [(H + 2·kvH)·hd, d]
    o: Projection  # W: [d, H·hd]
    ffn_norm: torch.Tensor
    gate_up: Projection  # W: [2·I, d]
    down: Projection  # W: [d, I]
    q_norm: torch.Tensor | None = None
    k_norm: torch.Tensor | None = None
    post_attn_norm: torch.Tensor | None = None  # Gemma3 sandwich norms
    post_ffn_norm: torch.Tensor | None = None


class Transformer:
    def __init__(self, config: ModelConfig, embed: torch.Tensor, layers: list[LayerWeights],
                 final_norm: torch.Tensor, lm_head: Projection):
        self.config = config
        self.embed = embed  # [V, d]
        self.layers = layers
        self.final_norm = final_norm
        self.lm_head = lm_head  # W: [V, d]; the same tensor as embed when tied
        self.dtype, self.device = embed.dtype, embed.device
        hd = config.head_dim
        self.rope = RotaryTable(config.rope, hd, self.dtype, self.device)
        self.rope_local = (RotaryTable(config.rope_local, hd, self.dtype, self.device) if config.rope_local
                           else self.rope)
        self.act = activation(config.activation)
        self.embed_scale = (torch.tensor(config.hidden_size ** 0.5, dtype=self.dtype, device=self.device)
                            if config.gemma_norm else None)
        # A switch, not a constant: benchmarks and tests compare the two attention paths on one model.
        self.native_attention = native_attention.usable(self.dtype, self.device)

    # ----------------------------------------------------------------------------------------------
    def new_cache(self, capacity: int = 256) -> KVCache:
        c = self.config
        return KVCache(c.num_layers, c.num_kv_heads, c.head_dim, self.dtype,
                       capacity=min(capacity, c.max_position), max_capacity=c.max_position, device=self.device)

    def embed_tokens(self, tokens: torch.Tensor) -> torch.Tensor:
        x = F.embedding(tokens, self.embed)
        return x * self.embed_scale if self.embed_scale is not None else x

    def lm_logits(self, final_hidden: torch.Tensor) -> torch.Tensor:
        """final_hidden: [M, d] (already normed) -> fp32 logits [M, V]."""
        logits = self.lm_head(final_hidden).float()
        cap = self.config.final_logit_softcap
        return torch.tanh(logits / cap) * cap if cap else logits

    @torch.inference_mode()
    def forward(self, tokens: torch.Tensor, segments: Sequence[Segment],
                logit_rows: torch.Tensor | None = None, hidden_layers: Sequence[int] = (),
                return_final_hidden: bool = False) -> ForwardOutput:
        """tokens: [N] ids; segments cover them in order. logit_rows: [M] indices into N (None = all)."""
        n_total = sum(s.length for s in segments)
        if n_total != tokens.shape[0]:
            raise ValueError(f"segments cover {n_total} tokens but {tokens.shape[0]} were given")
        top = max((s.start + s.length - 1 for s in segments), default=0)
        positions = torch.cat([torch.arange(s.start, s.start + s.length) for s in segments]).to(self.device)  # [N]
        if top >= self.config.max_position:
            raise ValueError(f"position {top} is beyond the context window of {self.config.max_position}")
        cacheless = [s.cache is None for s in segments]
        if any(cacheless) and not (all(cacheless) and all(s.start == 0 for s in segments)):
            raise ValueError("segments without a cache must all be whole sequences (start 0), and alone in a call")
        for s in segments:
            if s.cache is not None:
                s.cache.begin_write(s.start, s.length)
        rope_global = self.rope.lookup(positions, top)
        rope_local = self.rope_local.lookup(positions, top) if self.rope_local is not self.rope else rope_global
        slot = {layer: j for j, layer in enumerate(dict.fromkeys(hidden_layers))}
        if any(not 0 <= layer < len(self.layers) for layer in slot):  # the buffer's slot would stay unwritten
            raise ValueError(f"hidden layers {list(slot)} asked of a {len(self.layers)}-layer model")
        plan = self._plan_dense(segments) if any(cacheless) else self._plan_attention(segments)
        x = self.embed_tokens(tokens.to(self.device))  # [N, d]
        # captured layers are copied into one buffer as they pass, so x's memory is reused, not held
        stacked = x.new_empty(x.shape[0], len(slot), x.shape[1]) if slot else None  # [N, m, d]
        for i, layer in enumerate(self.layers):
            rope = rope_local if self.config.is_sliding(i) else rope_global
            x = self._layer(i, layer, x, rope, plan)
            if i in slot:
                stacked[:, slot[i]].copy_(x)
        hidden = {layer: stacked[:, j] for layer, j in slot.items()}
        rows = x if logit_rows is None else x[logit_rows.to(self.device)]
        final = rms_norm(rows, self.final_norm, self.config.rms_eps)
        return ForwardOutput(logits=self.lm_logits(final), hidden=hidden, stacked=stacked,
                             final_hidden=final if return_final_hidden else None)

    # ----------------------------------------------------------------------------------------------
    def _window(self, index: int) -> int | None:
        return self.config.sliding_window if self.config.is_sliding(index) else None

    def _plan_attention(self, segments: Sequence[Segment]) -> _AttentionPlan:
        rows = [0]
        for s in segments[:-1]:
            rows.append(rows[-1] + s.length)
        limit = native_attention.max_queries(self.dtype)
        short = [self.native_attention and s.length <= limit for s in segments]
        native = [(r, s) for r, s, fast in zip(rows, segments, short) if fast]
        table = (native_attention.segment_table([s.cache for _, s in native], [r for r, _ in native],
                                                [s.start for _, s in native], [s.length for _, s in native])
                 if native else None)
        # A segment's key range and mask depend only on its window, not on the layer: build them once per
        # forward, not once per layer (a few small ops per segment × 30 layers was ~1.3 ms per request per step).
        windows = {self._window(i) for i in range(len(self.layers))}
        loop = [(r, s, {w: self._key_view(s, w) for w in windows})
                for r, s, fast in zip(rows, segments, short) if not fast]
        return _AttentionPlan(table, loop)

    def _plan_dense(self, segments: Sequence[Segment]) -> _AttentionPlan:
        width = max(s.length for s in segments)
        index = torch.cat([torch.arange(s.length) + b * width for b, s in enumerate(segments)]).to(self.device)
        # Every sequence starts at 0, so the longest one's key view (causal, and the window's band) serves all;
        # soft-capped attention has no is_causal, so it takes the causal mask too.
        whole = Segment(None, 0, width)
        explicit = bool(self.config.attn_logit_softcap)
        masks = {w: self._key_view(whole, w)[1] if (w or explicit) else None
                 for w in {self._window(i) for i in range(len(self.layers))}}
        return _AttentionPlan(None, [], _DensePlan(index, len(segments), width, masks))

    def _dense_attention(self, index: int, q, k, v, plan: _DensePlan) -> torch.Tensor:
        """q: [N, H, hd]; k, v: [N, kvH, hd] -> [N, H, hd]: one padded attention call for every sequence."""
        def padded(t):  # [N, h, hd] -> [B, h, S, hd]
            out = t.new_zeros(plan.batch * plan.width, *t.shape[1:])
            out[plan.index] = t
            return out.view(plan.batch, plan.width, *t.shape[1:]).transpose(1, 2)

        qp, kp, vp = padded(q), padded(k), padded(v)
        mask = plan.masks[self._window(index)]
        if self.config.attn_logit_softcap:
            o = self._softcapped_attention(qp, kp, vp, mask)
        else:
            o = F.scaled_dot_product_attention(qp, kp, vp, attn_mask=mask, is_causal=mask is None,
                                               scale=self.config.query_scale, enable_gqa=True)
        return o.transpose(1, 2).reshape(plan.batch * plan.width, *q.shape[1:])[plan.index]

    def _key_view(self, seg: Segment, window: int | None) -> tuple[int, torch.Tensor | None]:
        """(first cache position any query of this segment can see, boolean mask [n, T] or None if none needed).
        Keys older than the window can never be seen by any query of the segment, so they are sliced off."""
        end = seg.start + seg.length
        first = max(0, seg.start - window + 1) if window else 0
        if seg.length == 1 and not (window and end - first > window):
            return first, None
        q_pos = torch.arange(seg.start, end, device=self.device).unsqueeze(1)  # [n, 1]
        k_pos = torch.arange(first, end, device=self.device).unsqueeze(0)  # [1, T]
        mask = k_pos <= q_pos
        if window:
            mask &= k_pos > q_pos - window
        return first, mask

    def _layer(self, index: int, w: LayerWeights, x: torch.Tensor, rope, plan: _AttentionPlan) -> torch.Tensor:
        # In-place where the tensor is ours alone (fewer allocations: per-op overhead dominates at small N): x is
        # the forward's running state (captured layers are copied out), so both residual adds go into it.
        eps = self.config.rms_eps
        h = self._attention(index, w, rms_norm(x, w.attn_norm, eps), rope, plan)
        if w.post_attn_norm is not None:
            h = rms_norm(h, w.post_attn_norm, eps)
        x.add_(h)
        gate, up = w.gate_up(rms_norm(x, w.ffn_norm, eps)).chunk(2, dim=-1)
        h = w.down(self.act(gate).mul_(up))
        if w.post_ffn_norm is not None:
            h = rms_norm(h, w.post_ffn_norm, eps)
        return x.add_(h)

    def _attention(self, index: int, w: LayerWeights, x: torch.Tensor, rope, plan: _AttentionPlan) -> torch.Tensor:
        c = self.config
        n, hd = x.shape[0], c.head_dim
        qkv = w.qkv(x).view(n, c.num_heads + 2 * c.num_kv_heads, hd)
        heads = c.num_heads + c.num_kv_heads
        v = qkv[:, heads:]
        cos, sin = rope
        if w.q_norm is None:  # q and k are adjacent heads: one rotary pass over both
            qk = apply_rotary(qkv[:, :heads], cos, sin)
            q, k = qk[:, :c.num_heads], qk[:, c.num_heads:]
        else:
            q = apply_rotary(rms_norm(qkv[:, :c.num_heads], w.q_norm, c.rms_eps), cos, sin)
            k = apply_rotary(rms_norm(qkv[:, c.num_heads:heads], w.k_norm, c.rms_eps), cos, sin)
        if plan.dense is not None:
            return w.o(self._dense_attention(index, q, k, v, plan.dense).reshape(n, c.num_heads * hd))
        window = self._window(index)
        if plan.native is None and len(plan.loop) == 1:  # one request in torch: no gather buffer, no copies
            _, seg, views = plan.loop[0]
            out = self._segment_attention(index, q, k, v, seg, views[window])
            return w.o(out.reshape(n, c.num_heads * hd))
        out = torch.empty(n, c.num_heads, hd, dtype=x.dtype, device=x.device)  # [N, H, hd]
        if plan.native is not None:
            native_attention.attend(native_attention.kernel(), q, k, v, out, plan.native, index, window,
                                    c.query_scale or hd ** -0.5, c.attn_logit_softcap)
        for first, seg, views in plan.loop:
            rows = slice(first, first + seg.length)
            out[rows] = self._segment_attention(index, q[rows], k[rows], v[rows], seg, views[window])
        return w.o(out.view(n, c.num_heads * hd))

    def _segment_attention(self, index: int, q, k, v, seg: Segment, view) -> torch.Tensor:
        """q: [n, H, hd]; k, v: [n, kvH, hd] -> [n, H, hd], attending to this request's cache."""
        end = seg.start + seg.length
        seg.cache.k[index, :, seg.start:end] = k.transpose(0, 1)
        seg.cache.v[index, :, seg.start:end] = v.transpose(0, 1)
        first, mask = view
        keys = seg.cache.k[index, :, first:end].unsqueeze(0)  # [1, kvH, T, hd]
        values = seg.cache.v[index, :, first:end].unsqueeze(0)
        if seg.length == 1 and not self.config.attn_logit_softcap:
            return self._one_query_attention(q, keys, values, mask)
        qh = q.transpose(0, 1).unsqueeze(0)  # [1, H, n, hd]
        if self.config.attn_logit_softcap:
            o = self._softcapped_attention(qh, keys, values, mask)
        else:
            o = F.scaled_dot_product_attention(qh, keys, values, attn_mask=mask, scale=self.config.query_scale,
                                               enable_gqa=True)
        return o[0].transpose(0, 1)

    def _one_query_attention(self, q, keys, values, mask) -> torch.Tensor:
        """q: [1, H, hd]; keys, values: [1, kvH, T, hd] -> [1, H, hd]. One query's H heads are kvH groups of H / kvH
        heads that read the same keys and share its one mask row, so they attend as rows of their kv head: torch's
        CPU attention takes a slow path for a single bf16 query with grouped heads (140 µs against 31 µs a layer
        for SmolLM2 at 256 keys, a one-token bf16 step 23.2 -> 19.9 ms: scripts/one_query_attention_cost.py). Used
        where our C kernel is not (no compiler, fp16)."""
        c = self.config
        group = c.num_heads // c.num_kv_heads
        qg = q.view(c.num_kv_heads, group, c.head_dim).unsqueeze(0)  # [1, kvH, H / kvH, hd]
        o = F.scaled_dot_product_attention(qg, keys, values, attn_mask=mask, scale=c.query_scale)
        return o.reshape(1, c.num_heads, c.head_dim)

    def _softcapped_attention(self, q, k, v, mask):
        c = self.config
        groups = c.num_heads // c.num_kv_heads
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        scale = c.query_scale or c.head_dim ** -0.5
        scores = torch.tanh(q @ k.transpose(-1, -2) * scale / c.attn_logit_softcap) * c.attn_logit_softcap
        if mask is not None:
            scores = scores.masked_fill(~mask, float("-inf"))
        return scores.softmax(-1) @ v
