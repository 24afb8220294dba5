"""Verification of a ragged batch whose requests each carry their own sampling parameters and generator."""
from __future__ import annotations

import torch

from .sampling import SamplingParams, to_probs
from .verify import VerifyResult, accept_greedy, draw_uniforms, verify


def verify_requests(logits: list[torch.Tensor], drafts: torch.Tensor, num_draft: torch.Tensor,
                    draft_probs: torch.Tensor | None, params: list[SamplingParams],
                    generators: list[torch.Generator], stop_mask: torch.Tensor) -> VerifyResult:
    """logits[r]: [ℓ_r+1, V] target rows of request r; drafts: [R, γ]; num_draft: [R]; draft_probs: [R, γ, V]
    or None; stop_mask: [R, γ] bool (draft k of request r is one of r's stop tokens).

    Greedy requests take the argmax fast path; the rest are processed with their own parameters (the same
    ones their drafts were processed with) and verified together. Buffers are only as wide as the longest
    verified block of the group, not γ + 1: at 32 requests with nothing drafted, a [R, γ + 1, V] buffer was
    zeroed and scanned for every step (~9 % of a step on the dev CPU with a 49,152-token vocabulary).
    """
    R = drafts.shape[0]
    vocab = logits[0].shape[-1]
    accepted = torch.zeros(R, dtype=torch.long)
    next_token = torch.zeros(R, dtype=torch.long)
    stopped = torch.zeros(R, dtype=torch.bool)
    greedy = [r for r in range(R) if params[r].greedy]
    sampled = [r for r in range(R) if not params[r].greedy]
    for group, is_greedy in ((greedy, True), (sampled, False)):
        if not group:
            continue
        idx = torch.tensor(group)
        width = int(num_draft[idx].max())  # drafts any request of the group verifies; slots beyond are unused
        draft, stops = drafts[idx, :width], stop_mask[idx, :width]
        if is_greedy:
            best = torch.zeros(len(group), width + 1, dtype=torch.long)  # [G, width+1] target argmax tokens
            for i, r in enumerate(group):
                best[i, : logits[r].shape[0]] = logits[r].argmax(-1)
            res = accept_greedy(draft, best, num_draft[idx], stops)
        else:
            rows = torch.zeros(len(group), width + 1, vocab)  # [G, width+1, V], zero beyond each ℓ_r + 1
            for i, r in enumerate(group):
                block = to_probs(logits[r], params[r])
                rows[i, : block.shape[0]] = block
            uniforms = draw_uniforms([generators[r] for r in group], num_draft[idx], width)
            q = None if draft_probs is None else draft_probs[idx, :width]
            res = verify(draft, q, rows, num_draft[idx], uniforms, stops)
        accepted[idx], next_token[idx], stopped[idx] = res.accepted, res.next_token, res.stopped
    return VerifyResult(accepted=accepted, next_token=next_token, stopped=stopped)
