"""The engine's own work, priced into a freshly measured speed profile (scheduling/engine_work.py says how).

The profile times a target forward and a drafter proposal in isolation. A serving step is more than that: the
commit after the forward (sampling, rejection sampling of the verified drafts, emitting), and on a drafting step
the feed of the target states the drafter has not seen yet. On session 43's Intel Xeon that work cost a plain step
2.2 ms and a drafting one 5.2 ms of commit plus ~4 ms of feed at C = 4 (results/intel-s43/probe-cost-c4.txt), so a
profile without it priced a drafting step at ~1.4x a plain one where it cost 1.7x, and the async scheduler drafted
where drafting lost.

``calibrated`` runs the real engine for a few seconds on synthetic prompts — plain decoding, then two fixed drafting
depths, at one request and at four — and records every decode-only step's commit, feed and proposal times as the
engine reports them (``observe_step``); ``engine_work.fit`` turns them into seconds per step, per request and per
verified draft, which the cached profile carries (``engine_work.priced_in``). Fixed once measured, so every later
decision is deterministic for a given cache, unlike live prices (scheduling/live_profile.py).
"""
from __future__ import annotations

import logging

import torch

from ..decoding import SamplingParams
from ..scheduling.engine_work import EngineWork, StepSample, fit, priced_in
from ..scheduling.policy_objects import FixedPolicy
from ..scheduling.profile import SpeedProfile
from .engine import Engine, EngineConfig

log = logging.getLogger("dspark")
REQUESTS = (1, 4)  # two loads, for the per-request parts of the commit and the feed
PROMPT = 192  # tokens: with the steps below, contexts stay near the profile's grid context (256)
STEPS = 32  # decode steps per policy and load; ~1 s each on the 2-core CPUs
DEPTHS = (0, 1, 3)  # plain decoding, MTP-1, fixed-3


class _Timed:
    """A fixed policy that records each step the engine reports (commit and feed apart from the forward)."""

    observes_steps = True
    needs_confidence = False

    def __init__(self, k: int, samples: list[StepSample]):
        self.fixed, self.samples = FixedPolicy(k), samples
        self.drafts, self.name = self.fixed.drafts, self.fixed.name

    def prepare(self, n_requests: int) -> bool:
        return self.fixed.prepare(n_requests)

    def draft_depth(self, gamma: int) -> int:
        return self.fixed.draft_depth(gamma)

    def select(self, c=None, **kw):
        return self.fixed.select(c, **kw)

    def observe_step(self, n_tokens: int, n_requests: int, forward_s: float, drafted: int = 0, depth: int = 0,
                     draft_s: float = 0.0, commit_s: float = 0.0, feed_s: float = 0.0) -> None:
        self.samples.append(StepSample(n_requests, n_tokens, commit_s, drafted, depth, draft_s, feed_s, forward_s))


def engine_steps(model, drafter, seed: int = 0) -> list[StepSample]:
    """Decode-only steps of the real engine under each of DEPTHS at each of REQUESTS, timed by part."""
    samples: list[StepSample] = []
    g = torch.Generator().manual_seed(seed)
    params = SamplingParams(temperature=1.0, max_new_tokens=STEPS * (max(DEPTHS) + 1), ignore_eos=True, seed=seed)
    for n in REQUESTS:
        for k in DEPTHS:
            # the drafter rides along on plain steps too, as on the async scheduler's skipped ones (states deferred)
            engine = Engine(model, None, drafter, _Timed(k, samples), (),
                            EngineConfig(gamma=drafter.gamma, max_running=n, prefix_cache_entries=0))
            for p in torch.randint(0, model.config.vocab_size, (n, PROMPT), generator=g).tolist():
                engine.add_request(p, params)
            steps = 0
            while engine.has_unfinished() and steps < STEPS + 2:  # + the prefill steps, which are not reported
                engine.step()
                steps += 1
            for req in list(engine.running) + list(engine.waiting):
                engine.abort(req.request_id)
            engine.step()  # reap them: the drafter's per-request state goes
    return samples


def engine_work(model, drafter, profile: SpeedProfile) -> EngineWork:
    """What the engine adds to the profile's forwards and proposals on this machine (see the module)."""
    return fit(engine_steps(model, drafter), profile)


def calibrated(model, drafter, profile: SpeedProfile) -> SpeedProfile:
    """``profile`` with the engine's own work priced in (unchanged without a drafter: nothing to compare)."""
    if drafter is None or not profile.draft_requests:
        return profile
    work = engine_work(model, drafter, profile)
    log.info("%s", work.describe())
    return priced_in(profile, work)
