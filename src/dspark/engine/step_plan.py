"""Plan one engine step: draft, choose verification lengths, and lay every request's tokens end to end."""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np
import torch

from ..decoding.verify import DraftVocab
from ..models.transformer import Segment
from .request import Request, Status


@dataclass
class StepPlan:
    tokens: torch.Tensor  # [N] all tokens of this step's forward
    segments: list[Segment]
    logit_rows: torch.Tensor  # [M] rows of N whose logits are needed
    decoding: list[Request] = field(default_factory=list)
    drafts: torch.Tensor | None = None  # [R, g], g ≤ γ slots drafted
    lengths: torch.Tensor | None = None  # [R] ℓ_r chosen by the policy
    draft_probs: torch.Tensor | None = None  # [R_d, g, V] or None (point masses); [R_d, g, Vd] with draft_vocab
    draft_vocab: DraftVocab | None = None  # the draft vocabulary draft_probs covers (None: the whole one)
    draft_rows: list[int] | None = None  # rows of `decoding` draft_probs belongs to (a probe's few; None: all R)
    confidences: np.ndarray | None = None  # [R, g]
    confidence_logits: np.ndarray | None = None  # [R, g] raw head logits, before calibration (for `calibrate`)
    propose_seconds: float = 0.0  # feeding deferred target states included
    draft_call_seconds: float = 0.0  # the propose() call alone: what the profile's drafting tables price
    drafted_requests: int = 0  # requests the drafter proposed for (fewer than `decoding` on a probe)
    draft_depth: int = 0  # slots it drafted
    decode_logit_rows: list[slice] = field(default_factory=list)  # per decoding request, into the M logits
    decode_token_rows: list[list[int]] = field(default_factory=list)  # per decoding request, into N
    prefilling: list[Request] = field(default_factory=list)
    prefill_token_rows: list[list[int]] = field(default_factory=list)
    prefill_logit_rows: list[int | None] = field(default_factory=list)  # into M; None = prompt not done
    prefill_prompt_rows: list[range | None] = field(default_factory=list)  # into M: every row of the chunk, for
    # a request that asked for prompt log-probabilities (row j predicts the prompt token after chunk token j)

    @property
    def verified_tokens(self) -> int:
        return int(self.lengths.sum()) + len(self.decoding) if self.decoding else 0


def _undrafted(decoding: list[Request], gamma: int, seconds: float = 0.0) -> StepPlan:
    """A plan whose requests verify no drafts this step."""
    R = len(decoding)
    return StepPlan(tokens=torch.empty(0), segments=[], logit_rows=torch.empty(0), decoding=decoding,
                    drafts=torch.zeros(R, gamma, dtype=torch.long), lengths=torch.zeros(R, dtype=torch.long),
                    propose_seconds=seconds)


def _draft(decoding: list[Request], drafter, policy, gamma: int, max_position: int, before_draft,
           backlog) -> StepPlan:
    """The step's drafting half: drafts, chosen lengths and what the drafter reported (tokens not laid out yet)."""
    R = len(decoding)
    if R == 0:  # nothing to draft for; stateful policies must not record an empty step
        return _undrafted(decoding, gamma)
    if drafter is None or not _prepare(policy, decoding):
        policy.select(None, n_requests=R, gamma=gamma)  # keeps stateful policies in step
        return _undrafted(decoding, gamma)
    t0 = time.perf_counter()
    rows = _rows_to_draft(decoding, policy, backlog)
    subset = decoding if rows is None else [decoding[i] for i in rows]
    if before_draft is not None:  # the engine feeds deferred target states (engine/draft_feed.py)
        before_draft(subset)
        decoding = [r for r in decoding if not r.finished]  # a failed feed fails its requests only
        subset = [r for r in subset if not r.finished]
        if not subset:  # nothing left to draft for: the others verify no drafts this step
            return _undrafted(decoding, gamma, time.perf_counter() - t0)
        if rows is not None:
            position = {id(r): i for i, r in enumerate(decoding)}
            rows = [position[id(r)] for r in subset]
    # A policy that caps ℓ (fixed-K) says so, and the drafter drafts no more than that.
    depth = policy.draft_depth(gamma) if hasattr(policy, "draft_depth") else gamma
    t_call = time.perf_counter()
    proposal = drafter.propose([r.draft for r in subset], depth=depth)
    now = time.perf_counter()
    tokens, num, probs, conf, raw = _widen(proposal, rows, len(decoding))
    extra = {} if rows is None else {"drafted": rows}
    chosen = torch.as_tensor(np.asarray(policy.select(conf, n_requests=len(decoding), gamma=gamma, **extra)),
                             dtype=torch.long)
    room = torch.tensor([min(r.params.max_new_tokens - len(r.output), max_position - r.num_tokens) - 1
                         for r in decoding])  # tokens a round may add beyond the anchor
    lengths = torch.minimum(torch.minimum(chosen, num), room.clamp(min=0))
    return StepPlan(tokens=torch.empty(0), segments=[], logit_rows=torch.empty(0), decoding=decoding,
                    drafts=tokens[:, :gamma], lengths=lengths, draft_probs=probs, draft_vocab=proposal.vocab,
                    draft_rows=rows, confidences=conf,
                    confidence_logits=None if raw is None else raw[:, :gamma],
                    propose_seconds=now - t0,  # feeding included: it is the drafter's model work
                    draft_call_seconds=now - t_call, drafted_requests=len(subset), draft_depth=depth)


