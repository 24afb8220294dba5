"""Prompt-prefix reuse (engine/prefix_cache.py): copying a shared prefix changes no output, hands the drafter the
context prefilling would have built, waits for a donor still prefilling, and stays inside the KV budget."""
import random
from types import SimpleNamespace

import pytest
import torch

from dspark.decoding import SamplingParams
from dspark.drafters import make_drafter
from dspark.engine.engine import Engine, EngineConfig
from dspark.engine.prefix_cache import PrefixCache, common_prefix
from dspark.engine.request import Request, Status
from dspark.scheduling.registry import make_policy
from dspark_testlib import tiny_drafter, tiny_target
from test_dspark_exactness import FIRST, PROMPT, assert_first_tokens_match_target, plain_greedy
from test_eagle3 import tiny_eagle3

SYSTEM = [3, 4, 5, 3, 4, 5, 3, 4, 9, 8, 7, 6, 5, 4, 3, 2, 1, 11, 12, 13]  # a 20-token shared "system prompt"
GREEDY = SamplingParams(temperature=0, max_new_tokens=16, ignore_eos=True)


def _engine(target, drafter, policy="fixed-4", **config):
    gamma = drafter.gamma if drafter is not None else 4
    kwargs = {"sps": lambda b: 1.0 / (0.01 + 1e-4 * b)} if policy.startswith("async") else {}
    return Engine(target, None, drafter, make_policy(policy if drafter else "none", **kwargs), (),
                  EngineConfig(gamma=gamma, prefill_chunk=8, **config))


def _run(engine, prompts, params=GREEDY):
    reqs = [engine.add_request(p, params) for p in prompts]
    while engine.has_unfinished():
        engine.step()
    assert all(r.error is None for r in reqs), [r.error for r in reqs]
    return reqs


def _drafter(kind, target):
    if kind == "dspark":
        return tiny_drafter(target, head="markov", block=4)
    if kind == "eagle3":
        return tiny_eagle3(target, steps=7, copy=True)
    return make_drafter(kind, target=target, gamma=4) if kind != "none" else None


@pytest.mark.parametrize("kind,policy", [("none", "none"), ("dspark", "fixed-4"), ("dspark", "async"),
                                         ("eagle3", "fixed-3"), ("ngram", "fixed-4")])
def test_greedy_outputs_with_shared_prefixes_equal_plain_decoding(kind, policy):
    target = tiny_target(seed=4, scale=6.0)
    engine = _engine(target, _drafter(kind, target), policy)
    same = SYSTEM + [40, 41, 42]
    first = _run(engine, [same, same, same, SYSTEM + [50, 51], SYSTEM[:18] + [60]])  # n = 3, and shared heads
    turn2 = [first[0].prompt + first[0].output + [70, 71], SYSTEM + [80]]  # next chat turn; a finished donor
    second = _run(engine, turn2)
    for req in first + second:
        assert req.output == plain_greedy(target, req.prompt, 16), req.prompt
    assert [r.cached_tokens for r in first] == [0, 22, 22, 20, 18]  # one computes, the others copy
    assert second[0].cached_tokens == len(first[0].prompt) + 16 - 1  # all the donor's KV: its last token had none
    assert second[1].cached_tokens == 20
    assert engine.stats.cached_prompt_tokens == sum(r.cached_tokens for r in first + second)
    assert engine.stats.prompt_tokens + engine.stats.cached_prompt_tokens == sum(len(r.prompt) for r in first + second)
    if kind not in ("none", "ngram"):
        assert sum(r.accepted for r in first + second) > 0


