"""Exactness with the DSpark drafter: greedy equals plain greedy; T = 1 output follows the target's law."""
import itertools

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from dspark.decoding import SamplingParams
from dspark.scheduling import async_schedule
from dspark.scheduling.async_policy import DIP_STEPS
from dspark.engine import Generation, TransformerTarget
from dspark_testlib import speculative, tiny_drafter, tiny_target


def plain_greedy(target, prompt, n):
    params = SamplingParams(temperature=0, max_new_tokens=n, ignore_eos=True)
    return [t for chunk in Generation(TransformerTarget(target), None, prompt, params) for t in chunk]


@pytest.mark.parametrize("head", ["markov", "rnn", "none"])
def test_greedy_speculative_equals_plain_greedy(head):
    target = tiny_target(seed=3, scale=4.0)
    drafter = tiny_drafter(target, head=head, block=5, layers=2)
    prompts = [[5, 17, 33, 2, 9], [40, 41], [7, 7, 7, 7, 8, 9, 10, 11, 12]]  # ragged: batched propose pads
    got = speculative(target, drafter, prompts, SamplingParams(temperature=0), 40, seeds=[0, 1, 2], capacity=64)
    for prompt, out in zip(prompts, got):
        assert out == plain_greedy(target, prompt, 40)


@pytest.mark.parametrize("bf16", [False, True])
def test_greedy_equality_when_drafts_are_accepted(bf16):
    """On a peaked, repetitive target even a random drafter gets drafts accepted: the accept path is exercised
    (also with the drafter's bf16 products: they change q, never the output)."""
    target = tiny_target(seed=4, scale=6.0)
    drafter = tiny_drafter(target, head="markov", block=4, bf16=bf16)
    prompt = [3, 4, 5, 3, 4, 5, 3, 4]
    stats = {}
    out = speculative(target, drafter, [prompt], SamplingParams(temperature=0), 30, seeds=[0], stats=stats)[0]
    assert out == plain_greedy(target, prompt, 30)
    assert stats["accepted"] > 0


# ---------------------------------------------------------------------------------------------------------
V, FIRST, PROMPT = 12, 3, [3, 7, 1, 5]


def exact_first_tokens(target) -> dict[tuple, float]:
    """P(t1, t2, t3 | prompt) by enumeration: one forward per (t1, t2) prefix."""
    out = {}
    for t1, t2 in itertools.product(range(V), repeat=2):
        seq = PROMPT + [t1, t2]
        cache = target.new_cache(capacity=16)
        from dspark.models.transformer import Segment
        logits = target.forward(torch.tensor(seq), [Segment(cache, 0, len(seq))]).logits[-3:]
        p = logits.softmax(-1).double()
        for t3 in range(V):
            out[(t1, t2, t3)] = float(p[0, t1] * p[1, t2] * p[2, t3])
    return out


@pytest.mark.parametrize("bf16", [False, True])
def test_t1_output_distribution_matches_target_with_markov_head(bf16):
    target = tiny_target(vocab=V, hidden=32, layers=2, seed=11, scale=3.0)
    drafter = tiny_drafter(target, head="markov", rank=6, block=3, head_scale=1.0, bf16=bf16)
    # The Markov head is active: slot 2's distribution depends on the token drawn at slot 1.
    w = drafter.model.head.w2.weight @ drafter.model.head.w1.weight.T  # [V, V] bias columns per prev token
    assert float(w.std()) > 0.5
    n = 20_000
    params = SamplingParams(temperature=1.0)
    outs = []
    for start in range(0, n, 5000):  # chunks bound the per-request caches' memory
        outs += speculative(target, drafter, [PROMPT] * 5000, params, FIRST, seeds=list(range(start, start + 5000)),
                            capacity=16)
    assert_first_tokens_match_target(target, outs, n)


# --------------------------------------------------------------------------------------------------------
# Through the real batched engine (observe_batch wiring, chunked prefill, policies).

def _engine_run(target, drafter, policy, prompts, params, prefill_chunk=6):
    from dspark.engine.engine import Engine, EngineConfig

    engine = Engine(target, None, drafter, policy, (), EngineConfig(gamma=drafter.gamma, prefill_chunk=prefill_chunk))
    reqs = [engine.add_request(p, sp) for p, sp in zip(prompts, params)]
    while engine.has_unfinished():
        engine.step()
    return reqs


