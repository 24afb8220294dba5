"""Sampling parameters and logits processing, shared by the target and every drafter.

Invariant 2 of DESIGN.md: temperature, top-k and top-p are applied *identically* to target and draft logits
before p and q are formed. Both sides therefore call `to_probs` with the same `SamplingParams`.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from . import native_sample


class SamplingError(ValueError):
    """Invalid sampling parameters."""


MAX_LOGPROBS = 20  # alternatives per token, as OpenAI's API allows
MAX_LOGIT_BIAS = 100.0  # |bias| per token, as OpenAI's API allows
MAX_PENALTY = 2.0  # |presence_penalty|, |frequency_penalty|, as OpenAI's API allows
MAX_REPETITION_PENALTY = 100.0  # far past any useful value (1.1–1.3 is typical); keeps logits finite


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0  # 0 = greedy (one-hot argmax on both sides)
    top_p: float = 1.0  # in (0, 1]
    top_k: int = 0  # 0 = off
    # vLLM's min_p: after temperature, tokens less likely than min_p × the most likely one are dropped (before
    # top-k and top-p, vLLM's order); like them it shapes the draft's q and the target's p alike (invariant 2)
    min_p: float = 0.0  # in [0, 1]; 0 = off
    max_new_tokens: int = 128
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()  # in addition to the model's EOS ids
    ignore_eos: bool = False
    # None: no log-probabilities; n >= 0: each emitted token's log-probability under the target's raw
    # distribution and its n most likely alternatives (decoding/logprobs.py); read-only, it changes no token
    logprobs: int | None = None
    # vLLM's prompt_logprobs: the log-probability of every prompt token after the first under the target's raw
    # distribution given the tokens before it, with n alternatives; the prompt is then computed in full (no
    # prefix copied from another request: the copied positions have no logits)
    prompt_logprobs: int | None = None
    # (token id, bias) pairs added to the *target's* logits before everything else (target_logits below): the
    # distribution sampled from is softmax((logits + bias) / T) after top-k/top-p, exactly, under every drafter
    logit_bias: tuple[tuple[int, float], ...] = ()
    # OpenAI's penalties on the tokens generated so far (prompt excluded): logit -= frequency * count + presence *
    # [count > 0]; target-side like logit_bias, and inside a verified block each row counts the drafts before it
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    # vLLM's (and transformers') repetition_penalty on every token of the prompt or generated so far: a positive
    # logit is divided by it, a negative one multiplied (> 1 discourages repeats); applied before the two above
    repetition_penalty: float = 1.0
    # vLLM's min_tokens: before this many tokens are generated the stop tokens (EOS unless ignore_eos, and
    # stop_token_ids) have probability 0 in the target's distribution, and stop strings are not matched
    min_tokens: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.temperature, (int, float)) or self.temperature != self.temperature \
                or self.temperature < 0:
            raise SamplingError(f"temperature must be a number >= 0, got {self.temperature!r}")
        if not 0 < self.top_p <= 1:
            raise SamplingError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.min_p, (int, float)) or isinstance(self.min_p, bool) or not 0 <= self.min_p <= 1:
            raise SamplingError(f"min_p must be a number in [0, 1] (0 disables it), got {self.min_p!r}")
        if int(self.top_k) != self.top_k or self.top_k < 0:
            raise SamplingError(f"top_k must be an integer >= 0 (0 disables it), got {self.top_k!r}")
        if int(self.max_new_tokens) != self.max_new_tokens or self.max_new_tokens <= 0:
            raise SamplingError(f"max_new_tokens must be an integer > 0, got {self.max_new_tokens!r}")
        if self.logprobs is not None and (isinstance(self.logprobs, bool) or int(self.logprobs) != self.logprobs
                                          or not 0 <= self.logprobs <= MAX_LOGPROBS):
            raise SamplingError(f"logprobs must be None or an integer in [0, {MAX_LOGPROBS}], got {self.logprobs!r}")
        if self.prompt_logprobs is not None and (isinstance(self.prompt_logprobs, bool)
                                                 or int(self.prompt_logprobs) != self.prompt_logprobs
                                                 or not 0 <= self.prompt_logprobs <= MAX_LOGPROBS):
            raise SamplingError(f"prompt_logprobs must be None or an integer in [0, {MAX_LOGPROBS}], "
                                f"got {self.prompt_logprobs!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not -MAX_PENALTY <= value <= MAX_PENALTY:
                raise SamplingError(f"{name} must be a number in [-{MAX_PENALTY:g}, {MAX_PENALTY:g}], got {value!r}")
        rep = self.repetition_penalty
        if not isinstance(rep, (int, float)) or isinstance(rep, bool) or not 0 < rep <= MAX_REPETITION_PENALTY:
            raise SamplingError(f"repetition_penalty must be a number in (0, {MAX_REPETITION_PENALTY:g}] (1 disables "
                                f"it), got {rep!r}")
        if isinstance(self.min_tokens, bool) or int(self.min_tokens) != self.min_tokens \
                or not 0 <= self.min_tokens <= self.max_new_tokens:
            raise SamplingError(f"min_tokens must be an integer in [0, max_new_tokens = {self.max_new_tokens}], "
                                f"got {self.min_tokens!r}")
        for pair in self.logit_bias:
            if (len(pair) != 2 or isinstance(pair[0], bool) or int(pair[0]) != pair[0] or pair[0] < 0
                    or not -MAX_LOGIT_BIAS <= pair[1] <= MAX_LOGIT_BIAS):
                raise SamplingError(f"logit_bias entries must be (token id >= 0, bias in [-{MAX_LOGIT_BIAS:g}, "
                                    f"{MAX_LOGIT_BIAS:g}]), got {pair!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def adjusts_logits(self) -> bool:
        """Whether target_logits changes the target's logits for this request (logit_bias or a penalty)."""
        return bool(self.logit_bias or self.presence_penalty or self.frequency_penalty
                    or self.repetition_penalty != 1)

    @property
    def processing(self) -> tuple:
        """What ``to_probs`` reads: requests equal in it can share one call (their seeds may differ)."""
        return (self.temperature, self.top_k, self.top_p, self.min_p)

    def adjusts_logits_after(self, generated: int) -> bool:
        """Whether target_logits changes anything for a request that has generated `generated` tokens."""
        return self.adjusts_logits or generated < self.min_tokens