def test_a_copied_prefix_gives_the_drafter_the_context_prefilling_builds():
    target = tiny_target(seed=4, scale=6.0)
    drafter = tiny_drafter(target, head="markov", block=4)
    contexts = {}
    for on in (True, False):
        engine = _engine(target, drafter, "fixed-4", prefix_cache=on)
        reqs = [engine.add_request(SYSTEM + [40 + i], SamplingParams(temperature=0, max_new_tokens=40,
                                                                      ignore_eos=True)) for i in range(2)]
        while min(len(r.output) for r in reqs) < 4:  # it drafts every step: the prompt is in its context
            engine.step()
        ctx, n = drafter.context(reqs[1].draft), len(reqs[1].prompt)
        assert ctx.length >= n
        contexts[on] = (ctx.k[:, :n].clone(), ctx.v[:, :n].clone(), reqs[1].cached_tokens)
    (k_on, v_on, cached), (k_off, v_off, _) = contexts[True], contexts[False]
    assert cached == 20
    torch.testing.assert_close(k_on, k_off, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(v_on, v_off, atol=1e-5, rtol=1e-5)


def test_identical_prompts_wait_for_one_prefill_instead_of_computing_it_n_times():
    target = tiny_target(seed=4, scale=6.0)
    engine = _engine(target, tiny_drafter(target, block=4), prefix_cache_entries=0)
    prompt = SYSTEM * 2  # 40 tokens: five 8-token chunks
    reqs = [engine.add_request(prompt, GREEDY) for _ in range(4)]
    engine.step()
    assert [r.prefix_state for r in reqs] == ["done", "waiting", "waiting", "waiting"]
    while engine.has_unfinished():
        engine.step()
    assert [r.cached_tokens for r in reqs] == [0, 39, 39, 39]
    assert engine.stats.prompt_tokens == 40 + 3  # one prefill, then each copy computes its last prompt token
    assert all(r.output == reqs[0].output for r in reqs)
    assert engine.kv_reserved == 0 and engine.kv_cached == 0  # no donors kept when entries = 0


def test_kept_donors_stay_inside_the_kv_budget_and_the_entry_limit():
    target = tiny_target(seed=4, scale=6.0)
    engine = _engine(target, tiny_drafter(target, block=4), kv_budget_tokens=200, prefix_cache_entries=3)
    kept = []
    for i in range(8):  # each request reserves 20 + 2 + 16 + 5 = 43 positions; at most 4 fit the budget
        engine.add_request(SYSTEM + [30 + i, 31], GREEDY)
        while engine.has_unfinished():
            engine.step()
            assert engine.kv_reserved + engine.kv_cached <= engine.kv_budget
        kept.append(len(engine.prefixes.kept))
    assert kept == [1, 2, 3, 3, 3, 3, 3, 3] and engine.kv_cached == 3 * 43
    big = [engine.add_request(SYSTEM + [50 + i, 51], GREEDY) for i in range(4)]  # 4 × 43 = 172: evicts kept donors
    engine.step()
    assert all(r.cache is not None for r in big) and engine.kv_reserved == 4 * 43
    assert engine.kv_reserved + engine.kv_cached <= engine.kv_budget and len(engine.prefixes.kept) == 0
    while engine.has_unfinished():
        engine.step()
    assert not engine.feed.pending.keys() - set(engine.prefixes.kept)  # evicted donors left no pending states
    assert engine.reset_prefix_cache() == 3  # the 3 donors the entry limit kept
    assert engine.kv_cached == 0 and not engine.prefixes.kept and not engine.prefixes.index
    assert not engine.feed.pending
    again = _run(engine, [big[0].prompt])[0]  # its donor is gone: the prompt is computed again
    assert again.cached_tokens == 0 and again.output == big[0].output


def test_a_donor_that_stopped_early_gives_back_the_room_it_had_reserved():
    """A request reserved for 300 new tokens that stops after a few is kept holding only the positions it computed
    (the budget counts those), and lends them unchanged: a prompt extending its conversation gets the output it
    gets with no donor. One that used its reservation keeps its buffer (no copy for a few spare positions)."""
    target = tiny_target(seed=4, scale=6.0)
    engine = _engine(target, tiny_drafter(target, block=4), kv_budget_tokens=2000, prefix_cache_entries=4)
    first = _run(engine, [SYSTEM + [30, 31]])[0]  # 16 tokens: its reservation was used
    assert first.reserved == first.cache.capacity == 20 + 2 + 16 + 5 and engine.kv_cached == 43
    alone = _engine(target, tiny_drafter(target, block=4), prefix_cache_entries=0)
    stop = _run(alone, [SYSTEM + [40, 41]])[0].output[5]  # its greedy answer's sixth token ends it early
    early = _run(engine, [SYSTEM + [40, 41]], SamplingParams(temperature=0, max_new_tokens=300,
                                                             stop_token_ids=(stop,)))[0]
    assert early.finish_reason == "stop" and len(early.output) <= 6
    assert early.reserved == early.cache.capacity == early.cache.length < 300
    assert engine.kv_cached == 43 + early.cache.length and engine.kv_reserved == 0
    follow = early.prompt + early.output + [7, 8]  # the next turn of its conversation
    reused = _run(engine, [follow])[0]
    assert reused.cached_tokens >= len(SYSTEM) + 2  # from the compacted donor: the first shares only SYSTEM
    assert reused.output == _run(alone, [follow])[0].output
    seeded = SamplingParams(temperature=1.0, max_new_tokens=16, seed=7, ignore_eos=True)  # sampled: the same draws
    again = _run(engine, [follow], seeded)[0]
    assert again.cached_tokens >= len(SYSTEM) + 2 and again.output == _run(alone, [follow], seeded)[0].output


def test_seeded_sampling_with_prefix_reuse_is_reproducible_and_equals_recomputing():
    target = tiny_target(seed=4, scale=2.0)
    drafter = tiny_drafter(target, head="markov", block=4)

    def run(seed, on):
        engine = _engine(target, drafter, "fixed-4", prefix_cache=on)
        params = [SamplingParams(temperature=1.0, max_new_tokens=20, seed=seed + i, ignore_eos=True) for i in range(3)]
        reqs = [engine.add_request(SYSTEM + [40 + i], p) for i, p in enumerate(params)]
        while engine.has_unfinished():
            engine.step()
        return [r.output for r in reqs], [r.cached_tokens for r in reqs]

    (a, cached), (b, _), (c, _) = run(7, True), run(7, True), run(7, False)
    assert cached == [0, 20, 20] and a == b == c
    assert run(8, True)[0] != a


@pytest.mark.parametrize("policy", ["fixed-2", "async"])
def test_output_distribution_with_copied_prefixes_is_the_targets(policy):
    """20,000 requests of one prompt: all but the first copy its prefix (prefix_min_tokens = 1); chi-square of
    the first three tokens against the target's exact distribution."""
    from test_dspark_exactness import _depth_priced_profile

    target = tiny_target(vocab=12, hidden=32, layers=2, seed=11, scale=3.0)
    drafter = tiny_drafter(target, head="markov", rank=6, block=3, head_scale=1.0)
    kwargs = {"sps": _depth_priced_profile(3)} if policy == "async" else {}
    engine = Engine(target, None, drafter, make_policy(policy, **kwargs), (),
                    EngineConfig(gamma=3, max_running=512, prefix_min_tokens=1))
    n, outs, cached = 20_000, [], 0
    for start in range(0, n, 5000):
        reqs = [engine.add_request(PROMPT, SamplingParams(temperature=1.0, max_new_tokens=FIRST, seed=s,
                                                          ignore_eos=True)) for s in range(start, start + 5000)]
        while engine.has_unfinished():
            engine.step()
        outs += [r.output for r in reqs]
        cached += sum(r.cached_tokens > 0 for r in reqs)
    assert cached == n - 1  # later waves copy from kept donors, so each wave's first request does too
    assert_first_tokens_match_target(target, outs, n)


def test_common_prefix_and_bad_settings():
    assert common_prefix([1, 2, 3], [1, 2, 4, 5]) == 2
    assert common_prefix([1, 2], [1, 2, 3]) == 2 and common_prefix([], [1]) == 0
    rng = random.Random(0)
    for _ in range(300):  # against the one-token-at-a-time definition, around the 64-token blocks it skips by
        a = [rng.randrange(3) for _ in range(rng.randrange(200))]
        cut = rng.randrange(len(a) + 1)
        b = a[:cut] + [rng.randrange(3) for _ in range(rng.randrange(200))]
        naive = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        assert common_prefix(a, b) == common_prefix(b, a) == naive
    with pytest.raises(ValueError, match="prefix_min_tokens"):
        PrefixCache(min_tokens=0)
    with pytest.raises(ValueError, match="prefix_cache_entries"):
        EngineConfig(prefix_cache_entries=-1)


def _reference_find(cache, req, running, coverage):
    """Every donor scanned, every prefix counted token by token: the lookup before kept donors were indexed."""
    wanted, best = req.prompt[:-1], None
    if len(wanted) < cache.min_tokens:
        return None
    for donor in [*running, *cache.kept.values()]:
        if donor is req or donor.cache is None or donor.prefix_state != "done":
            continue
        shared = common_prefix(wanted, donor.prompt + donor.output)
        ready = min(shared, donor.cache.length, donor.num_tokens, coverage(donor))
        waits = ready < shared and donor.status is Status.PREFILL
        key = (shared if waits else ready, not waits)
        if key[0] >= cache.min_tokens and (best is None or key > best):
            best = key
    return best


def _donor(tokens: list[int], cut: int, status=Status.FINISHED) -> Request:
    """A request whose prompt is tokens[:cut] and output the rest, holding KV for all but its last token."""
    r = Request(tokens[:cut], SamplingParams(max_new_tokens=64))
    r.output, r.status, r.prefix_state = tokens[cut:], status, "done"
    r.cache = SimpleNamespace(length=len(tokens) - 1)
    return r


@pytest.mark.parametrize("block", [1, 4, 16])
def test_indexed_lookup_finds_what_scanning_every_donor_finds(block):
    """Random prompts built from a few shared heads, kept donors with random lengths and drafter coverage, some
    running ones (one still prefilling): the indexed lookup gives as many positions, and the same wait, as the
    scan over every donor; evicted donors leave no trace in the index."""
    rng = random.Random(block)
    heads = [[rng.randrange(5) for _ in range(rng.randrange(1, 70))] for _ in range(4)]
    make = lambda: rng.choice(heads) + [rng.randrange(5) for _ in range(rng.randrange(0, 40))]  # noqa: E731
    cache = PrefixCache(min_tokens=block, max_entries=60)
    covered = {}
    coverage = lambda d: covered.get(d.request_id, d.num_tokens)  # noqa: E731
    for i in range(150):
        tokens = make() + [rng.randrange(5) for _ in range(rng.randrange(2, 30))]
        donor = _donor(tokens, rng.randrange(1, len(tokens)))
        if rng.random() < 0.2:
            covered[donor.request_id] = rng.randrange(len(tokens))
        for old in cache.keep(donor):
            old.cache = None
        running = [_donor(make() + [1, 2], 5, Status.DECODE) for _ in range(3)]
        running[0].status, running[0].cache.length = Status.PREFILL, 3
        req = Request(make() + [9], SamplingParams(max_new_tokens=8))
        match = cache.find(req, running, coverage)
        want = _reference_find(cache, req, running, coverage)
        assert (None if match is None else (match.length, not match.wait)) == want
    assert len(cache.kept) == 60
    while cache.kept:
        cache.pop_oldest()
    assert cache.index == {} and cache.committed == {} and cache.kept_positions == 0


def test_a_hash_collision_never_copies_a_prefix_that_is_not_shared(monkeypatch):
    """With every block key equal, the index offers every kept donor at every depth: the lookup must still take
    only what is really shared."""
    import dspark.engine.prefix_cache as prefix_cache

    monkeypatch.setattr(prefix_cache, "block_keys",
                        lambda tokens, block: iter([0] * (len(tokens) // block)))
    rng = random.Random(0)
    cache = PrefixCache(min_tokens=4, max_entries=50)
    for _ in range(40):
        tokens = [rng.randrange(3) for _ in range(rng.randrange(5, 40))]
        cache.keep(_donor(tokens, rng.randrange(1, len(tokens))))
    for _ in range(200):
        req = Request([rng.randrange(3) for _ in range(rng.randrange(2, 40))], SamplingParams(max_new_tokens=4))
        match = cache.find(req, [], lambda d: d.num_tokens)
        want = _reference_find(cache, req, [], lambda d: d.num_tokens)
        assert (None if match is None else (match.length, True)) == want
        if match is not None:
            assert common_prefix(req.prompt, match.donor.prompt + match.donor.output) >= match.length