@pytest.mark.parametrize("policy_name", ["fixed-4", "sync", "async", "async-online"])
def test_engine_greedy_with_dspark_drafter_equals_plain(policy_name):
    from dspark.scheduling.registry import make_policy

    target = tiny_target(seed=4, scale=6.0)
    drafter = tiny_drafter(target, head="markov", block=4)
    priced = policy_name == "sync" or policy_name.startswith("async")
    kwargs = {"sps": lambda b: 1.0 / (0.01 + 1e-4 * b)} if priced else {}
    prompts = [[3, 4, 5, 3, 4, 5, 3, 4], [5, 17, 33, 2, 9], [40, 41]]
    params = [SamplingParams(temperature=0, max_new_tokens=24, ignore_eos=True)] * 3
    reqs = _engine_run(target, drafter, make_policy(policy_name, **kwargs), prompts, params)
    for prompt, req in zip(prompts, reqs):
        assert req.error is None and req.output == plain_greedy(target, prompt, 24)
    assert sum(r.accepted for r in reqs) > 0


@pytest.mark.parametrize("bf16", [False, True])
def test_engine_seeded_sampling_with_dspark_drafter(bf16):
    target = tiny_target(seed=4, scale=2.0)
    drafter = tiny_drafter(target, head="markov", block=4, bf16=bf16)
    assert_seeded_engine_reproducible(target, drafter)


def assert_first_tokens_match_target(target, outs, n: int) -> None:
    """Chi-square of the sampled first-token tuples against the target's exact distribution (rare cells pooled)."""
    counts: dict[tuple, int] = {}
    for o in outs:
        counts[tuple(o)] = counts.get(tuple(o), 0) + 1
    exact = exact_first_tokens(target)
    keys = sorted(exact, key=lambda k: -exact[k])
    expected = np.array([exact[k] * n for k in keys])
    observed = np.array([counts.get(k, 0) for k in keys], dtype=float)
    big = expected >= 5
    exp = np.append(expected[big], expected[~big].sum())
    obs = np.append(observed[big], observed[~big].sum())
    p = chisquare(obs, exp * obs.sum() / exp.sum()).pvalue
    print(f"chi-square p = {p:.4f} over {big.sum()} cells")
    assert p > 1e-3


def test_engine_seeded_sampling_with_online_calibrated_async():
    # The online correction reads verification outcomes, which are functions of the seeded draws: still reproducible.
    target = tiny_target(seed=4, scale=2.0)
    drafter = tiny_drafter(target, head="markov", block=4)
    assert_seeded_engine_reproducible(target, drafter, "async-online", sps=lambda b: 1.0 / (0.01 + 1e-4 * b))


def assert_seeded_engine_reproducible(target, drafter, policy="fixed-4", **policy_args) -> None:
    """Through the engine at T = 1: the same seeds give the same outputs, other seeds other outputs."""
    from dspark.scheduling.registry import make_policy

    prompts = [[3, 4, 5, 3], [5, 17, 33, 2, 9]]

    def run(seed):
        params = [SamplingParams(temperature=1.0, max_new_tokens=20, seed=seed + i, ignore_eos=True) for i in range(2)]
        return [r.output for r in _engine_run(target, drafter, make_policy(policy, **policy_args), prompts, params)]

    assert run(7) == run(7)
    assert run(7) != run(8)


# ---------------------------------------------------------------------------------------------------------
# Async drafting only as deep as K can use (scheduling/policies.py: draft_depth_for): shallower blocks, fewer
# confidences in the history; the drafts it does verify must still follow the target's law.

def _depth_priced_profile(gamma: int):
    from dspark.scheduling.profile import SpeedProfile

    # Verification nearly free, each drafted slot dear (1.5 ms against a 10 ms step): at one or two requests
    # with confidences near 0.5, K is 1-2 and the block is drafted 2-3 slots deep.
    per_slot = 0.0015
    full = 0.0005 + per_slot * (gamma - 1)
    return SpeedProfile((1, 64), (0.010, 0.011), (1, 16), (full, full), shallow_draft_seconds=(0.0005, 0.0005),
                        draft_depth=gamma)


