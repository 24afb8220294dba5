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
    return batch_token_logprobs(logits, [range(len(tokens))], [tokens], [top])[0]


def batch_token_logprobs(table: torch.Tensor, rows: list, tokens: list[list[int]], tops: list[int]
                         ) -> list[list[TokenLogprob]]:
    """Several requests' entries from one log-softmax and one top-k: table [M, V] raw logits; request r's tokens
    tokens[r] were drawn from rows rows[r] of it (as many), with tops[r] alternatives each."""
    flat_rows = [i for r, t in zip(rows, tokens) for i in list(r)[: len(t)]]
    if not flat_rows:
        return [[] for _ in tokens]
    logp = torch.log_softmax(table[torch.tensor(flat_rows)].float(), dim=-1)  # [N, V]
    flat_tokens = torch.tensor([t for ts in tokens for t in ts])
    chosen = logp[torch.arange(len(flat_rows)), flat_tokens].tolist()
    values, ids = logp.topk(min(max(tops), logp.shape[-1]), dim=-1)  # [N, k]; k = 0 gives empty rows
    values, ids = values.tolist(), ids.tolist()
    out, at = [], 0
    for ts, top in zip(tokens, tops):
        out.append([TokenLogprob(t, chosen[at + j], tuple(zip(ids[at + j][:top], values[at + j][:top])))
                    for j, t in enumerate(ts)])
        at += len(ts)
    return out


def step_logprobs(asked: list[int | None], emitted: list[list[int]], table: torch.Tensor, rows: list[slice]) -> list:
    """One engine step's entries per request (None where ``asked[r]`` is None), from one log-softmax over the
    step's rows: row j of request r's block, ``rows[r]`` of ``table``, predicted its emitted token j (the accepted
    drafts, then the bonus)."""
    asking = [i for i, n in enumerate(asked) if n is not None]
    out: list = [None] * len(asked)
    if asking:
        lists = batch_token_logprobs(table, [range(rows[i].start, rows[i].stop) for i in asking],
                                     [emitted[i] for i in asking], [asked[i] for i in asking])
        for i, entries in zip(asking, lists):
            out[i] = entries
    return out
