"""Deferred drafter feeding (engine/draft_feed.py): the drafter sees the same context as with per-step feeding,
memory per request stays bounded, and a failing feed fails its requests only."""
import numpy as np
import torch

from dspark.decoding import SamplingParams
from dspark.engine.draft_feed import DraftFeed
from dspark.engine.engine import Engine, EngineConfig
from dspark_testlib import tiny_drafter, tiny_target
from test_dspark_exactness import plain_greedy

PROMPTS = [[3, 4, 5, 3, 4, 5, 3, 4], [5, 17, 33, 2, 9], [40, 41]]


class EveryThird:
    """Drafts (and verifies k) on every third step only: two steps of committed tokens wait between proposals."""

    def __init__(self, k: int, phase: int = 2):
        self.k, self.phase, self.step, self.drafting = k, phase, 0, False

    def prepare(self, n_requests: int) -> bool:
        self.drafting = self.step % 3 == self.phase
        return self.drafting

    def select(self, c=None, *, n_requests=None, gamma=None):
        self.step += 1
        return np.full(n_requests if c is None else len(c), self.k if self.drafting else 0)


def run(max_pending: int, policy, n_tokens: int = 24, drafter=None, compact_every: int = 64):
    target = tiny_target(seed=4, scale=6.0)
    drafter = drafter or tiny_drafter(target, head="markov", block=4)
    # the feed alone: no finished request stays behind as a prefix donor (tests/drafters/test_prefix_cache.py)
    engine = Engine(target, None, drafter, policy, (), EngineConfig(gamma=4, prefill_chunk=6, prefix_cache=False))
    engine.feed.max_pending, engine.feed.compact_every = max_pending, compact_every
    params = SamplingParams(temperature=0, max_new_tokens=n_tokens, ignore_eos=True)
    reqs = [engine.add_request(p, params) for p in PROMPTS]
    drafts, held = [], []
    while engine.has_unfinished():
        engine.step()
        plan = engine.last_plan
        if plan.decoding and plan.propose_seconds:
            drafts.append(plan.drafts.tolist())
        held.append(max(engine.feed.held.values(), default=0))
    return target, engine, reqs, drafts, held


def test_deferred_feeding_drafts_what_per_step_feeding_drafts():
    """max_pending = 1 feeds after every forward (the old behaviour); the default defers to the next proposal."""
    target, _, eager_reqs, eager, _ = run(max_pending=1, policy=EveryThird(4))
    _, _, lazy_reqs, lazy, held = run(max_pending=64, policy=EveryThird(4))
    _, _, compacted_reqs, compacted, _ = run(max_pending=64, policy=EveryThird(4), compact_every=2)
    assert len(lazy) >= 4 and lazy == eager == compacted
    assert max(held) > 1  # rows really waited between proposals
    for prompt, a, b, c in zip(PROMPTS, eager_reqs, lazy_reqs, compacted_reqs):
        assert a.error is None and b.error is None and c.error is None
        assert a.output == b.output == c.output == plain_greedy(target, prompt, 24)
    assert sum(r.accepted for r in lazy_reqs) > 0


def _fake_step(feed, reqs, counts, rows_of_forward, offset=0):
    """Stash one forward of `rows_of_forward` rows whose first rows are the requests' committed ones."""
    stacked = torch.arange(rows_of_forward * 2 * 3, dtype=torch.float32).view(rows_of_forward, 2, 3) + offset
    hidden = {layer: stacked[:, j] for j, layer in enumerate(feed.layers)}
    firsts = [sum(counts[:i]) for i in range(len(counts))]
    feed.stash([(r, f, n) for r, f, n in zip(reqs, firsts, counts)], hidden, lambda r, e: None, stacked)
    return stacked


class _Layers:
    needs_layers = (3, 5)

    def __init__(self):
        self.fed = []

    def observe_batch(self, requests, hidden, offsets, counts):
        self.fed.append((len(requests), torch.stack([hidden[3], hidden[5]], dim=1).clone(), offsets, counts))


def _req(i):
    return type("R", (), {"request_id": str(i), "draft": i})()


def test_a_step_whose_rows_are_all_committed_is_kept_without_a_copy_and_others_are_compacted():
    """A forward that verified no drafts (every step while the drafter is skipped) is held as views of the
    forward's own states; one with rejected rows keeps only the committed ones."""
    feed = DraftFeed(_Layers())
    a, b = _req(0), _req(1)
    whole = _fake_step(feed, [a, b], [1, 1], rows_of_forward=2)
    assert all(chunk[0] is whole for chunk in feed.pending["0"] + feed.pending["1"])
    partial = _fake_step(feed, [a, b], [2, 1], rows_of_forward=5, offset=100)  # b's rows 2-4 were rejected
    kept = feed.pending["1"][-1][0]
    assert kept is not partial and kept.shape[0] == 3 and torch.equal(kept, partial[:3])