def _record_depths(drafter) -> list:
    depths, propose = [], drafter.propose
    drafter.propose = lambda reqs, depth=None: depths.append(depth) or propose(reqs, depth=depth)
    return depths


def assert_engine_greedy_equals_plain(engine, target) -> list:
    """Three ragged prompts through the engine at T = 0, each equal to plain greedy decoding; returns the requests."""
    prompts = [[3, 4, 5, 3, 4, 5, 3, 4], [5, 17, 33, 2, 9], [40, 41]]
    reqs = [engine.add_request(p, SamplingParams(temperature=0, max_new_tokens=32, ignore_eos=True)) for p in prompts]
    while engine.has_unfinished():
        engine.step()
    for prompt, req in zip(prompts, reqs):
        assert req.error is None and req.output == plain_greedy(target, prompt, 32)
    return reqs


def test_engine_greedy_with_shallow_async_drafting_equals_plain():
    from dspark.engine.engine import Engine, EngineConfig
    from dspark.scheduling.registry import make_policy

    target = tiny_target(seed=4, scale=6.0)
    drafter = tiny_drafter(target, head="markov", block=5)
    depths = _record_depths(drafter)
    engine = Engine(target, None, drafter, make_policy("async", sps=_depth_priced_profile(5)), (),
                    EngineConfig(gamma=5, max_running=1))  # one request at a time: K stays small
    reqs = assert_engine_greedy_equals_plain(engine, target)
    assert any(d is not None and d < 5 for d in depths)  # shallow blocks were drafted and verified
    assert sum(r.accepted for r in reqs) > 0


def test_engine_seeded_sampling_with_shallow_async_drafting():
    target = tiny_target(seed=4, scale=2.0)
    drafter = tiny_drafter(target, head="markov", block=4)
    depths = _record_depths(drafter)
    assert_seeded_engine_reproducible(target, drafter, "async", sps=_depth_priced_profile(4))
    assert any(d is not None and d < 4 for d in depths)


def test_t1_output_distribution_with_shallow_async_drafting():
    from dspark.engine.engine import Engine, EngineConfig
    from dspark.scheduling.registry import make_policy

    target = tiny_target(vocab=V, hidden=32, layers=2, seed=11, scale=3.0)
    drafter = tiny_drafter(target, head="markov", rank=6, block=5, head_scale=1.0)
    depths = _record_depths(drafter)
    engine = Engine(target, None, drafter, make_policy("async", sps=_depth_priced_profile(5), probe_every=1), (),
                    EngineConfig(gamma=5, max_running=2))
    n = 4000
    reqs = [engine.add_request(PROMPT, SamplingParams(temperature=1.0, max_new_tokens=FIRST, seed=i, ignore_eos=True))
            for i in range(n)]
    while engine.has_unfinished():
        engine.step()
    assert any(d is not None and 1 < d < 5 for d in depths)
    assert sum(r.accepted for r in reqs) > 0
    assert_first_tokens_match_target(target, [r.output for r in reqs], n)


def _probing_engine(target, drafter, max_running: int):
    """Async with a margin no step can clear (K = 0 always) and a probe every other step, each drafting one
    request: every drafted block comes from a partial probe verified by Algorithm 1."""
    from dspark.engine.engine import Engine, EngineConfig
    from dspark.scheduling.registry import make_policy

    policy = make_policy("async", sps=_depth_priced_profile(drafter.gamma), probe_every=1, max_probe_every=1,
                         min_gain=0.99, probe_requests=1)
    engine = Engine(target, None, drafter, policy, (), EngineConfig(gamma=drafter.gamma, max_running=max_running,
                                                                    prefill_chunk=6))
    shapes, propose = [], drafter.propose
    drafter.propose = lambda reqs, depth=None: shapes.append((len(reqs), len(engine.running))) or propose(reqs, depth)
    return engine, shapes


def test_engine_greedy_with_partial_probes_equals_plain():
    target = tiny_target(seed=4, scale=6.0)
    drafter = tiny_drafter(target, head="markov", block=5)
    engine, shapes = _probing_engine(target, drafter, max_running=3)
    reqs = assert_engine_greedy_equals_plain(engine, target)
    assert (1, 3) in shapes and sum(r.accepted for r in reqs) > 0  # one of three drafted, and drafts accepted


