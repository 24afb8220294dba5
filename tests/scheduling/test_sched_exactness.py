"""Exactness: every shipped policy keeps the target distribution when slot k's confidence depends on the token
sampled at slot k-1; the synchronous search without early stop does not (the paper's appendix counterexample).

Self-contained on purpose (the real verifier lives in dspark.decoding): a tiny vocabulary, a target that is a
Markov chain P[prev, next], a drafter that is another chain Q, confidences G[prev token] (so c_k is a function of
the drafted token k-1, as in DSpark), and textbook rejection sampling, all vectorised over many independent
"worlds" of R concurrent requests. We test the joint law of the first two emitted tokens of request 0.
"""

import numpy as np
import pytest
from scipy.stats import chisquare

from dspark.scheduling import (
    AsyncPolicy,
    async_capacity,
    async_schedule,
    fixed_k,
    static_threshold,
    sync_prefix_schedule,
    sync_prefix_schedule_unsafe_no_early_stop,
)

V, R, GAMMA, N_WORLDS = 3, 2, 2, 20_000
P = np.array([[0.60, 0.25, 0.15], [0.10, 0.30, 0.60], [0.30, 0.50, 0.20]])  # target chain
Q = np.array([[0.20, 0.60, 0.20], [0.50, 0.20, 0.30], [0.10, 0.30, 0.60]])  # draft chain: deliberately off
G = np.array([0.50, 0.95, 0.10])  # confidence of the next slot given the previous token
# A jagged SPS: one or two more tokens cost a lot, three are worth it only if a slot-2 survival is high. A
# global search without early stop then verifies the slot-1 drafts iff some request drafted token 1 at slot 1
# (G[1] = 0.95) — for request 0 that is its own slot-1 token, which Q over-proposes. Algorithm 1 stops early.
SPS_TABLE = {2: 1.0, 3: 0.7, 4: 0.6, 5: 0.6, 6: 0.5}


def sps(b):
    return SPS_TABLE[int(b)]


def sample(rng, probs):
    """One draw per row of ``probs`` [M, V]."""
    u = rng.random(probs.shape[0])[:, None]
    return np.minimum((np.cumsum(probs, axis=1) < u).sum(axis=1), probs.shape[1] - 1)


def residuals():
    res = np.maximum(P - Q, 0.0)
    return res / res.sum(axis=1, keepdims=True)


def draft(rng, anchor):
    """Draft γ tokens from Q for every request: anchor [N, R] -> drafts list of [N, R], confidences [N, R, γ]."""
    drafts, conf, prev = [], [], anchor
    for _ in range(GAMMA):
        conf.append(G[prev])  # c_k depends on the token before slot k (the anchor for k = 1)
        x = sample(rng, Q[prev.ravel()]).reshape(prev.shape)
        drafts.append(x)
        prev = x
    return drafts, np.stack(conf, axis=-1)


def run_round(rng, anchor, choose):
    """One speculative round for all worlds. anchor [N, R] -> list of emitted tokens per step, as ([N, R] token,
    [N, R] valid mask) pairs in order. ``choose(c [R, γ], c_old [R, γ]) -> ℓ [R]``, where c_old are confidences
    of an earlier, independent step (for the asynchronous scheduler)."""
    n = anchor.shape[0]
    drafts, c = draft(rng, anchor)  # c [N, R, γ]
    _, c_old = draft(rng, rng.integers(V, size=anchor.shape))  # earlier step: independent of this one
    ell = np.stack([choose(c[w], c_old[w]) for w in range(n)])  # [N, R]
    res = residuals()
    out, alive, prev = [], np.ones_like(anchor, dtype=bool), anchor
    for k in range(GAMMA):
        x = drafts[k]
        verify = alive & (ell > k)
        ratio = P[prev, x] / Q[prev, x]
        accept = verify & (rng.random(x.shape) < np.minimum(1.0, ratio))
        reject = verify & ~accept
        repl = sample(rng, res[prev.ravel()]).reshape(prev.shape)
        out.append((np.where(accept, x, repl), accept | reject))
        stop_here = alive & (ell == k)  # all ℓ drafts accepted: bonus from the target
        bonus = sample(rng, P[prev.ravel()]).reshape(prev.shape)
        out.append((bonus, stop_here))
        alive = accept
        prev = np.where(accept, x, prev)
    bonus = sample(rng, P[prev.ravel()]).reshape(prev.shape)
    out.append((bonus, alive))  # ℓ = γ and all accepted
    return out


def first_two_tokens(choose, seed):
    """Run rounds until every request emitted >= 2 tokens; return [N, 2] first two tokens of request 0."""
    rng = np.random.default_rng(seed)
    anchor = np.zeros((N_WORLDS, R), dtype=np.int64)  # the law under test starts from token 0
    got = np.full((N_WORLDS, R, 2), -1)
    count = np.zeros((N_WORLDS, R), dtype=np.int64)
    for rnd in range(2):
        for tok, valid in run_round(rng, anchor, choose):
            for slot in range(2):
                put = valid & (count == slot)
                got[..., slot][put] = tok[put]
            count += valid
            anchor = np.where(valid, tok, anchor)
    assert (count >= 2).all()
    return got[:, 0, :]


