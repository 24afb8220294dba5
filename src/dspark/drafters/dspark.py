"""The DSpark drafter at inference: per-request context K/V, one parallel block, left-to-right sampling.

Engine contract (the drafter never runs the target itself, so the target is computed once per token):

* Run every target forward of a request with ``hidden_layers=drafter.needs_layers``.
* After the target commits tokens to its KV cache, hand their captured states to the drafter:
  ``drafter.observe(request, out.hidden, n_committed)`` — rows 0..n_committed−1 of each ``out.hidden[layer]``
  ([n, d]) are the states of the tokens just committed, in order. Prefill: n_committed = prompt length.
  Verification over [anchor, x_1..x_ℓ]: n_committed = accepted + 1 (the anchor and the accepted drafts, i.e.
  exactly what stays in the target cache after ``truncate(start + accepted + 1)``). Chunked prefill: once per
  chunk. A flattened batch: ``observe_batch(requests, out.hidden, offsets, counts)`` with each request's first
  row in the batch and its n_committed.
* ``propose(requests)`` then requires that every committed token was observed, i.e. the drafter's context
  length equals ``len(request.tokens) − 1`` (all tokens except the anchor); otherwise it raises DrafterError.
* ``observe(..., start=p)`` rolls the draft context back to position p before appending (p ≤ current length).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..decoding.sampling import greedy_tokens, sample_from, to_probs
from ..models.transformer import Transformer
from . import markov_draws
from .base import BatchFirstDrafter, DraftRequest, DrafterError, Proposal, register_drafter
from .dspark_checkpoint import load_calibration, load_drafter_model
from .dspark_context import DraftContext
from .dspark_model import DSparkModel
from .draft_kernels import attach as attach_kernels, bf16_c_rows, bf16_is_fast, few_rows_on_bf16_c
from .frozen_target import inference_head

STATE_KEY = "dspark.context"


@dataclass
class DSparkProposal(Proposal):
    confidence_logits: torch.Tensor | None = None  # [R, γ] raw logits of the confidence head


class DSparkDrafter(BatchFirstDrafter):
    name = "dspark"

    def __init__(self, model: DSparkModel, target: Transformer, gamma: int | None = None, calibration=None,
                 bf16: bool | None = None):
        block = model.arch.block_size
        super().__init__(block if gamma is None else gamma)
        if self.gamma > block:
            raise DrafterError(f"gamma={self.gamma} exceeds the drafter's trained block size {block}")
        self.model, self.target, self.calibration = model.eval(), target, calibration
        self.needs_layers = tuple(model.arch.layer_ids)
        self.has_confidence = model.confidence is not None
        self.name = model.arch.drafter_type
        packed = target.lm_head.packed is not None
        # bf16 products for the drafter only (its q; verification keeps the target's fp32): default where the CPU
        # multiplies bf16 natively and the target runs on oneDNN. Asked for where only our bf16 C kernel is fast
        # (AVX2), up to c_rows rows: opt-in, since a request's q then depends on how many rows share its products
        # (fp32 above c_rows), and so do its seeded drafts (draft_kernels.py)
        self.bf16 = (packed and bf16_is_fast()) if bf16 is None else bool(bf16)
        self.c_rows = (bf16_c_rows() if target.lm_head.native else None) if self.bf16 else None
        self.draft_logits = inference_head(model, target, self.bf16, self.c_rows)  # h [.., d] -> logits [.., Vd]
        # the target's CPU kernels for the drafter's own projections too (draft_kernels.py)
        self.kernels = attach_kernels(model, packed=packed, native=target.lm_head.native, bf16=self.bf16,
                                      native_rows=target.lm_head.native_rows, c_rows=self.c_rows)
        # its few-row products through the bf16 C kernel (session 46; draft_kernels.py): a price of its own
        self.bf16_c = few_rows_on_bf16_c(model)

    @property
    def profile_id(self) -> str:
        a = self.model.arch
        return (f"{a.drafter_type}-g{self.gamma}-L{a.num_layers}-{a.head}{a.rank}-v{self.model.draft_vocab_size}"
                f"{'-conf' if a.confidence else ''}{'-k' if self.kernels else ''}"
                f"{'-bf16' if self.bf16 else ''}{'c' if self.bf16_c else ''}"  # kernels and precision: its price
                f"{f'c{self.c_rows}' if self.c_rows else ''}"
                f"{markov_draws.price_tag(self.model)}")

    # ------------------------------------------------------------------------------------------------
    def context(self, request: DraftRequest) -> DraftContext:
        ctx = request.state.get(STATE_KEY)
        if ctx is None:
            layer = self.model.layers[0]
            ctx = request.state[STATE_KEY] = DraftContext(len(self.model.layers), layer.kv_heads, layer.head_dim)
        return ctx

    shares_context = True

    def observed(self, request: DraftRequest) -> int:
        ctx = request.state.get(STATE_KEY)
        return 0 if ctx is None else ctx.length

    def share_context(self, source: DraftRequest, request: DraftRequest, length: int) -> None:
        if length:
            request.state[STATE_KEY] = self.context(source).copy_prefix(length)

    @torch.inference_mode()
    def observe_batch(self, requests: list[DraftRequest], hidden: dict[int, torch.Tensor], offsets: list[int],
                      counts: list[int], starts: list[int] | None = None) -> None:
        """hidden[layer]: [N, d] for a flattened batch; request r owns rows offsets[r] .. offsets[r]+counts[r]−1."""
        if not requests:
            return
        self.require_layers(hidden)
        ctxs = [self.context(r) for r in requests]
        firsts = [c.length if starts is None else int(s) for c, s in zip(ctxs, starts or [None] * len(ctxs))]
        for c, first in zip(ctxs, firsts):
            if not 0 <= first <= c.length:
                raise DrafterError(f"observe(start={first}) would leave a gap after {c.length} observed tokens")
            c.truncate(first)  # a rollback, or a no-op when appending
        rows = torch.cat([torch.arange(o, o + n) for o, n in zip(offsets, counts)])  # [M]
        if rows.numel() == 0:
            return
        states = torch.stack([hidden[i][rows] for i in self.needs_layers], dim=1)  # [M, m, d]
        positions = torch.cat([torch.arange(f, f + n) for f, n in zip(firsts, counts)])  # [M]
        kv = self.model.context_kv(self.model.fuse_features(states.float()), positions)  # per layer [M, kvH, hd]
        at = 0
        for c, first, n in zip(ctxs, firsts, counts):
            c.write(first, [(k[at:at + n], v[at:at + n]) for k, v in kv])
            at += n

    # ------------------------------------------------------------------------------------------------
    @torch.inference_mode()
    def propose(self, requests: list[DraftRequest], depth: int | None = None) -> DSparkProposal:
        h, anchor_ids = self.block_states(requests, depth)
        R, g = h.shape[:2]
        tokens, probs, conf = self.sample_block(h, self.draft_logits(h), anchor_ids, requests)
        vocab = self.model.draft_vocab() if probs is not None and probs.device.type == "cpu" else None
        if probs is not None and vocab is None:
            probs = self.model.scatter_probs(probs)
        return DSparkProposal(tokens=tokens, num_tokens=torch.full((R,), g), probs=probs, vocab=vocab,
                              confidences=self._calibrate(conf), confidence_logits=conf)

    @torch.inference_mode()
    def block_states(self, requests: list[DraftRequest], depth: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The parallel backbone's part of a proposal: each request's block states h [R, g, d] (g = the slots
        drafted) and its anchor token ids [R]."""
        ctxs = [self.context(r) for r in requests]
        for r, c in zip(requests, ctxs):
            if c.length != len(r.tokens) - 1:
                raise DrafterError(f"the request has {len(r.tokens) - 1} committed tokens but the drafter observed "
                                   f"{c.length}: call drafter.observe() after every target forward")
        anchors = torch.tensor([c.length for c in ctxs])  # [R] anchor positions
        anchor_ids = torch.tensor([r.tokens[-1] for r in requests])  # [R]
        ctx_kv, visible = DraftContext.batch(ctxs, anchors)  # per layer [R, T, kvH, hd]; [R, 1, T]
        g = self.slots(depth)  # the backbone still sees the whole block: slot k's state does not depend on g
        return self.model.draft_states(anchor_ids, anchors, ctx_kv, visible, keep=g), anchor_ids  # [R, g, d]; [R]

    def sample_block(self, h: torch.Tensor, base: torch.Tensor, prev: torch.Tensor, requests):
        """Left to right: slot k's logits = U_k + head bias(x_{k−1}), x_{k−1} the token actually drawn.
        h: [R, γ, d]; base: [R, γ, Vd] -> tokens [R, γ], probs [R, γ, Vd] fp32 over the draft vocabulary (None
        when every request is greedy), confidence logits [R, γ]."""
        R, gamma, V = base.shape
        model, head = self.model, self.model.head
        tokens = torch.empty(R, gamma + 1, dtype=torch.long)  # column 0: the anchor, the token before slot 1
        tokens[:, 0] = prev
        probs = slot_probs(requests, gamma, V)
        if markov_draws.applies(model, base, requests):  # the loop below in one C call (markov_draws.py)
            tokens[:, 1:] = markov_draws.draw_block(model, base, prev, requests, probs)
        else:
            state = head.init_state((R,), h) if head is not None else None
            for k in range(gamma):
                logits = base[:, k]
                if head is not None:
                    state, bias = head.step(state, prev, h[:, k])
                    logits = logits + bias
                tokens[:, k + 1] = prev = model.to_full(draw(logits, requests, probs, k))
        # Slot k's confidence reads h_k and the token drawn before it, both known once the block is drawn, and
        # nothing sampled reads it: one product over the block instead of γ one-row ones (~0.8 ms at one request).
        conf = model.confidence_logits(h, tokens[:, :gamma])  # [R, γ] or None
        return tokens[:, 1:].contiguous(), probs, conf

    @staticmethod
    def _process(logits: torch.Tensor, requests) -> torch.Tensor:
        """Per-request temperature/min-p/top-k/top-p (invariant 2), batched over requests that process alike
        (different seeds included: to_probs gives a row the same bits whatever shares its call)."""
        groups: dict = {}
        for i, r in enumerate(requests):
            groups.setdefault(r.params.processing, []).append(i)
        if len(groups) == 1:
            return to_probs(logits, requests[0].params)
        out = torch.empty_like(logits, dtype=torch.float32)
        for rows in groups.values():
            out[rows] = to_probs(logits[rows], requests[rows[0]].params)
        return out

    @staticmethod
    def _uniforms(requests) -> torch.Tensor:
        # Greedy slots are one-hot, so any uniform picks the argmax; don't spend the request's randomness.
        u = torch.full((len(requests),), 0.5, dtype=torch.float64)
        for i, r in enumerate(requests):
            if not r.params.greedy:
                torch.rand(1, generator=r.generator, dtype=torch.float64, out=u[i: i + 1])  # in place, same stream
        return u

    def _calibrate(self, logits: torch.Tensor | None) -> torch.Tensor | None:
        if logits is None:
            return None
        if self.calibration is None:
            return logits.sigmoid()
        return self.calibration.apply(logits)  # [R, γ]: the first γ positions when run below the block size