def test_engine_seeded_sampling_with_partial_probes():
    target = tiny_target(seed=4, scale=2.0)
    drafter = tiny_drafter(target, head="markov", block=4)

    def run(seed):
        engine, shapes = _probing_engine(target, drafter, max_running=2)
        reqs = [engine.add_request(p, SamplingParams(temperature=1.0, max_new_tokens=20, seed=seed + i,
                                                     ignore_eos=True)) for i, p in enumerate([[3, 4, 5], [9, 2]])]
        while engine.has_unfinished():
            engine.step()
        assert (1, 2) in shapes
        return [r.output for r in reqs]

    assert run(7) == run(7)
    assert run(7) != run(8)


def test_t1_output_distribution_with_partial_probes():
    target = tiny_target(vocab=V, hidden=32, layers=2, seed=11, scale=3.0)
    drafter = tiny_drafter(target, head="markov", rank=6, block=5, head_scale=1.0)
    engine, shapes = _probing_engine(target, drafter, max_running=4)
    n = 4000
    reqs = [engine.add_request(PROMPT, SamplingParams(temperature=1.0, max_new_tokens=FIRST, seed=i, ignore_eos=True))
            for i in range(n)]
    while engine.has_unfinished():
        engine.step()
    assert (1, 4) in shapes and sum(r.accepted for r in reqs) > 0
    assert_first_tokens_match_target(target, [r.output for r in reqs], n)


# ---------------------------------------------------------------------------------------------------------
# The async scheduler's low-load rules (scheduling/async_policy.py): hysteresis keeps drafting below the entry
# margin, and near-threshold probes come every `reprobe_every` steps instead of backing off. Each rule gets a
# setting under which it fires on these tiny models (entry margins tuned to their predicted gains), and a spy
# checks it did, so the tests exercise the rule and not only the policy's name.

# Rules written for K priced alone (at depth K + 1) set joint_requests=0: with K and the depth priced together at
# R <= 2 (the default) their tiny models' prices no longer reach the states the rule is about.
RULES = {"kept drafting below the entry margin": dict(min_gain=0.27, near_loss=0.9, max_age=4, joint_requests=0),
         "near-threshold probe": dict(min_gain=0.5, near_loss=0.9, max_age=4, joint_requests=0),
         "early stop below K": dict(early_stop=1, min_gain=0.0, max_age=4),
         "no extra slot": dict(lean_depth=1, joint_requests=0, min_gain=0.0, max_age=4),
         "live step prices": dict(live=1, min_gain=0.0, max_age=4),
         "confirmed thin pool": dict(confirm=1, steady_run=4, probe_requests=1, probe_every=2, stay_gain=None,
                                     min_gain=0.1, max_age=4, joint_requests=0),
         # min_gain 0.5: drafting never starts off a pool, so only probes draft and the load's fall does not
         # start a drafting run before it can bring the next probe forward
         "far back-off": dict(probe_every=1, max_probe_every=2, far_probe_every=16, probe_requests=1,
                              min_gain=0.5, max_age=4),
         "probes soon once the load halves": dict(probe_every=2, max_probe_every=4, far_probe_every=16,
                                                  probe_requests=1, min_gain=0.5, max_age=4),
         "priced at the context": dict(min_gain=0.0, max_age=4),
         "depth capped by the spread of K": dict(spread_depth=1, min_gain=0.0, max_age=4),
         "depth priced with K": dict(joint_requests=3, explore_every=2, min_gain=0.0, max_age=4),
         "pools shrunk toward the long-run mean": dict(shrink=0.0, long_steps=64, min_gain=0.0, max_age=4),
         "kept drafting at a priced loss (low load)": dict(low_stay_gain=-0.9, min_gain=0.0, max_age=4),
         # min_gain 0.5: only probes draft, each one slot past the depth its pool priced
         "shallow probe": dict(min_gain=0.5, max_age=4),
         "smaller K within k_margin": dict(k_margin=0.2, min_gain=0.0, max_age=4),
         "dips keep the probes backed off": dict(hold_backoff=True, min_gain=0.0, max_age=4)}
