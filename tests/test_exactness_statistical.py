"""The output distribution of speculative decoding equals the target's (chi-square over 20,000 samples).

A small-vocabulary table model (V = 8) stands in for the target so that the real loop — `Generation`, with
`to_probs`, `verify`, residual and bonus sampling, KV rollback — can run tens of thousands of times, and the
exact distribution of the first three tokens can be enumerated. Drafts are adversarial.
"""
import itertools

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

import dspark.engine.speculative as speculative
from dspark.decoding import SamplingParams, sample_from, to_probs
from dspark.drafters.base import DraftRequest, Drafter, Proposal
from dspark.engine import Generation

V, GAMMA, SAMPLES, FIRST = 8, 3, 20_000, 3
PROMPT = [1, 5]


class TableTarget:
    """logits(token at position t) = A[token] + B[t]: next-token law depends on the last token and position."""

    max_position = 64

    def __init__(self, seed=0):
        g = torch.Generator().manual_seed(seed)
        self.A = torch.randn(V, V, generator=g) * 1.5
        self.B = torch.randn(self.max_position, V, generator=g) * 0.5

    def logits_after(self, token: int, position: int) -> torch.Tensor:
        return self.A[token] + self.B[position]

    def new_state(self):
        return []

    def forward(self, state, start, tokens):
        del state[start:]
        state.extend(tokens)
        return torch.stack([self.logits_after(t, start + i) for i, t in enumerate(tokens)])

    def truncate(self, state, length):
        del state[length:]


class TableDrafter(Drafter):
    """Samples each slot from q(·| previous drafted token), with the request's sampling processing."""

    def __init__(self, kind: str, target: TableTarget):
        super().__init__(GAMMA)
        self.kind, self.target = kind, target
        g = torch.Generator().manual_seed(7)
        self.noise = torch.randn(V, V, generator=g) * 2
        self._q: dict = {}  # (prev, position, processing) -> q: to_probs ran 3 times a proposal, 20,000 proposals

    def q(self, prev: int, position: int, params: SamplingParams) -> torch.Tensor:
        key = (prev, position, params.processing)
        if key not in self._q:
            self._q[key] = to_probs(self.draft_logits(prev, position), params)
        return self._q[key]

    def draft_logits(self, prev: int, position: int) -> torch.Tensor:
        if self.kind == "uniform":
            return torch.zeros(V)
        if self.kind == "equal":
            return self.target.logits_after(prev, position)
        if self.kind == "peaked_wrong":  # most mass on the target's least likely token
            worst = int(self.target.logits_after(prev, position).argmin())
            return torch.full((V,), -3.0).index_fill_(0, torch.tensor([worst]), 3.0)
        return self.noise[prev]  # "noisy": an unrelated distribution

    def propose(self, requests: list[DraftRequest], depth=None) -> Proposal:  # always γ drafts (allowed)
        req = requests[0]
        prev, pos = req.tokens[-1], len(req.tokens) - 1
        tokens, probs = torch.zeros(1, GAMMA, dtype=torch.long), torch.zeros(1, GAMMA, V)
        for k in range(GAMMA):
            q = self.q(prev, pos + k, req.params)
            if self.kind == "point":  # deterministic draft of a poor token: q is a point mass
                tok = int(self.target.logits_after(prev, pos + k).argsort()[1])
            else:
                tok = int(sample_from(q[None], torch.rand(1, generator=req.generator, dtype=torch.float64))[0])
            tokens[0, k], probs[0, k] = tok, q
            prev = tok
        return Proposal(tokens=tokens, num_tokens=torch.tensor([GAMMA]),
                        probs=None if self.kind == "point" else probs)


def exact_first_tokens(target: TableTarget, params: SamplingParams) -> dict[tuple, float]:
    out = {}
    for seq in itertools.product(range(V), repeat=FIRST):
        prob, prev, pos = 1.0, PROMPT[-1], len(PROMPT) - 1
        for tok in seq:
            prob *= float(to_probs(target.logits_after(prev, pos), params)[tok])
            prev, pos = tok, pos + 1
        out[seq] = prob
    return out


def sample_first_tokens(target, drafter, params, n=SAMPLES) -> dict[tuple, int]:
    counts: dict[tuple, int] = {}
    for i in range(n):
        p = SamplingParams(temperature=params.temperature, top_k=params.top_k, top_p=params.top_p,
                           max_new_tokens=FIRST, seed=i)
        gen = Generation(target, drafter, PROMPT, p)
        seq = tuple(t for chunk in gen for t in chunk)
        counts[seq] = counts.get(seq, 0) + 1
    return counts


def chi_square_p(counts: dict, exact: dict, n: int) -> float:
    keys = sorted(exact, key=lambda k: -exact[k])
    expected = np.array([exact[k] * n for k in keys])
    observed = np.array([counts.get(k, 0) for k in keys], dtype=float)
    assert sum(counts.get(k, 0) for k in counts if exact.get(k, 0) == 0) == 0, "emitted an impossible sequence"
    big = expected >= 5  # pool sparse cells so the chi-square approximation holds
    exp = np.append(expected[big], expected[~big].sum())
    obs = np.append(observed[big], observed[~big].sum())
    if exp[-1] == 0:
        exp, obs = exp[:-1], obs[:-1]
    return float(chisquare(obs, exp * obs.sum() / exp.sum()).pvalue)


CASES = [
    ("uniform", SamplingParams(temperature=1.0)),
    ("peaked_wrong", SamplingParams(temperature=1.0)),
    ("equal", SamplingParams(temperature=0.7)),
    ("noisy", SamplingParams(temperature=1.3, top_k=4, top_p=0.8)),
    ("point", SamplingParams(temperature=1.0, top_p=0.9)),
]


@pytest.mark.parametrize("kind,params", CASES, ids=[c[0] for c in CASES])
def test_speculative_output_matches_target_distribution(kind, params):
    target = TableTarget()
    counts = sample_first_tokens(target, TableDrafter(kind, target), params)
    p = chi_square_p(counts, exact_first_tokens(target, params), SAMPLES)
    print(f"{kind}: chi-square p = {p:.3f}")
    assert p > 1e-3


def test_plain_decoding_matches_target_distribution():
    target = TableTarget()
    params = SamplingParams(temperature=1.0, top_k=5)
    p = chi_square_p(sample_first_tokens(target, None, params), exact_first_tokens(target, params), SAMPLES)
    assert p > 1e-3


def test_accept_always_verifier_is_caught(monkeypatch):
    """The same test must reject a verifier that keeps every draft the target does not forbid."""
    real_verify = speculative.verify

    def accept_always(draft_tokens, draft_probs, target_probs, num_draft, uniforms, stop_ids=None, vocab=None):
        return real_verify(draft_tokens, draft_probs, target_probs, num_draft, torch.zeros_like(uniforms), stop_ids,
                           vocab)

    monkeypatch.setattr(speculative, "verify", accept_always)
    target = TableTarget()
    params = SamplingParams(temperature=1.0)
    counts = sample_first_tokens(target, TableDrafter("uniform", target), params, n=SAMPLES)
    assert chi_square_p(counts, exact_first_tokens(target, params), SAMPLES) < 1e-6
