"""The EAGLE-3 baseline drafter at inference: a chain of γ autoregressive steps per round (see eagle3_model).

Engine contract: the same as DSpark's (module doc of dspark.py): targets run with hidden_layers=needs_layers,
`observe`/`observe_batch` receive the committed tokens' states, `start=p` rolls back, and `propose` requires
every committed token to be observed (len(tokens) − 1 of them).

Per-request state: the fused features g_t of every observed position, and a draft KV cache (DraftContext, one
layer) of the context entries t = 0..L−1. Entry t needs x_{t+1}, which may not be known when t is observed (the
last committed row pairs with the token sampled after it), so entries are projected lazily at `propose`, when
request.tokens holds every committed token plus the anchor; then the cache covers 0..n−1 and entry n−1 is the
chain's step 1. A rollback to p drops features ≥ p and entries ≥ p−1 (entry p−1 depends on x_p). The chain's
own K/V (steps 2..γ) live only inside `propose` and are discarded.
"""
from __future__ import annotations

import torch

from ..models.transformer import Transformer
from .base import BatchFirstDrafter, DraftRequest, DrafterError, Proposal, register_drafter
from .dspark import _transformer, draw, slot_probs
from .dspark_checkpoint import load_drafter_model
from .dspark_context import DraftContext
from .draft_kernels import bf16_is_fast
from .eagle3_model import Eagle3Model
from .frozen_target import inference_head

STATE_KEY = "eagle3.state"


class _Features:
    """Growable [capacity, d] rows with a length pointer (O(1) rollback)."""

    def __init__(self, dim: int, capacity: int = 256):
        self.rows, self.length = torch.empty(capacity, dim), 0

    def write(self, start: int, rows: torch.Tensor) -> None:
        end = start + rows.shape[0]
        if end > self.rows.shape[0]:
            grown = self.rows.new_empty(max(end, 2 * self.rows.shape[0]), self.rows.shape[1])
            grown[: self.length] = self.rows[: self.length]
            self.rows = grown
        self.rows[start:end] = rows
        self.length = end