def target_logits(logits: torch.Tensor, params: SamplingParams, history=(), drafts=None, stops=(),
                  prompt=()) -> torch.Tensor:
    """The target's logits [n, V] as this request samples from them: its logit_bias and penalties applied, and
    its stop tokens ``stops`` masked on rows before min_tokens (a new tensor; the raw logits stay what
    log-probabilities report). Row j is the distribution after the request's generated tokens ``history`` (the
    anchor last) and ``drafts[:j]``, the drafts verified before it; the repetition penalty also counts the
    ``prompt``. Only verification calls it — a drafter may
    leave all this out: its q is whatever it sampled from, so acceptance uses the adjusted p either way (it only
    drafts worse)."""
    early = params.min_tokens - len(history)  # leading rows that predict a token before min_tokens
    if not params.adjusts_logits and (early <= 0 or not stops):
        return logits
    out = logits.float().clone()
    n, vocab = out.shape[-2], out.shape[-1]
    if early > 0 and stops:
        out[:early, [t for t in stops if t < vocab]] = float("-inf")
    if params.logit_bias:
        ids = torch.tensor([t for t, _ in params.logit_bias], device=out.device)
        if int(ids.max()) >= vocab:
            raise SamplingError(f"logit_bias names token {int(ids.max())}; the vocabulary has {vocab}")
        bias = torch.tensor([b for _, b in params.logit_bias], dtype=torch.float32, device=out.device)
        out.index_add_(-1, ids, bias.expand(*out.shape[:-1], -1))
    counts = None
    if params.repetition_penalty != 1:
        counts = _token_counts(n, vocab, history, drafts, out.device)  # [n, V]
        seen = counts > 0
        if len(prompt):
            seen |= torch.bincount(torch.as_tensor(list(prompt), device=out.device), minlength=vocab)[:vocab] > 0
        rep = params.repetition_penalty
        out = torch.where(seen, torch.where(out > 0, out / rep, out * rep), out)
    if params.presence_penalty or params.frequency_penalty:
        counts = _token_counts(n, vocab, history, drafts, out.device) if counts is None else counts  # [n, V]
        out -= params.frequency_penalty * counts + params.presence_penalty * (counts > 0).float()
    return out


