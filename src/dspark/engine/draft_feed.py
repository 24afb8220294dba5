"""Deferred drafter feeding: committed tokens' target states wait on their request until the drafter next runs.

A model drafter (DSpark, DFlash, Eagle3) must have seen the fused target features of every committed token
before it drafts. Feeding them after every forward costs one small batched projection per step even on steps
where the policy skips the drafter — the asynchronous scheduler under load, or `none` with a drafter loaded —
and that cost alone kept async at 0.94–0.97× no speculation at concurrency ≤ 4 on the dev CPU. So the rows are
copied out of the forward's hidden states and fed in one batched call just before the next proposal: the same
arithmetic, once per drafting step instead of once per step. A request holding `max_pending_bytes` of
pending states (32 MiB) is fed at once, so a long stretch without drafting costs bounded memory: 2,900 rows for
SmolLM2-135M (five 576-wide fp32 layers), 800 for a 4096-wide bf16 target — and never more rows than the request
has KV positions, i.e. at most 25 % on top of its KV cache for SmolLM2-135M. The bound was 64 rows, then 256: under
load the async scheduler drafts only for its probes, so a request's prompt (often longer than 256 tokens) was fed
at once and then mostly never drafted from (drafter share of async's step time at C = 8 on the dev CPU: 1.1 % →
0.6 %, results/serving-s11-probe → serving-s11-final); rows of a request that finishes before the drafter next runs
are dropped unfed.
Feeding order and content are unchanged, so the drafter's context is the same as with eager feeding.
"""
from __future__ import annotations

from collections.abc import Callable

import torch

from .request import Request

ON_ERROR = Callable[[Request, Exception], None]


class DraftFeed:
    def __init__(self, drafter, max_pending_bytes: int = 32 * 2**20, max_pending: int | None = None):
        self.drafter = drafter
        self.layers = tuple(drafter.needs_layers) if drafter is not None else ()
        self.max_pending_bytes = max_pending_bytes
        self.max_pending = max_pending  # rows; None: as many as fit in max_pending_bytes
        self.pending: dict[str, list[torch.Tensor]] = {}  # request id -> chunks [n, m, d], in position order
        self.held: dict[str, int] = {}  # request id -> rows pending

    @property
    def active(self) -> bool:
        return bool(self.layers)

    def stash(self, observed: list[tuple[Request, int, int]], hidden: dict[int, torch.Tensor],
              on_error: ON_ERROR) -> None:
        """observed: (request, first row, count) of the tokens each request committed in this forward."""
        rows = torch.cat([torch.arange(first, first + n) for _, first, n in observed])  # [M] rows of the forward
        states = torch.stack([hidden[layer][rows] for layer in self.layers], dim=1)  # [M, m, d]: one copy
        row_bytes = states[0].numel() * states.element_size()
        full, limit = [], self.max_pending or max(1, self.max_pending_bytes // row_bytes)
        for (req, _, n), chunk in zip(observed, states.split([n for _, _, n in observed])):
            self.pending.setdefault(req.request_id, []).append(chunk)
            self.held[req.request_id] = self.held.get(req.request_id, 0) + n
            if self.held[req.request_id] >= limit:
                full.append(req)
        self.flush(full, on_error)

    def flush(self, requests: list[Request], on_error: ON_ERROR) -> None:
        """Feed the drafter every pending row of these requests in one batched call."""
        todo = [r for r in requests if r.request_id in self.pending]
        if not todo:
            return
        chunks = [torch.cat(self.pending.pop(r.request_id)) for r in todo]  # per request [n_r, m, d]
        for r in todo:
            del self.held[r.request_id]
        states = torch.cat(chunks)  # [M, m, d]
        counts = [c.shape[0] for c in chunks]
        offsets = [sum(counts[:i]) for i in range(len(counts))]
        try:
            self.drafter.observe_batch([r.draft for r in todo], {layer: states[:, j] for j, layer in
                                                                 enumerate(self.layers)}, offsets, counts)
        except Exception as exc:  # a drafter failure fails the requests it was feeding, not the engine
            for req in todo:
                on_error(req, exc)

    def backlog(self, request: Request) -> int:
        """Rows this request would have fed before it can draft."""
        return self.held.get(request.request_id, 0)

    def drop(self, request: Request) -> None:
        self.pending.pop(request.request_id, None)
        self.held.pop(request.request_id, None)