def test_compaction_bounds_the_steps_a_request_holds_and_feeds_the_same_rows():
    drafter = _Layers()
    feed = DraftFeed(drafter, compact_every=3)
    a, b = _req(0), _req(1)
    steps = [_fake_step(feed, [a, b], [1, 1], rows_of_forward=2, offset=10 * i) for i in range(4)]
    first = feed.pending["0"][0][0]  # steps 1-3 copied into one chunk of a's own
    assert first.shape[0] == 3 and feed.settled == {"0": 1, "1": 1}
    steps += [_fake_step(feed, [a, b], [1, 1], rows_of_forward=2, offset=10 * i) for i in range(4, 7)]
    # steps 4-6 made a second chunk; the first was not copied again (each row is copied once at most)
    assert feed.pending["0"][0][0] is first and [c[2] for c in feed.pending["0"]] == [3, 3, 1]
    assert all(len(c) - feed.settled[r] < 3 for r, c in feed.pending.items()) and feed.held == {"0": 7, "1": 7}
    feed.flush([a, b], lambda r, e: None)
    (n, states, offsets, counts), = drafter.fed
    assert n == 2 and offsets == [0, 7] and counts == [7, 7] and not feed.pending and not feed.settled
    assert torch.equal(states, torch.cat([torch.stack([s[0] for s in steps]), torch.stack([s[1] for s in steps])]))


def test_pending_rows_are_bounded_when_the_drafter_never_runs():
    from dspark.scheduling.registry import make_policy

    _, engine, reqs, drafts, held = run(max_pending=5, policy=make_policy("none"), n_tokens=30)
    assert not drafts and max(held) < 5
    assert all(r.error is None and len(r.output) == 30 for r in reqs)
    assert not engine.feed.pending and not engine.feed.held and not engine.feed.settled  # nothing left behind


def test_a_failing_feed_fails_the_requests_it_fed_and_the_engine_goes_on():
    target = tiny_target(seed=4, scale=6.0)
    drafter = tiny_drafter(target, head="markov", block=4)
    real, calls = drafter.observe_batch, []

    def flaky(requests, *args, **kwargs):
        calls.append(len(requests))
        if len(calls) == 2:
            raise RuntimeError("drafter out of memory")
        return real(requests, *args, **kwargs)

    drafter.observe_batch = flaky
    _, engine, reqs, _, _ = run(max_pending=64, policy=EveryThird(2), drafter=drafter)
    failed = [r for r in reqs if r.finish_reason == "error"]
    assert failed and all("out of memory" in r.error for r in failed)
    assert len(failed) == calls[1]
    assert not engine.running and engine.kv_reserved == 0
    later = engine.add_request([7, 8, 9], SamplingParams(temperature=0, max_new_tokens=10, ignore_eos=True))
    while engine.has_unfinished():
        engine.step()
    assert later.error is None and later.output == plain_greedy(target, [7, 8, 9], 10)


def test_a_feed_failing_when_rows_overflow_reports_the_failed_requests():
    """With the drafter never drafting, pending rows are fed when a request holds max_pending of them, inside
    the step's commit; a failure there must still reach the caller as the request's final output."""
    from dspark.scheduling.registry import make_policy

    target = tiny_target(seed=4, scale=6.0)
    drafter = tiny_drafter(target, head="markov", block=4)

    def broken(requests, *args, **kwargs):
        raise RuntimeError("drafter out of memory")

    drafter.observe_batch = broken
    engine = Engine(target, None, drafter, make_policy("none"), (), EngineConfig(gamma=4, prefill_chunk=6,
                                                                                 prefix_cache=False))
    engine.feed.max_pending = 5
    params = SamplingParams(temperature=0, max_new_tokens=30, ignore_eos=True)
    reqs = [engine.add_request(p, params) for p in PROMPTS]
    finals = []
    while engine.has_unfinished():
        finals += [o for o in engine.step() if o.finished]
    assert {o.request_id for o in finals} == {r.request_id for r in reqs}
    assert all(o.finish_reason == "error" and "out of memory" in o.request.error for o in finals)
    assert not engine.running and engine.kv_reserved == 0 and not engine.feed.pending


def test_seeded_and_t1_distribution_with_deferred_feeding():
    """T = 1 through the engine while the drafter is fed only every third step: the first three tokens follow
    the target's exact law (chi-square), and the same seeds give the same outputs. Phase 0: a request's first
    decode step drafts (its prompt rows were deferred), so tokens 2-4 come from verified drafts."""
    from test_dspark_exactness import FIRST, PROMPT, V, assert_first_tokens_match_target

    target = tiny_target(vocab=V, hidden=32, layers=2, seed=11, scale=3.0)
    drafter = tiny_drafter(target, head="markov", rank=6, block=3, head_scale=1.0)

    def sample(n, seed0=0):
        engine = Engine(target, None, drafter, EveryThird(3, phase=0), (), EngineConfig(gamma=3, max_running=512))
        reqs = [engine.add_request(PROMPT, SamplingParams(temperature=1.0, max_new_tokens=FIRST + 3, seed=seed0 + i,
                                                          ignore_eos=True)) for i in range(n)]
        while engine.has_unfinished():
            engine.step()
        assert all(r.error is None for r in reqs) and sum(r.accepted for r in reqs) > 0
        return [r.output[:FIRST] for r in reqs]

    assert sample(40) == sample(40) != sample(40, seed0=100)
    n = 8000
    assert_first_tokens_match_target(target, sample(n), n)