def slot_probs(requests: list[DraftRequest], gamma: int, vocab: int) -> torch.Tensor | None:
    """The buffer for each slot's sampling distribution [R, γ, V] fp32; None when every request is greedy: a
    greedy slot's distribution is the point mass on its argmax (to_probs's one-hot), which verification takes
    as `probs=None`, so the full-vocabulary vectors need not be written at all."""
    if all(r.params.greedy for r in requests):
        return None
    return torch.empty(len(requests), gamma, vocab, dtype=torch.float32)


def draw(logits: torch.Tensor, requests: list[DraftRequest], probs: torch.Tensor | None, k: int) -> torch.Tensor:
    """Slot k's draft-vocabulary tokens [R] from fp32 logits [R, Vd], storing its distribution in probs[:, k]."""
    if probs is None:  # all greedy: the argmax, first index on ties, exactly as to_probs's one-hot
        return greedy_tokens(logits)
    probs[:, k] = DSparkDrafter._process(logits, requests)
    # Invariant 1: the token is drawn from exactly the fp32 vector handed to verification (scattered into the
    # full vocabulary afterwards, which changes no probability).
    return sample_from(probs[:, k], DSparkDrafter._uniforms(requests))


def _transformer(target) -> Transformer:
    for candidate in (target, getattr(target, "model", None)):
        if isinstance(candidate, Transformer):
            return candidate
    raise DrafterError(f"a DSpark/DFlash drafter needs the target Transformer (or a LoadedModel / "
                       f"TransformerTarget holding one), got {type(target).__name__}")


def load_dspark(path, target, gamma: int | None = None, strict_target: bool = True,
                calibration: bool = True, bf16: bool | None = None) -> DSparkDrafter:
    """Load a `dspark` or `dflash` checkpoint directory for `target`; calibration.json is used when present.
    `bf16`: the drafter's products in bf16 (None: where the CPU multiplies bf16 natively)."""
    model_target = _transformer(target)
    model, _ = load_drafter_model(path, model_target, strict_target)
    cal = load_calibration(path, model.arch.block_size) if calibration else None
    return DSparkDrafter(model, model_target, gamma, cal, bf16)


@register_drafter("checkpoint:dspark")
def _load_dspark_checkpoint(path, target=None, gamma: int | None = None, **options) -> DSparkDrafter:
    return load_dspark(path, target, gamma, **options)
