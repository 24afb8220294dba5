"""Log-probabilities of emitted tokens, for callers that ask (``SamplingParams.logprobs``).

They are read off the target's logits at the rows verification already computed — each emitted token, accepted
draft or bonus, was predicted by one row of the verify forward — so speculation costs no extra forward and the
values are those of plain decoding. They describe the target's *raw* distribution (log-softmax of its logits,
before temperature, top-k and top-p; vLLM's default, "raw_logprobs"): the model's view of each token, the same
whatever the sampling settings. Reading them changes no token.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class TokenLogprob:
    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()  # the n most likely tokens at this position, most likely first


def token_logprobs(logits: torch.Tensor, tokens: list[int], top: int = 0) -> list[TokenLogprob]:
    """logits: [n, V] raw target logits, row j the distribution token j was drawn from; tokens: n ids."""
    if not tokens:
        return []
    logp = torch.log_softmax(logits[: len(tokens)].float(), dim=-1)  # [n, V]
    chosen = logp[torch.arange(len(tokens)), torch.tensor(tokens)].tolist()
    if top <= 0:
        return [TokenLogprob(t, lp) for t, lp in zip(tokens, chosen)]
    values, ids = logp.topk(min(top, logp.shape[-1]), dim=-1)  # [n, top]
    return [TokenLogprob(t, lp, tuple(zip(i, v))) for t, lp, i, v in
            zip(tokens, chosen, ids.tolist(), values.tolist())]
