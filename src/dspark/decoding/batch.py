"""Verification of a ragged batch whose requests each carry their own sampling parameters and generator."""
from __future__ import annotations

import torch

from .sampling import SamplingParams, to_probs
from .verify import VerifyResult, draw_uniforms, verify, verify_greedy


def verify_requests(logits: list[torch.Tensor], drafts: torch.Tensor, num_draft: torch.Tensor,
                    draft_probs: torch.Tensor | None, params: list[SamplingParams],
                    generators: list[torch.Generator], stop_mask: torch.Tensor) -> VerifyResult:
    """logits[r]: [ℓ_r+1, V] target rows of request r; drafts: [R, γ]; num_draft: [R]; draft_probs: [R, γ, V]
    or None; stop_mask: [R, γ] bool (draft k of request r is one of r's stop tokens).

    Greedy requests take the argmax fast path; the rest are processed with their own parameters (the same
    ones their drafts were processed with) and verified together.
    """
    R, gamma = drafts.shape
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
        rows = torch.zeros(len(group), gamma + 1, vocab)  # [G, γ+1, V], zero beyond each ℓ_r + 1
        for i, r in enumerate(group):
            block = logits[r] if is_greedy else to_probs(logits[r], params[r])
            rows[i, : block.shape[0]] = block
        if is_greedy:
            res = verify_greedy(drafts[idx], rows, num_draft[idx], stop_mask[idx])
        else:
            uniforms = draw_uniforms([generators[r] for r in group], num_draft[idx], gamma)
            q = None if draft_probs is None else draft_probs[idx]
            res = verify(drafts[idx], q, rows, num_draft[idx], uniforms, stop_mask[idx])
        accepted[idx], next_token[idx], stopped[idx] = res.accepted, res.next_token, res.stopped
    return VerifyResult(accepted=accepted, next_token=next_token, stopped=stopped)
