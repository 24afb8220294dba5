"""Lossless verification of drafted tokens over a ragged batch (R requests, ℓ_r ≤ γ drafts each).

The rule (Leviathan et al., Chen et al.): draft x_k, drawn from q_k, is kept with probability
min(1, p_k(x_k) / q_k(x_k)); at the first rejection the replacement is drawn from normalize(max(0, p_k − q_k)).
Together the two steps emit exactly one draw from p_k: mass the draft under-proposes is made up by the
residual, mass it over-proposes is thinned by the acceptance test. If all ℓ drafts survive, a bonus token
is drawn from p_{ℓ+1}, which the same verification forward already computed.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from . import native_sample
from .sampling import by_blocks, greedy_tokens, sample_from


@dataclass
class VerifyResult:
    accepted: torch.Tensor  # [R] number of drafts kept
    next_token: torch.Tensor  # [R] replacement or bonus; -1 where an accepted stop token ended the request
    stopped: torch.Tensor  # [R] bool: an accepted draft was a stop token (nothing follows it)

    def emitted(self, draft_tokens: torch.Tensor, r: int) -> list[int]:
        """Tokens request r emits this round: the accepted drafts, then the replacement/bonus if any."""
        out = draft_tokens[r, : int(self.accepted[r])].tolist()
        if not bool(self.stopped[r]):
            out.append(int(self.next_token[r]))
        return out


@dataclass(frozen=True, eq=False)  # compared by identity: tensors have no truth value
class DraftVocab:
    """A drafter's vocabulary inside the target's: draft distributions [..., Vd] whose entry j is target token ids[j]
    (q = 0 on every other token), verified as they are instead of scattered into [..., V] first (a DSpark drafter
    with a 16,384-token head on SmolLM2's 49,152: ~29 µs a slot, 0.8 ms for 4 requests × 7 slots)."""

    ids: torch.Tensor  # [Vd] int64 target ids, distinct
    index: torch.Tensor  # [V] int64: the draft position of each target token, −1 outside

    @staticmethod
    def of(ids: torch.Tensor, vocab: int) -> "DraftVocab":
        ids = ids.to(torch.int64).contiguous()
        index = torch.full((vocab,), -1, dtype=torch.int64).index_copy_(0, ids, torch.arange(len(ids)))
        return DraftVocab(ids, index)

    def full(self, q: torch.Tensor) -> torch.Tensor:
        """[..., Vd] -> [..., V], zeros outside the draft vocabulary (the slow reference)."""
        return q.new_zeros(*q.shape[:-1], self.index.shape[0]).index_copy_(-1, self.ids, q)

    def local(self, tokens: torch.Tensor) -> torch.Tensor:
        """Target ids -> draft positions (a token outside the draft vocabulary, which no draft is, maps to 0)."""
        return self.index[tokens].clamp_(min=0)


def draw_uniforms(generators: list[torch.Generator], num_draft: torch.Tensor, gamma: int) -> torch.Tensor:
    """[R, γ+1] uniforms; request r consumes exactly ℓ_r + 1 draws of its own generator."""
    u = torch.zeros(len(generators), gamma + 1, dtype=torch.float64)
    for r, (g, n) in enumerate(zip(generators, num_draft.tolist())):  # drawn in place: the same stream, no copies
        torch.rand(n + 1, generator=g, dtype=torch.float64, out=u[r, : n + 1])
    return u


def _point_mass(tokens: torch.Tensor, vocab: int) -> torch.Tensor:
    return torch.zeros(*tokens.shape, vocab).scatter_(-1, tokens.unsqueeze(-1), 1.0)


def _stop_mask(tokens: torch.Tensor, stop_ids: torch.Tensor | None) -> torch.Tensor:
    """stop_ids: shared stop tokens [S], or a per-request precomputed bool mask [R, γ]."""
    if stop_ids is not None and stop_ids.dtype == torch.bool:
        return stop_ids
    if stop_ids is None or stop_ids.numel() == 0:
        return torch.zeros_like(tokens, dtype=torch.bool)
    return torch.isin(tokens, stop_ids)


def _stop_rows(tokens: torch.Tensor, stop_ids: torch.Tensor | None) -> list[list[bool]] | None:
    """_stop_mask as lists (None: no stop tokens)."""
    if stop_ids is None or (stop_ids.dtype != torch.bool and stop_ids.numel() == 0):
        return None
    return _stop_mask(tokens, stop_ids).tolist()


def _accepted_runs(ok: list[list[bool]], num_draft: list[int], stops: list[list[bool]] | None
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """([R] drafts kept, [R] stopped): each request's leading run of accepted drafts among its first ℓ_r, cut after
    the first accepted stop token (invariant 4: nothing after it, no bonus). A loop over at most R·γ Python values:
    right after a target forward each small torch call costs 20-80 µs on the Intel dev CPU, and the tensor form of
    the greedy rule (cumprod, isin, where, ...) took 484 µs there (scripts/post_forward_op_cost.py,
    results/post-forward-ops-s48)."""
    accepted, stopped = [], []
    for r, n in enumerate(num_draft):
        a, hit = 0, False
        while a < n and ok[r][a]:
            a += 1
            if stops is not None and stops[r][a - 1]:
                hit = True
                break
        accepted.append(a)
        stopped.append(hit)
    return torch.tensor(accepted, dtype=torch.long), torch.tensor(stopped, dtype=torch.bool)


def verify(draft_tokens: torch.Tensor, draft_probs: torch.Tensor | None, target_probs: torch.Tensor,
           num_draft: torch.Tensor, uniforms: torch.Tensor, stop_ids: torch.Tensor | None = None,
           vocab: DraftVocab | None = None) -> VerifyResult:
    """Stochastic verification.

    draft_tokens: [R, γ]; draft_probs: [R, γ, V] fp32, the exact distributions the drafts were sampled from
    (None = deterministic drafter, i.e. point masses), or [R, γ, Vd] over ``vocab``; target_probs: [R, γ+1, V]
    processed with the same SamplingParams; num_draft: [R] ℓ_r; uniforms: [R, γ+1] (slots 0..ℓ_r-1 test
    acceptance, slot ℓ_r drives the replacement or bonus draw); stop_ids: [S] tokens that end a request.
    """
    R, rows = target_probs.shape[0], target_probs.shape[1]
    # one rule for both layouts: request r's rows are r·(γ+1) .. of the flattened [R·(γ+1), V] (a view when contiguous)
    return verify_rows(draft_tokens, draft_probs, target_probs.reshape(R * rows, -1), [r * rows for r in range(R)],
                       num_draft.tolist(), uniforms, stop_ids, vocab=vocab)


def draw_next(draft_tokens: torch.Tensor, draft_probs: torch.Tensor | None, target_probs: torch.Tensor,
              accepted: torch.Tensor, rejected: torch.Tensor, u_next: torch.Tensor,
              vocab: DraftVocab | None = None) -> torch.Tensor:
    """[R] each request's token after its accepted drafts: from the residual where it rejected one, else the bonus.
    One C call where sample_from would search blocks (native_sample.sample_next: the residual is written and
    searched row by row, nothing gathered; ~10 torch calls fewer at one request), else `_draw_next_reference`,
    which it equals bit for bit (tests/test_native_sample.py)."""
    acc, rej = accepted.tolist(), rejected.tolist()
    s0, s1 = target_probs.stride(0), target_probs.stride(1)
    # the rows' element offsets in Python: a dozen small torch calls cost more here than the draw itself
    tokens = _sample_next(draft_tokens, draft_probs, target_probs, [r * s0 + a * s1 for r, a in enumerate(acc)],
                          list(range(len(acc))), acc, rej, u_next, vocab)
    if tokens is not None:
        return tokens
    full = draft_probs if vocab is None or draft_probs is None else vocab.full(draft_probs)
    return _draw_next_reference(draft_tokens, full, target_probs, accepted, rejected, u_next)


def _sample_next(draft_tokens, draft_probs, probs, p_off: list[int], q_rows: list[int], acc: list[int],
                 rej: list[bool], u_next: torch.Tensor, vocab: DraftVocab | None = None) -> torch.Tensor | None:
    """draw_next's C call: request r's target row at element offset p_off[r] of ``probs``, its draft distributions
    row q_rows[r] of ``draft_probs`` (None where the kernel cannot serve)."""
    if not by_blocks(probs.shape[-1]):
        return None
    if draft_probs is None:  # point masses: the rejected draft token itself
        drafts = draft_tokens.tolist()
        q_off, point = [-1] * len(acc), [drafts[r][a] if j else -1 for r, (a, j) in enumerate(zip(acc, rej))]
    else:
        d0, d1 = draft_probs.stride(0), draft_probs.stride(1)
        q_off = [q_rows[r] * d0 + a * d1 if j else -1 for r, (a, j) in enumerate(zip(acc, rej))]
        point = [-1] * len(acc)
    return native_sample.sample_next(probs, torch.tensor(p_off), draft_probs, torch.tensor(q_off),
                                     torch.tensor(point), u_next, None if vocab is None else vocab.ids)


def _draw_next_reference(draft_tokens, draft_probs, target_probs, accepted, rejected, u_next) -> torch.Tensor:
    """draw_next in torch: the residual rows gathered and computed in full, then one sample_from."""
    return _residual_draw(draft_tokens, draft_probs, _next_rows(target_probs, accepted), accepted, rejected, u_next)


def _residual_draw(draft_tokens, draft_probs, p_next, accepted, rejected, u_next,
                   q_rows: torch.Tensor | None = None) -> torch.Tensor:
    """p_next [R, V]: each request's target row after its accepted drafts (a copy the residual overwrites, or rows
    only read when nothing was rejected); q_rows [R]: each request's row of draft_probs (None: its own)."""
    rej = rejected.nonzero().squeeze(-1)  # [J] the rows that rejected a draft
    if len(rej):
        at = accepted[rej]  # the rejected slot of each
        q_next = (_point_mass(draft_tokens[rej, at], p_next.shape[-1]) if draft_probs is None
                  else draft_probs[rej if q_rows is None else q_rows[rej], at])  # [J, V]
        base = p_next[rej]  # [J, V]
        residual = (base - q_next).clamp_(min=0)
        # p == q leaves no residual mass; rejection then had probability 0, so fall back to p harmlessly.
        empty = residual.amax(-1) <= 0  # [J]
        p_next[rej] = torch.where(empty.unsqueeze(-1), base, residual)
    return sample_from(p_next, u_next)


def verify_rows(draft_tokens: torch.Tensor, draft_probs: torch.Tensor | None, probs: torch.Tensor, first: list[int],
                num_draft: list[int], uniforms: torch.Tensor, stop_ids: torch.Tensor | None = None,
                q_rows: list[int] | None = None, vocab: DraftVocab | None = None) -> VerifyResult:
    """`verify` over one table of target distributions probs [M, V], request r's ℓ_r + 1 rows being probs[first[r]
    : first[r] + ℓ_r + 1]: ragged blocks need no padded [R, γ + 1, V] copy, and requests that verify nothing join
    the same call. draft_tokens [R, w] (w >= max ℓ_r); draft_probs [R_d, ≥w, V] (or [.., Vd] over ``vocab``) or
    None, request r's row q_rows[r] (None: row r); num_draft [R] ℓ_r as ints; uniforms [R, w + 1] (slots 0..ℓ_r-1
    test acceptance; slot ℓ_r, never an acceptance test's, drives the replacement or bonus draw: reusing the
    rejecting slot's uniform would skew the replacement toward late CDF tokens)."""
    R = len(num_draft)
    pairs = [(r, k) for r, n in enumerate(num_draft) for k in range(n)]  # every verified (request, slot)
    if not pairs:  # nothing verified (plain decoding, a skipped step): one draw from each request's only row
        rows = probs if probs.shape[0] == R else probs[torch.tensor(first)]  # one row each: first = 0..R-1
        none = torch.zeros(R, dtype=torch.long)
        return VerifyResult(accepted=none, next_token=sample_from(rows, uniforms[:, 0]), stopped=none.bool())
    r_i, k_i = torch.tensor(pairs).unbind(1)  # [N], [N]
    x = draft_tokens[r_i, k_i]  # [N]
    p_x = probs[torch.tensor([first[r] + k for r, k in pairs]), x].double()
    u = uniforms[r_i, k_i]
    if draft_probs is None:
        flat = (u < p_x).tolist()
    else:
        q_i = r_i if q_rows is None else torch.tensor(q_rows)[r_i]
        q_x = draft_probs[q_i, k_i, x if vocab is None else vocab.local(x)].double()
        # u < p/q written as u·q < p: exact for q = 1 and never accepts a token the target gives zero mass
        flat = (u * q_x < p_x).tolist()
    ok, at = [], 0
    for n in num_draft:
        ok.append(flat[at: at + n])
        at += n
    accepted, stopped = _accepted_runs(ok, num_draft, _stop_rows(draft_tokens, stop_ids))
    acc = accepted.tolist()
    rej = [a < n for a, n in zip(acc, num_draft)]
    u_next = uniforms[torch.arange(R), torch.tensor(num_draft)]
    rows = q_rows if q_rows is not None else list(range(R))
    next_token = _sample_next(draft_tokens, draft_probs, probs, [(f + a) * probs.stride(0) for f, a in zip(first, acc)],
                              rows, acc, rej, u_next, vocab)
    if next_token is None:
        p_next = probs[torch.tensor([f + a for f, a in zip(first, acc)])]  # [R, V] a copy
        full = draft_probs if vocab is None or draft_probs is None else vocab.full(draft_probs)
        next_token = _residual_draw(draft_tokens, full, p_next, accepted, torch.tensor(rej), u_next,
                                    None if q_rows is None else torch.tensor(q_rows))
    next_token = torch.where(stopped, torch.full_like(next_token, -1), next_token)
    return VerifyResult(accepted=accepted, next_token=next_token, stopped=stopped)


def _next_rows(target_probs: torch.Tensor, accepted: torch.Tensor) -> torch.Tensor:
    """[R, V] row accepted[r] of each request's target distributions: a copy, which the residual overwrites, or
    with no drafts verified (one row each, nothing to reject) the rows themselves, which are only read."""
    if target_probs.shape[1] == 1:
        return target_probs[:, 0].contiguous()
    return target_probs[torch.arange(target_probs.shape[0]), accepted]


def verify_greedy(draft_tokens: torch.Tensor, target_logits: torch.Tensor, num_draft: torch.Tensor,
                  stop_ids: torch.Tensor | None = None) -> VerifyResult:
    """Temperature-0 fast path: keep the drafts that equal the target's argmax; the next token is the argmax
    at the first mismatch (or the bonus slot). Equal to `verify` on one-hot p and q (tested).

    draft_tokens: [R, γ]; target_logits: [R, γ+1, V]; num_draft: [R].
    """
    return accept_greedy(draft_tokens, greedy_tokens(target_logits), num_draft, stop_ids)


def accept_greedy(draft_tokens: torch.Tensor, best: torch.Tensor, num_draft: torch.Tensor,
                  stop_ids: torch.Tensor | None = None) -> VerifyResult:
    """`verify_greedy` given the target's argmax tokens best: [R, γ+1] (callers holding ragged logits take each
    request's argmax without first copying them into one padded [R, γ+1, V] buffer)."""
    gamma = draft_tokens.shape[1]
    top = best.tolist()
    ok = (best[:, :gamma] == draft_tokens).tolist() if gamma else [[] for _ in top]
    accepted, stopped = _accepted_runs(ok, num_draft.tolist(), _stop_rows(draft_tokens, stop_ids) if gamma else None)
    next_token = torch.tensor([-1 if hit else row[a] for row, a, hit in zip(top, accepted.tolist(), stopped.tolist())],
                              dtype=torch.long)
    return VerifyResult(accepted=accepted, next_token=next_token, stopped=stopped)