def _token_counts(n: int, vocab: int, history, drafts, device) -> torch.Tensor:
    """[n, V]: how often each token occurs in history + drafts[:j], row j."""
    counts = torch.zeros(n, vocab, device=device)
    if len(history):
        counts += torch.bincount(torch.as_tensor(list(history), device=device), minlength=vocab)[:vocab]
    d = None if drafts is None else torch.as_tensor(drafts[: n - 1], dtype=torch.long, device=device)  # [n-1]
    if d is not None and len(d):
        step = torch.zeros(n, vocab, device=device)
        step[torch.arange(1, len(d) + 1), d] = 1.0  # draft j counts from row j + 1 on
        counts += step.cumsum(0)
    return counts


def to_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """logits: [..., V] -> fp32 probabilities [..., V] after temperature, min-p, top-k and top-p (vLLM's order).

    Greedy gives the one-hot argmax (first index on exact ties, as torch.argmax), so greedy verification
    is the ordinary rejection rule applied to point masses.
    """
    logits = logits.float()
    if params.greedy:
        return torch.zeros_like(logits).scatter_(-1, greedy_tokens(logits).unsqueeze(-1), 1.0)
    logits = _tempered(logits, params.temperature)
    if params.min_p > 0:
        # p < min_p · p_max  <=>  logit < max logit + log(min_p): no softmax needed (exp is monotone)
        floor = logits.amax(-1, keepdim=True) + math.log(params.min_p)  # [..., 1]
        logits = logits.masked_fill(logits < floor, float("-inf"))
    if 0 < params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k, dim=-1).values[..., -1:]  # [..., 1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if params.top_p < 1:
        probs = _top_p(probs, params.top_p)
    return probs


def greedy_tokens(logits: torch.Tensor) -> torch.Tensor:
    """logits [..., V] -> [...] int64: torch.argmax's tokens (the first index on exact ties), through one C call
    for fp32 CPU rows (native_sample.argmax: ~4x faster than torch's at SmolLM2's vocabulary)."""
    return native_sample.argmax(logits)