def _prepare(policy, decoding: list[Request]) -> bool:
    """policy.prepare: should the drafter run? A policy that prices context (each verified token attends to its
    request's whole context) gets the requests' mean; it is known before drafting, from committed tokens only, so
    the decision stays lossless."""
    if getattr(policy, "prices_context", False):
        return policy.prepare(len(decoding), context=sum(r.num_tokens for r in decoding) / len(decoding))
    return policy.prepare(len(decoding))


def _rows_to_draft(decoding: list[Request], policy, backlog) -> list[int] | None:
    """Indices of the requests to draft for (None: all). A probing policy may ask for fewer (AsyncPolicy: a probe
    under load drafts one request, not all); the cheapest are taken — fewest target states still to feed the
    drafter — which depends only on past steps, so the choice stays lossless."""
    want = policy.requests_to_draft(len(decoding)) if hasattr(policy, "requests_to_draft") else len(decoding)
    if want >= len(decoding):
        return None
    cost = backlog or (lambda r: 0)
    return sorted(sorted(range(len(decoding)), key=lambda i: cost(decoding[i]))[:want])


def _widen(proposal, rows: list[int] | None, n: int):
    """The proposal of a subset of requests laid out over all n: rows not drafted get 0 drafts, confidence 0
    (never admitted) and NaN raw confidence logits (never used for calibration: they verify nothing). The draft
    distributions stay those of the subset (``StepPlan.draft_rows`` says whose): laid out over all n they were a
    [n, γ, V] buffer of zeros (22 MB at 16 requests). With verification's split (decoding/batch.py) a probe's
    planning cost 9.5 ms over a skipped step's instead of 13.3 at 16 requests, 9.7 instead of 19.6 at 32 (bf16,
    T = 1; scripts/probe_step_cost.py, results/probe-cost-s42)."""
    conf = None if proposal.confidences is None else proposal.confidences.double().numpy()
    raw = getattr(proposal, "confidence_logits", None)
    raw = None if raw is None else raw.double().numpy()
    if rows is None:
        return proposal.tokens, proposal.num_tokens, proposal.probs, conf, raw
    idx = torch.tensor(rows)
    tokens = proposal.tokens.new_zeros(n, proposal.tokens.shape[1])
    tokens[idx] = proposal.tokens
    num = proposal.num_tokens.new_zeros(n)
    num[idx] = proposal.num_tokens
    probs = proposal.probs
    if conf is not None:
        conf_full = np.zeros((n, conf.shape[1]))
        conf_full[rows] = conf
        conf = conf_full
    if raw is not None:
        raw_full = np.full((n, raw.shape[1]), np.nan)
        raw_full[rows] = raw
        raw = raw_full
    return tokens, num, probs, conf, raw


def plan_step(running: list[Request], drafter, policy, config, max_position: int, before_draft=None,
              backlog=None) -> StepPlan:
    """before_draft(requests) runs only when the drafter will propose this step, for the requests it drafts;
    backlog(request) = its target states not yet fed to the drafter (what drafting it first would cost)."""
    decoding = [r for r in running if r.status is Status.DECODE]
    prefilling = [r for r in running if r.status is Status.PREFILL and r.prefix_state != "waiting"]
    plan = _draft(decoding, drafter, policy, config.gamma, max_position, before_draft, backlog)
    pieces, segments, logit_rows = [], plan.segments, []
    n = 0
    for i, req in enumerate(plan.decoding):
        block = [req.output[-1], *plan.drafts[i, : int(plan.lengths[i])].tolist()]  # anchor, then ℓ drafts
        segments.append(Segment(req.cache, req.num_tokens - 1, len(block)))
        pieces.append(block)
        plan.decode_logit_rows.append(slice(len(logit_rows), len(logit_rows) + len(block)))
        plan.decode_token_rows.append(list(range(n, n + len(block))))
        logit_rows += range(n, n + len(block))
        n += len(block)
    budget = config.prefill_chunk
    for req in prefilling:
        take = min(len(req.prompt) - req.prefilled, budget)
        if take <= 0:
            continue
        budget -= take
        segments.append(Segment(req.cache, req.prefilled, take))
        pieces.append(req.prompt[req.prefilled: req.prefilled + take])
        plan.prefilling.append(req)
        plan.prefill_token_rows.append(list(range(n, n + take)))
        done = req.prefilled + take == len(req.prompt)
        scores = req.params.prompt_logprobs is not None  # every row's logits; the last is also the first token's
        first = len(logit_rows)
        if scores:
            logit_rows += range(n, n + take)
        elif done:
            logit_rows.append(n + take - 1)
        plan.prefill_prompt_rows.append(range(first, first + take) if scores else None)
        plan.prefill_logit_rows.append(len(logit_rows) - 1 if done else None)
        n += take
    plan.tokens = torch.tensor([t for p in pieces for t in p], dtype=torch.long)
    plan.logit_rows = torch.tensor(logit_rows, dtype=torch.long)
    return plan