class Eagle3Drafter(BatchFirstDrafter):
    name = "eagle3"

    def __init__(self, model: Eagle3Model, target: Transformer, gamma: int | None = None, bf16: bool | None = None):
        # The chain is autoregressive, so γ may exceed the trained TTT steps (quality then degrades).
        super().__init__(model.arch.block_size if gamma is None else gamma)
        self.model, self.target = model.eval(), target
        self.needs_layers = tuple(model.arch.layer_ids)
        # the LM head in bf16 by the same rule as DSpark's (draft_kernels.py), so that comparisons stay fair
        self.bf16 = (target.lm_head.packed is not None and bf16_is_fast()) if bf16 is None else bool(bf16)
        self.draft_logits = inference_head(model, target, self.bf16)  # h [..., d] -> fp32 logits [..., Vd]

    @property
    def profile_id(self) -> str:
        return f"{super().profile_id}{'-bf16' if self.bf16 else ''}"

    def _state(self, request: DraftRequest) -> tuple[_Features, DraftContext]:
        state = request.state.get(STATE_KEY)
        if state is None:
            layer = self.model.layer
            state = request.state[STATE_KEY] = (_Features(self.model.target_config.hidden_size),
                                                DraftContext(1, layer.kv_heads, layer.head_dim))
        return state

    shares_context = True

    def observed(self, request: DraftRequest) -> int:
        state = request.state.get(STATE_KEY)
        return 0 if state is None else state[0].length

    def share_context(self, source: DraftRequest, request: DraftRequest, length: int) -> None:
        if not length:
            return
        feats, ctx = self._state(source)
        if length > feats.length:
            raise DrafterError(f"cannot share {length} positions of a context holding {feats.length}")
        mine = _Features(feats.rows.shape[1], capacity=length)
        mine.write(0, feats.rows[:length])
        # context entry t pairs g_t with token t + 1, which the two requests share only below `length`
        request.state[STATE_KEY] = (mine, ctx.copy_prefix(min(ctx.length, length - 1)))

    @torch.inference_mode()
    def observe_batch(self, requests: list[DraftRequest], hidden: dict[int, torch.Tensor], offsets: list[int],
                      counts: list[int], starts: list[int] | None = None) -> None:
        """hidden[layer]: [N, d]; request r owns rows offsets[r] .. offsets[r] + counts[r] − 1."""
        if not requests:
            return
        self.require_layers(hidden)
        states = [self._state(r) for r in requests]
        firsts = []
        for (feats, ctx), start in zip(states, starts or [None] * len(states)):
            first = feats.length if start is None else int(start)
            if not 0 <= first <= feats.length:
                raise DrafterError(f"observe(start={first}) would leave a gap after {feats.length} observed tokens")
            if start is not None:  # a rollback: tokens from `first` on may change
                feats.length = first
                ctx.truncate(min(ctx.length, max(first - 1, 0)))
            firsts.append(first)
        rows = torch.cat([torch.arange(o, o + n) for o, n in zip(offsets, counts)])  # [M]
        if rows.numel() == 0:
            return
        layer_states = torch.stack([hidden[i][rows] for i in self.needs_layers], dim=1)  # [M, m, d]
        g = self.model.fuse_features(layer_states.float()).float()  # [M, d]
        at = 0
        for (feats, _), first, n in zip(states, firsts, counts):
            feats.write(first, g[at: at + n])
            at += n

    @torch.inference_mode()
    def _catch_up(self, requests: list[DraftRequest], states) -> None:
        """Project the pending context entries t = ctx.length .. n−1 (g_t with x_{t+1}) of every request."""
        todo = [(r, f, c, c.length) for r, (f, c) in zip(requests, states) if c.length < f.length]
        if not todo:
            return
        feats = torch.cat([f.rows[lo: f.length] for _, f, _, lo in todo])  # [M, d]
        next_ids = torch.tensor([t for r, f, _, lo in todo for t in r.tokens[lo + 1: f.length + 1]])  # [M]
        positions = torch.cat([torch.arange(lo, f.length) for _, f, _, lo in todo])  # [M]
        k, v = self.model.context_kv(feats.to(self.model.fuse.weight.dtype), next_ids, positions)
        at = 0
        for _, f, c, lo in todo:
            n = f.length - lo
            c.write(lo, [(k[at: at + n], v[at: at + n])])
            at += n

    @torch.inference_mode()
    def propose(self, requests: list[DraftRequest], depth: int | None = None) -> Proposal:
        states = [self._state(r) for r in requests]
        for r, (feats, _) in zip(requests, states):
            if feats.length < 1:
                raise DrafterError("an Eagle3 drafter needs the target states of at least one committed token")
            if feats.length != len(r.tokens) - 1:
                raise DrafterError(f"the request has {len(r.tokens) - 1} committed tokens but the drafter observed "
                                   f"{feats.length}: call drafter.observe() after every target forward")
        self._catch_up(requests, states)
        R, gamma = len(requests), self.slots(depth)
        anchors = torch.tensor([f.length for f, _ in states])  # [R] = n: entries 0..n−1 visible
        ids = torch.tensor([r.tokens[-1] for r in requests])[:, None]  # [R, 1] x_n
        feat = torch.stack([f.rows[f.length - 1] for f, _ in states])[:, None].to(self.model.fuse.weight.dtype)
        ctx_kv, visible = DraftContext.batch([c for _, c in states], anchors)  # [(kc, vc)] [R, T, kvH, hd]; [R, 1, T]
        kc, vc = ctx_kv[0]
        tokens = torch.empty(R, gamma, dtype=torch.long)
        model = self.model
        probs = slot_probs(requests, gamma, model.draft_vocab_size)

        def emit(j: int, h: torch.Tensor) -> torch.Tensor:
            tokens[:, j] = model.to_full(draw(self.draft_logits(h[:, 0]), requests, probs, j))  # logits [R, Vd]
            return tokens[:, j: j + 1]

        model.chain(ids, feat, (anchors - 1)[:, None], kc, vc, visible, gamma, emit)
        return Proposal(tokens=tokens, num_tokens=torch.full((R,), gamma),
                        probs=None if probs is None else model.scatter_probs(probs))


def load_eagle3(path, target, gamma: int | None = None, strict_target: bool = True,
                calibration: bool = True, bf16: bool | None = None) -> Eagle3Drafter:
    """Load an `eagle3` checkpoint directory for `target` (`calibration` is accepted and unused: no confidences;
    `bf16`: its LM head in bf16, None: where the CPU multiplies bf16 natively)."""
    model_target = _transformer(target)
    try:
        model, _ = load_drafter_model(path, model_target, strict_target, model_cls=Eagle3Model)
    except ValueError as exc:
        if isinstance(exc, DrafterError):
            raise
        raise DrafterError(f"{path}: invalid Eagle3 architecture ({exc})") from None
    return Eagle3Drafter(model, model_target, gamma, bf16=bf16)


@register_drafter("checkpoint:eagle3")
def _load_eagle3_checkpoint(path, target=None, gamma: int | None = None, **options) -> Eagle3Drafter:
    return load_eagle3(path, target, gamma, **options)