def _tempered(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """logits / temperature; at temperature 1 the logits themselves (x / 1 is x, bit for bit), which saves a pass
    over every row (callers never write into the result)."""
    return logits if temperature == 1.0 else logits / temperature


TOP_P_CANDIDATES = (256, 4096)  # most likely tokens ranked before the whole row is sorted


def _top_p(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """Keep the smallest set of most likely tokens whose mass reaches top_p (the top token always stays).

    Only the most likely tokens are ranked: a top-256 costs a fraction of a full sort of a 49,152-token row, and
    with full sorts verifying a step of 32 requests took 137–141 ms (results/top-p-s30). A row whose candidates
    hold less than top_p tries more, then sorts in full; every token outside a row's candidates has at least top_p
    of mass before it, so it is dropped either way: the rule of a full sort.

    The kept tokens are normalised by their running (cumsum) total, which is computed along each row alone: a
    sum over a 49,152-token row is split across threads when a call holds fewer rows than threads, so
    ``kept / kept.sum()`` gave a row other last bits in a one-row call than in a four-row one, and a seeded
    request's tokens depended on how many rows shared its call (its ℓ, or its neighbours')."""
    vocab = probs.shape[-1]
    if vocab <= TOP_P_CANDIDATES[0]:  # a small vocabulary: one sort, no bookkeeping (tests call this 10^5 times)
        sorted_p, order = probs.sort(dim=-1, descending=True)
        return torch.zeros_like(probs).scatter_(-1, order, _nucleus(sorted_p, top_p)[0])
    flat = probs.reshape(-1, vocab)  # [N, V]
    kept, todo = flat.new_zeros(flat.shape), None  # contiguous, so kept.view(-1) below; todo: rows left (None: all)
    for k in (*(c for c in TOP_P_CANDIDATES if c < vocab), vocab):
        rows = flat if todo is None else flat[todo]
        sorted_p, order = rows.topk(k, dim=-1) if k < vocab else rows.sort(dim=-1, descending=True)  # [n, k]
        kept_sorted, mass = _nucleus(sorted_p, top_p)
        done = (mass >= top_p) | (k == vocab)  # [n]
        if todo is None and bool(done.all()):
            kept.scatter_(-1, order, kept_sorted)
            break
        index = torch.arange(flat.shape[0]) if todo is None else todo
        at = (index[done].unsqueeze(-1) * vocab + order[done]).flatten()  # the decided rows' kept tokens in kept
        kept.view(-1)[at] = kept_sorted[done].flatten()  # k writes a row, not a zeroed [n, V] copy
        todo = index[~done]
        if not len(todo):
            break
    return kept.reshape(probs.shape)


def _nucleus(sorted_p: torch.Tensor, top_p: float) -> tuple[torch.Tensor, torch.Tensor]:
    """sorted_p [..., k], most likely first -> (the same with every token whose mass before it reaches top_p zeroed,
    normalised by the kept tokens' running total; the k tokens' total mass [...])."""
    mass = sorted_p.cumsum(-1)
    kept = sorted_p.masked_fill(mass - sorted_p >= top_p, 0.0)
    return kept / kept.cumsum(-1)[..., -1:], mass[..., -1]


CDF_BLOCK = 256  # tokens per block of the two-level search in sample_from


def sample_from(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF sampling. probs: [R, V] (unnormalised ok), uniforms: [R] in [0, 1) -> tokens [R].

    A token with zero mass can never be chosen: its CDF step is flat, so `searchsorted(right=True)`
    lands on the first token whose cumulative mass exceeds the threshold.
    """
    rows, vocab = probs.shape
    if not by_blocks(vocab):
        cdf = probs.double().cumsum(-1)  # fp64 so the top of the CDF is not lost to rounding
        threshold = (uniforms.double() * cdf[:, -1]).unsqueeze(-1)  # [R, 1]
        tokens = torch.searchsorted(cdf, threshold, right=True).squeeze(-1)
        return tokens.clamp_(max=probs.shape[-1] - 1)
    if native_sample.usable(probs):  # the same two-level search in one C call (native_sample.py)
        return native_sample.sample_blocks(probs, uniforms)
    return _sample_by_blocks(probs, uniforms)


def by_blocks(vocab: int) -> bool:
    """Whether sample_from searches blocks of CDF_BLOCK tokens (else one fp64 CDF): by the vocabulary alone, never
    by how many rows share a call, so a row's token does not depend on its neighbours."""
    return vocab % CDF_BLOCK == 0 and vocab >= 16 * CDF_BLOCK


def _sample_by_blocks(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """sample_from in two levels: the block holding the threshold from the blocks' masses, then the token inside
    it — one fp64 pass of sums instead of an fp64 cumsum of every row (part of the session-29 path that
    scripts/top_p_cost.py restores). A block or a token of zero mass still never holds the threshold."""
    rows, vocab = probs.shape
    blocks = probs.view(rows, vocab // CDF_BLOCK, CDF_BLOCK)  # [R, nb, B]
    block_cdf = blocks.sum(-1, dtype=torch.float64).cumsum(-1)  # [R, nb]
    threshold = (uniforms.double() * block_cdf[:, -1]).unsqueeze(-1)  # [R, 1]
    block = torch.searchsorted(block_cdf, threshold, right=True).clamp_(max=block_cdf.shape[1] - 1)  # [R, 1]
    before = torch.where(block > 0, block_cdf.gather(-1, (block - 1).clamp(min=0)), torch.zeros_like(threshold))
    inside = blocks[torch.arange(rows), block[:, 0]]  # [R, B]
    at = torch.searchsorted(inside.double().cumsum(-1) + before, threshold, right=True)  # [R, 1]
    # the block's own sum may round above its cumsum: then the threshold lies past the last token with mass
    last = (inside > 0).long().cumsum(-1).argmax(-1, keepdim=True)
    at = torch.where(at >= CDF_BLOCK, last, at)
    return (block * CDF_BLOCK + at).squeeze(-1)


def make_generator(seed: int | None) -> torch.Generator:
    """A per-request generator, so one request's randomness never depends on its neighbours."""
    g = torch.Generator()
    if seed is None:
        g.seed()
    else:
        g.manual_seed(int(seed))
    return g