# Requests each test runs at once where a rule needs load: these rules fire only while a probe (of one request)
# drafts part of the batch, and the far back-off's load must then halve; at T = 1 requests live three steps.
RUNNING = {"greedy": {"confirmed thin pool": 3, "far back-off": 2, "probes soon once the load halves": 2,
                      "depth capped by the spread of K": 3, "depth priced with K": 3,
                      "dips keep the probes backed off": 2},
           # one request at a time: with the seeded draws of two (seeds 7, 8) neither rule changed a decision once
           # depths were priced on one sample (session 52); at one request both do
           "seeded": {"confirmed thin pool": 3, "kept drafting at a priced loss (low load)": 1,
                      "pools shrunk toward the long-run mean": 1, "shallow probe": 1},
           "t1": {"confirmed thin pool": 3, "far back-off": 3, "probes soon once the load halves": 3,
                  "dips keep the probes backed off": 3}}


def _verify_priced_profile(gamma: int):
    from dspark.scheduling.profile import SpeedProfile

    # Each verified token costs 2 ms on a 10 ms step, drafting is cheap: K from old confidences is often >= 1,
    # and a current slot of low confidence is not worth its verify cost, so the early stop cuts below K.
    return SpeedProfile((1, 64), (0.010, 0.136), (1, 16), (0.001, 0.001), shallow_draft_seconds=(0.0005, 0.0005),
                        draft_depth=gamma)


