"""The engine's own work, priced into a freshly measured speed profile.

The profile times a target forward and a drafter proposal in isolation. A serving step is more than that: the
commit after the forward (sampling, rejection sampling of the verified drafts, emitting), and on a drafting step
the feed of the target states the drafter has not seen yet. On the AMD EPYC of sessions 1–42 that work was a few
percent alike for every step kind; on session 43's Intel Xeon it cost a plain step 2.2 ms and a drafting one
5.2 ms of commit plus ~4 ms of feed at C = 4 (results/intel-s43/probe-cost-c4.txt), so the profile priced a
drafting step at ~1.4x a plain one where it cost 1.7x, and the async scheduler drafted where drafting lost.

``calibrated`` runs the real engine for a few seconds on synthetic prompts — plain decoding, then two fixed
drafting depths — and records every decode-only step as live prices do (``scheduling/live_profile.py`` with the
commit and the feed counted): the median measured / profiled ratio of plain steps, of verify steps and of
proposals. The profile is returned rescaled by them (``live_profile.rescaled``) and cached so, which keeps every
later decision deterministic for a given cache, unlike live prices.
"""
from __future__ import annotations

import dataclasses
import logging

import torch

from ..decoding import SamplingParams
from ..scheduling.live_profile import LiveProfile, rescaled
from ..scheduling.policy_objects import FixedPolicy
from ..scheduling.profile import SpeedProfile
from .engine import Engine, EngineConfig

log = logging.getLogger("dspark")
REQUESTS = 2  # a load where drafting is worth pricing right on every machine seen so far
PROMPT = 192  # tokens: with the steps below, contexts stay near the profile's grid context (256)
STEPS = 48  # decode steps per policy; ~2-3 s each on the 2-core CPUs
DEPTHS = (0, 1, 3)  # plain decoding, MTP-1, fixed-3


class _Timed:
    """A fixed policy that reports each step's measured times to ``live`` (commit and feed included)."""

    observes_steps = True
    prices_context = True  # the engine passes the requests' mean context to prepare
    needs_confidence = False

    def __init__(self, k: int, live: LiveProfile):
        self.fixed, self.live, self.context = FixedPolicy(k), live, 0.0
        self.drafts, self.name = self.fixed.drafts, self.fixed.name

    def prepare(self, n_requests: int, context: float | None = None) -> bool:
        self.context = context or 0.0
        return self.fixed.prepare(n_requests)

    def draft_depth(self, gamma: int) -> int:
        return self.fixed.draft_depth(gamma)

    def select(self, c=None, **kw):
        return self.fixed.select(c, **kw)

    def observe_step(self, n_tokens: int, n_requests: int, forward_s: float, drafted: int = 0, depth: int = 0,
                     draft_s: float = 0.0, commit_s: float = 0.0, feed_s: float = 0.0) -> None:
        self.live.observe_step(n_tokens, n_requests, forward_s, self.context, drafted, depth, draft_s, commit_s,
                               feed_s)


def engine_factors(model, drafter, profile: SpeedProfile, seed: int = 0) -> dict[str, float]:
    """Measured / profiled time of plain steps, verify steps and proposals in the engine (see the module)."""
    live = LiveProfile(profile, window=len(DEPTHS) * STEPS, min_samples=4, max_age=10 ** 6)  # every sample counts
    g = torch.Generator().manual_seed(seed)
    params = SamplingParams(temperature=1.0, max_new_tokens=STEPS * (max(DEPTHS) + 1), ignore_eos=True, seed=seed)
    for k in DEPTHS:
        # the drafter rides along on plain steps too, as on the async scheduler's skipped ones (its states deferred)
        engine = Engine(model, None, drafter, _Timed(k, live), (),
                        EngineConfig(gamma=drafter.gamma, max_running=REQUESTS, prefix_cache_entries=0))
        prompts = torch.randint(0, model.config.vocab_size, (REQUESTS, PROMPT), generator=g).tolist()
        for p in prompts:
            engine.add_request(p, params)
        steps = 0
        while engine.has_unfinished() and steps < STEPS + 4:  # + the prefill steps, which are not reported
            engine.step()
            steps += 1
        for req in list(engine.running) + list(engine.waiting):
            engine.abort(req.request_id)
        engine.step()  # reap them: the drafter's per-request state goes
    return live.factors()


def calibrated(model, drafter, profile: SpeedProfile) -> SpeedProfile:
    """``profile`` with the engine's own work priced in (unchanged without a drafter: nothing to compare)."""
    if drafter is None or not profile.draft_requests:
        return profile
    factors = engine_factors(model, drafter, profile)
    log.info("engine step prices over the profile's: plain x%.3f, verify x%.3f, drafting x%.3f",
             factors["plain"], factors["verify"], factors["draft"])
    scaled = rescaled(profile, **factors)
    return dataclasses.replace(scaled, source=f"{profile.source}, engine x{factors['plain']:.3f} plain, "
                                              f"x{factors['verify']:.3f} verify, x{factors['draft']:.3f} drafting")
