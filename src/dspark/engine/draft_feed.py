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

Stashing is cheap because it does not copy: the forward writes its captured layers into one [N, m, d] tensor,
and a step whose rows are all committed — a prefill, or a step that verified no drafts, i.e. every step while the
drafter is skipped — is kept as views of that tensor; only a step with rejected drafts gathers its committed
rows. The per-request copies this replaced cost 181 µs a decode step at C = 32 on the dev CPU, 0.5 % of a step
the async scheduler pays under load and plain decoding does not; now 19 µs (scripts/feed_cost.py,
results/feed-cost-s23). A view keeps its whole step alive,
rows of finished requests included, so a request's chunks are copied into one after ``compact_every`` (64)
steps: what is held beyond the pending rows themselves is bounded by the last 64 steps' states. Only the views
since the last compaction are copied, never the chunks earlier compactions made: copying everything again
made a request that went hundreds of steps without drafting copy its whole history every 64 steps, quadratic
in its length (drafter loaded but never drafting, C = 32, 400-token answers: the stash's mean time a step 140 →
76 µs; scripts/feed_cost.py --never-draft, results/feed-cost-s25).
Feeding order and content are unchanged, so the drafter's context is the same as with eager feeding.
"""
from __future__ import annotations

from collections.abc import Callable

import torch

from .request import Request

ON_ERROR = Callable[[Request, Exception], None]


class DraftFeed:
    def __init__(self, drafter, max_pending_bytes: int = 32 * 2**20, max_pending: int | None = None,
                 compact_every: int = 64):
        self.drafter = drafter
        self.layers = tuple(dict.fromkeys(drafter.needs_layers)) if drafter is not None else ()
        self.max_pending_bytes = max_pending_bytes
        self.max_pending = max_pending  # rows; None: as many as fit in max_pending_bytes
        self.compact_every = compact_every  # chunks a request holds before they are copied into one
        # request id -> chunks (states [M, m, d] of one step, first row, rows), in position order
        self.pending: dict[str, list[tuple[torch.Tensor, int, int]]] = {}
        self.held: dict[str, int] = {}  # request id -> rows pending
        self.settled: dict[str, int] = {}  # request id -> leading chunks made by compaction (never copied again)

    @property
    def active(self) -> bool:
        return bool(self.layers)

    def stash(self, observed: list[tuple[Request, int, int]], hidden: dict[int, torch.Tensor],
              on_error: ON_ERROR, stacked: torch.Tensor | None = None) -> None:
        """observed: (request, first row, count) of the tokens each request committed in this forward;
        stacked: the forward's captured layers as one [N, m, d] tensor in ``layers`` order, if it has one."""
        states = self._committed_states(observed, hidden, stacked)  # [M, m, d], requests' rows end to end
        row_bytes = states[0].numel() * states.element_size()
        full, limit = [], self.max_pending or max(1, self.max_pending_bytes // row_bytes)
        at = 0
        for req, _, n in observed:
            chunks = self.pending.setdefault(req.request_id, [])
            chunks.append((states, at, n))
            at += n
            settled = self.settled.get(req.request_id, 0)
            if len(chunks) - settled >= self.compact_every:  # its views would keep that many steps' states alive
                views = chunks[settled:]
                chunks[settled:] = [(self._gather(views), 0, sum(c[2] for c in views))]
                self.settled[req.request_id] = settled + 1
            self.held[req.request_id] = self.held.get(req.request_id, 0) + n
            if self.held[req.request_id] >= limit:
                full.append(req)
        self.flush(full, on_error)

    def _committed_states(self, observed, hidden, stacked) -> torch.Tensor:
        """The committed rows' states; no copy when they are all the forward's rows in order (a step that
        verified no drafts, or a prefill), which is every step while the drafter is skipped."""
        if stacked is None or tuple(hidden) != self.layers:
            stacked = torch.stack([hidden[layer] for layer in self.layers], dim=1)  # [N, m, d]
        at, whole = 0, True
        for _, first, n in observed:
            whole, at = whole and first == at, at + n
        if whole and at == stacked.shape[0]:
            return stacked
        rows = torch.tensor([r for _, first, n in observed for r in range(first, first + n)])  # [M]
        return stacked.index_select(0, rows)

    @staticmethod
    def _gather(chunks: list[tuple[torch.Tensor, int, int]]) -> torch.Tensor:
        return torch.cat([states.narrow(0, first, n) for states, first, n in chunks])

    def flush(self, requests: list[Request], on_error: ON_ERROR) -> None:
        """Feed the drafter every pending row of these requests in one batched call."""
        todo = [r for r in requests if r.request_id in self.pending]
        if not todo:
            return
        counts = [self.held.pop(r.request_id) for r in todo]
        for r in todo:
            self.settled.pop(r.request_id, None)
        states = self._gather([c for r in todo for c in self.pending.pop(r.request_id)])  # [M, m, d]
        offsets = [sum(counts[:i]) for i in range(len(counts))]
        try:
            self.drafter.observe_batch([r.draft for r in todo], {layer: states[:, j] for j, layer in
                                                                 enumerate(self.layers)}, offsets, counts)
        except Exception as exc:  # a drafter failure fails the requests it was feeding, not the engine
            for req in todo:
                on_error(req, exc)

    def share(self, source: Request, request: Request, count: int) -> None:
        """Give `request` the first `count` pending rows of `source` (a shared prompt prefix), as views."""
        if count > self.held.get(source.request_id, 0):
            raise ValueError(f"{source.request_id} has {self.held.get(source.request_id, 0)} pending rows, "
                             f"not {count}")
        chunks, left = [], count
        for states, first, n in self.pending.get(source.request_id, []):
            if left <= 0:
                break
            chunks.append((states, first, min(n, left)))
            left -= n
        if chunks:
            self.pending[request.request_id], self.held[request.request_id] = chunks, count

    def compact(self, request: Request) -> None:
        """Copy a request's pending rows into one tensor, so they stop keeping whole steps' states alive (a
        finished request kept as a prefix donor)."""
        chunks = self.pending.get(request.request_id)
        whole = chunks is not None and len(chunks) == 1 and chunks[0][2] == chunks[0][0].shape[0]
        if chunks and not whole:
            self.pending[request.request_id] = [(self._gather(chunks), 0, self.held[request.request_id])]
            self.settled[request.request_id] = 1

    def backlog(self, request: Request) -> int:
        """Rows this request would have fed before it can draft."""
        return self.held.get(request.request_id, 0)

    def drop(self, request: Request) -> None:
        for table in (self.pending, self.held, self.settled):
            table.pop(request.request_id, None)