def _staircase_profile(gamma: int):
    from dspark.scheduling.profile import SpeedProfile

    # An odd token count costs a jump (as 3 tokens did after 2 on the dev CPU's slow phase): at one request K = 1
    # pays and K = 2 could not, whatever slot 2's confidence, so the lean rule drops the extra slot.
    tokens = tuple(range(1, 17))
    seconds = tuple(0.010 + 0.001 * (n - 1) + 0.006 * ((n - 1) // 2) for n in tokens)
    return SpeedProfile(tokens, seconds, (1, 16), (0.001, 0.001), shallow_draft_seconds=(0.0005, 0.0005),
                        draft_depth=gamma)


def _solo_pays_profile(gamma: int):
    from dspark.scheduling.profile import SpeedProfile

    # Two tokens cost what one does, a third doubles the step: one request verifying one draft pays, two requests
    # verifying any cannot, so probes back off at two requests and one request left alone (a dip) drafts.
    tokens = tuple(range(1, 17))
    seconds = tuple(0.010 + 0.0001 * (n == 2) + (0.010 + 0.005 * (n - 3)) * (n >= 3) for n in tokens)
    return SpeedProfile(tokens, seconds, (1, 16), (0.0002, 0.0002), shallow_draft_seconds=(0.0001, 0.0001),
                        draft_depth=gamma)


def _context_priced_profile(gamma: int):
    import dataclasses

    # The depth-priced profile measured at 8 tokens of context, each token of context more adding 20 us per verified
    # token: at these requests' contexts (rounded to 32 and 64 tokens) a draft costs 0.5-1.1 ms more to verify, so
    # K priced at the context differs from K priced at the grid's.
    return dataclasses.replace(_depth_priced_profile(gamma), grid_context=8, context_token_s=20e-6)


def _dear_draft_profile(gamma: int):
    from dspark.scheduling.profile import SpeedProfile

    # Verification nearly free, drafting ten plain steps: K > 0 is priced far below plain decoding however
    # confident the drafts (the far back-off), while a probe's Algorithm 1, its drafting paid, still verifies.
    return SpeedProfile((1, 64), (0.010, 0.011), (1, 16), (0.1, 0.1), shallow_draft_seconds=(0.1, 0.1),
                        draft_depth=gamma)


# The profile each rule fires under, and whether only at one request (the staircase's jumps fall there)
PRICED_BY = {"early stop below K": (_verify_priced_profile, False), "no extra slot": (_staircase_profile, True),
             "confirmed thin pool": (_depth_priced_profile, False), "far back-off": (_dear_draft_profile, False),
             "probes soon once the load halves": (_dear_draft_profile, False),
             "priced at the context": (_context_priced_profile, False),
             "depth capped by the spread of K": (_verify_priced_profile, False),
             "pools shrunk toward the long-run mean": (_depth_priced_profile, False),
             "kept drafting at a priced loss (low load)": (_verify_priced_profile, False),
             "shallow probe": (_verify_priced_profile, False),
             "dips keep the probes backed off": (_solo_pays_profile, False)}


# rules that fire where every request's drafts look alike (K shared evenly), as a random head's do
EVEN_CONFIDENCES = {"depth capped by the spread of K"}


def _rules_engine(target, drafter, max_running: int, rule: str):
    from dspark.engine.engine import Engine, EngineConfig
    from dspark.scheduling.registry import make_policy

    priced, solo = PRICED_BY.get(rule, (_depth_priced_profile, False))
    if rule in PRICED_BY and rule not in EVEN_CONFIDENCES:  # a random head's are all ~0.5: spread them
        with torch.no_grad():
            drafter.model.confidence.proj.weight.normal_(0, 0.3, generator=torch.Generator().manual_seed(0))
    max_running = 1 if solo else max_running
    policy = make_policy("async", sps=priced(drafter.gamma), **RULES[rule])
    seen, prepare, select, probes = set(), policy.prepare, policy.select, [0]  # probes since the last drafting run

    def spy(n_requests, context=None):
        confirmed, far_load, interval = policy._confirmed, policy._backoff_load, policy._interval
        drafts = prepare(n_requests, context=context)
        if policy.last_capacity and n_requests < policy._probe_load and policy._run < DIP_STEPS:
            reset = policy.reprobe_every if n_requests <= policy.probe_requests else (
                policy.probe_every if policy._run >= policy.steady_run else interval)
            if policy._interval == interval != reset:
                seen.add("dips keep the probes backed off")  # a drafting dip left the backed-off interval as it was
        if policy._interval > policy.max_probe_every:
            seen.add("far back-off")  # probes rarer than max_probe_every allows
        if far_load and not policy._backoff_load and policy.last_capacity == 0 and not policy._probing:
            seen.add("probes soon once the load halves")  # the interval reset without a probe or a drafting run
        if policy._probing and policy._confirmed != confirmed:
            seen.add("confirmed thin pool")  # a probe run because the pool was thinner than the batch
        if policy.live is not None and policy.live.rebuilds and policy.last_capacity is not None:
            if _capacity_priced_by(policy, policy.live.base, n_requests) != policy._memo[1]:
                seen.add("live step prices")  # the measured times changed K
        if policy._long is not None and policy._long.folded and policy.last_capacity is not None:
            if _unshrunk_capacity(policy, n_requests) != policy._memo[1]:
                seen.add("pools shrunk toward the long-run mean")  # the mean of older steps changed K
        if policy._context and policy.last_capacity is not None:
            if _capacity_priced_by(policy, policy._sps, n_requests) != policy._memo[1]:
                seen.add("priced at the context")  # the requests' context changed K
        if policy.last_capacity:
            probes[0] = 0
            if policy._memo[2] <= 1.0 + policy.min_gain:
                seen.add("kept drafting below the entry margin")
            if policy._memo[2] < 1.0 and n_requests <= policy.joint_requests:
                seen.add("kept drafting at a priced loss (low load)")  # low_stay_gain
        if policy._probing and policy.draft_depth(drafter.gamma) < drafter.gamma:
            seen.add("shallow probe")
        if policy.k_margin and policy.last_capacity and policy._depth:
            if _unshrunk_capacity(policy, n_requests) != policy._memo[1]:
                seen.add("smaller K within k_margin")  # the margin chose a smaller K than the best
        if policy._probing:
            probes[0] += 1
            if probes[0] >= 2 and policy._interval == policy.reprobe_every:  # backing off would have doubled it
                seen.add("near-threshold probe")
        return drafts

    def select_spy(c=None, **kwargs):
        lengths = select(c, **kwargs)
        if policy.last_capacity and lengths.sum() < async_schedule(c, policy.last_capacity).sum():
            seen.add("early stop below K")
        if policy.last_capacity and policy.draft_depth(drafter.gamma) == policy.last_capacity < drafter.gamma:
            seen.add("no extra slot")
        if policy.last_capacity and policy.draft_depth(drafter.gamma) < min(drafter.gamma, policy.last_capacity + 1):
            seen.add("depth capped by the spread of K")
        if policy.last_capacity and policy._depth and policy.draft_depth(drafter.gamma) != min(
                drafter.gamma, policy.last_capacity + 1) and not policy._explore:
            seen.add("depth priced with K")  # neither K + 1 nor the exploring slot: the joint price chose it
        return lengths

    policy.prepare, policy.select = spy, select_spy
    if policy.live is not None:  # a machine on which verify steps run at half their cached price, every time
        observe, base = policy.observe_step, policy.live.base
        policy.observe_step = lambda b, r, _s, drafted, depth, _d, **_: observe(
            b, r, base.step_s(b, n_requests=r) * (0.5 if b > r else 1.0), drafted, depth,
            base.draft_s(drafted, depth) if drafted else 0.0)
    engine = Engine(target, None, drafter, policy, (), EngineConfig(gamma=drafter.gamma, max_running=max_running,
                                                                    prefill_chunk=6))
    return engine, seen


def _capacity_priced_by(policy, profile, n_requests: int) -> int:
    """The K the policy's pool of old confidences gets when priced by `profile`."""
    from dspark.scheduling.policies import capacity_from_survivals

    _, pool = policy._old_confidences()
    return capacity_from_survivals([a for _, a, _ in pool], [c.shape for c, _, _ in pool], profile, n_requests)[0]


def _unshrunk_capacity(policy, n_requests: int) -> int:
    """The K the policy's pool gets priced jointly with the depth as it is, not shrunk."""
    from dspark.scheduling.depth_pricing import capacity_and_depth, depth_survivals

    _, pool = policy._old_confidences()
    by_depth = [d if d is not None else depth_survivals(c) for c, _, d in pool]
    return capacity_and_depth(by_depth, [c.shape[0] for c, _, _ in pool], policy.sps, n_requests)[0]


@pytest.mark.parametrize("rule", sorted(RULES))
def test_engine_greedy_with_async_low_load_rules_equals_plain(rule):
    target = tiny_target(seed=4, scale=6.0)
    drafter = tiny_drafter(target, head="markov", block=5)
    engine, seen = _rules_engine(target, drafter, RUNNING["greedy"].get(rule, 1), rule)
    reqs = assert_engine_greedy_equals_plain(engine, target)
    assert rule in seen and sum(r.accepted for r in reqs) > 0


@pytest.mark.parametrize("rule", sorted(RULES))
def test_engine_seeded_sampling_with_async_low_load_rules(rule):
    if rule == "confirmed thin pool":  # this target's drafts are accepted so often the drafter is never skipped
        target = tiny_target(vocab=V, hidden=32, layers=2, seed=11, scale=3.0)  # long enough to probe: the T = 1 one
        drafter = tiny_drafter(target, head="markov", rank=6, block=5, head_scale=1.0)
    else:
        target = tiny_target(seed=4, scale=2.0)
        drafter = tiny_drafter(target, head="markov", block=4)

    def run(seed):
        engine, seen = _rules_engine(target, drafter, RUNNING["seeded"].get(rule, 2), rule)
        # then the load halves, or dips to one request
        lengths = (40, 24) if rule in ("probes soon once the load halves", "dips keep the probes backed off") else (40, 40)
        reqs = [engine.add_request(p, SamplingParams(temperature=1.0, max_new_tokens=n, seed=seed + i,
                                                     ignore_eos=True))
                for i, (p, n) in enumerate(zip([[3, 4, 5], [9, 2]], lengths))]
        while engine.has_unfinished():
            engine.step()
        return [r.output for r in reqs], seen

    first, seen = run(7)
    assert first == run(7)[0] and first != run(8)[0]
    assert rule in seen


@pytest.mark.parametrize("rule", sorted(RULES))
def test_t1_output_distribution_with_async_low_load_rules(rule):
    target = tiny_target(vocab=V, hidden=32, layers=2, seed=11, scale=3.0)
    drafter = tiny_drafter(target, head="markov", rank=6, block=5, head_scale=1.0)
    engine, seen = _rules_engine(target, drafter, RUNNING["t1"].get(rule, 2), rule)
    # 2,000 requests a rule (~100 cells): a rule only chooses which drafts are verified, never how, and 16 rules
    # at 4,000 took 11 of the suite's 43 CPU minutes; the verification law itself is tested at 20,000 samples.
    n = 2000
    reqs = [engine.add_request(PROMPT, SamplingParams(temperature=1.0, max_new_tokens=FIRST, seed=i, ignore_eos=True))
            for i in range(n)]
    while engine.has_unfinished():
        engine.step()
    assert rule in seen and sum(r.accepted for r in reqs) > 0
    assert_first_tokens_match_target(target, [r.output for r in reqs], n)