def chi2_pvalue(pairs):
    expected = (P[0][:, None] * P).ravel() * len(pairs)  # P(y1 = a) P(y2 = b | a)
    observed = np.bincount(pairs[:, 0] * V + pairs[:, 1], minlength=V * V)
    return chisquare(observed, expected).pvalue


def async_probe_step(c, c_old):
    """The step on which AsyncPolicy probes: primed with token-independent history (zero confidences -> K = 0,
    one skipped step), so this call drafts again and verifies the current, token-dependent confidences."""
    pol = AsyncPolicy(sps, probe_every=1)
    for _ in range(2):
        pol.prepare(R)
        pol.select(np.zeros((R, GAMMA)))
    assert pol.prepare(R) is False
    pol.select(None, n_requests=R)
    assert pol.prepare(R) is True and pol.last_capacity is None  # the probe
    return pol.select(c)


POLICIES = {
    "sync": lambda c, c_old: sync_prefix_schedule(c, sps),
    "async": lambda c, c_old: async_schedule(c, async_capacity(c_old, sps)),
    "async-probe": async_probe_step,
    "async-early-stop": lambda c, c_old: sync_prefix_schedule(c, sps, capacity=async_capacity(c_old, sps)),
    "fixed-1": lambda c, c_old: fixed_k(R, GAMMA, 1),
    "fixed-2": lambda c, c_old: fixed_k(R, GAMMA, 2),
    "threshold": lambda c, c_old: static_threshold(c, 0.45),
    "threshold-cumulative": lambda c, c_old: static_threshold(c, 0.4, cumulative=True),
}


@pytest.mark.parametrize("name", list(POLICIES))
def test_policy_keeps_target_distribution(name):
    pairs = first_two_tokens(POLICIES[name], seed=0)
    assert chi2_pvalue(pairs) > 1e-3


def test_the_harness_detects_the_unsafe_search():
    """Same setup, global search without early stop: the bias is far beyond sampling noise (test has power)."""
    unsafe = lambda c, c_old: sync_prefix_schedule_unsafe_no_early_stop(c, sps)  # noqa: E731
    pairs = first_two_tokens(unsafe, seed=0)
    assert chi2_pvalue(pairs) < 1e-6


# ---------------------------------------------------------------- the paper's appendix counterexample


def exact_first_token_law(p, q, c1, g, schedule):
    """Exact law of the first emitted token for one request, γ = 2, draft x1 ~ q, confidence c2 = g[x1]."""
    law = np.zeros(len(p))
    res = np.maximum(p - q, 0.0)
    res = res / res.sum() if res.sum() > 0 else res
    for x1 in range(len(p)):
        ell = int(schedule(np.array([[c1, g[x1]]]))[0])  # the slot-2 draft does not change c2 here
        if ell == 0:
            law += q[x1] * p  # nothing verified: the bonus token is drawn from the target
        else:
            acc = min(1.0, p[x1] / q[x1])
            law[x1] += q[x1] * acc
            law += q[x1] * (1 - acc) * res
    return law


def test_paper_counterexample_no_early_stop_turns_07_03_into_085_015():
    # Target (0.7, 0.3), uniform draft, slot-1 confidence 0.5; slot 2 looks great after drafting token 0
    # (c2 = 0.9) and poor after token 1 (c2 = 0.1). SPS: a second verified token costs a lot (SPS(2) = 0.5),
    # a third makes it worth it (SPS(3) = 0.6) only when c2 is high: Θ = (1 + 0.5 + 0.45)·0.6 = 1.17 > 1,
    # but (1 + 0.5 + 0.05)·0.6 = 0.93 < 1. So the global search verifies iff the draft was token 0 — the
    # decision to verify slot 1 depends on slot 1's own token — and P(0) = 0.5·1 + 0.5·0.7 = 0.85.
    p, q, g = np.array([0.7, 0.3]), np.array([0.5, 0.5]), np.array([0.9, 0.1])
    table = {1: 1.0, 2: 0.5, 3: 0.6}
    sps_ce = lambda b: table[int(b)]  # noqa: E731
    biased = exact_first_token_law(p, q, 0.5, g, lambda c: sync_prefix_schedule_unsafe_no_early_stop(c, sps_ce))
    np.testing.assert_allclose(biased, [0.85, 0.15], atol=1e-12)
    for safe in (lambda c: sync_prefix_schedule(c, sps_ce),  # stops at slot 1: (1.5)·0.5 < 1
                 lambda c: async_schedule(c, async_capacity(np.array([[0.5, 0.9]]), sps_ce)),
                 lambda c: sync_prefix_schedule(c, sps_ce, capacity=async_capacity(np.array([[0.5, 0.9]]), sps_ce))):
        np.testing.assert_allclose(exact_first_token_law(p, q, 0.5, g, safe), [0.7, 0.3], atol=1e-12)
