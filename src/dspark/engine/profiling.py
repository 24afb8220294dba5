"""Measure this machine's speed profile SPS(B) for a target, and cache it (scheduling/profile.py keys it).

A step over B tokens is timed the way the engine will run it: B tokens spread over several requests, each
with a warm 256-token context, so per-request attention overhead is part of the price of a token. The grid times
the steps the scheduler compares directly: R requests of k tokens each (k = 1: plain decoding).
"""
from __future__ import annotations

import functools
import logging
from pathlib import Path

import torch

from ..models import native, native_attention, native_norm
from ..models.loader import cache_root
from ..models.transformer import Segment, Transformer
from ..scheduling.profile import ProfileKey, SpeedProfile, current_machine
from ..scheduling.profile_measure import measure_profile
from ..scheduling.profile_io import load_or_measure
from .overhead import calibrated

PROFILE_TOKENS = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64)
PROFILE_REQUESTS = (1, 2, 4, 8, 16, 32)  # drafting cost: one propose() for R requests
CONTEXT = 256
TOKENS_PER_REQUEST = 4  # a typical steady-state request verifies its anchor plus a few drafts
# Tokens per request in the (R, k) grid: plain, and 1-4 or 7 drafts (γ = 7). A step's price is a staircase in
# B here, not a line: it steps where rows pass our C kernel's measured limit (models/kernel_choice.py; until
# session 20 that was 2 rows, then 3-8 cost about one oneDNN price) and where they are padded to a bucket
# (layers.bucket_rows; scripts/step_shape_cost.py). With only k = 1, 2, 4, 8 a 3-token R = 1 step was priced
# 6 % under its cost, and the async scheduler verified 2 drafts where 1 paid.
GRID_TOKENS = (1, 2, 3, 4, 5, 8)
# The prefill table: a new request's prompt chunk of P tokens beside R requests decoding (0: alone). From 64
# tokens a prompt's extra time is nearly the same at every load from 1 to 32 requests (within ~10 %), but alone
# it also pays the forward's fixed cost (a 16-token prompt: 19 ms alone, 12 ms over one decoding request, 9 ms
# over eight; scripts/prefill_cost.py), so the table has R = 1 beside R = 0.
PREFILL_REQUESTS = (0, 1, 8, 32)
# Context: grid cells (R, k) timed again with LONG_CONTEXT tokens per request, for the profile's context prices
# (attention over the context grows with it, most of all per verified token: scheduling/profile.py).
LONG_CONTEXT = 1024
CONTEXT_CELLS = ((1, 1), (1, 8), (4, 1), (4, 8))
PREFILL_TOKENS = (16, 32, 64, 128, 256, 512)
MIN_JOB_SECONDS = 0.1  # steps cheaper than this get up to 4 samples per round (the low-load ones that decide)
REFERENCE_EVERY = 0.25  # seconds: every sample is read against a plain step timed at most this long before it
# The steps of up to PRECISE_REQUESTS requests (where the async scheduler weighs prices a few per cent apart) are
# timed further, until each median's standard error is under PRECISION or PRECISE_SECONDS have passed: on a quiet
# machine the first rounds suffice; on the AVX2 EPYC of sessions 50-51 a sample scatters by ~10 % and ~18 samples
# left prices ~3 % off (scheduling/profile_measure.py).
PRECISE_REQUESTS = 4
PRECISION = 0.01
PRECISE_SECONDS = 120.0
log = logging.getLogger("dspark")


def _split(b: int) -> list[int]:
    requests = max(1, b // TOKENS_PER_REQUEST)
    base, extra = divmod(b, requests)
    return [base + (1 if i < extra else 0) for i in range(requests)]


def _warm_caches(model: Transformer, context: int = CONTEXT):
    """caches(n): n KV caches holding the same ``context``-token prefix (prefilled once, then copied)."""
    caches: list = []

    def get(n: int) -> list:
        while len(caches) < n:
            if not caches:
                cache = model.new_cache(context + 128)
                model.forward(torch.arange(context) % model.config.vocab_size, [Segment(cache, 0, context)])
                caches.append(cache)
            else:
                caches.append(caches[0].clone())
        return caches[:n]

    return get


def _step_fn(model: Transformer, caches, context: int = CONTEXT):
    """run(parts): one forward with request i verifying parts[i] tokens, caches rolled back afterwards."""
    def run(parts: list[int]) -> None:
        used = caches(len(parts))
        model.forward(torch.zeros(sum(parts), dtype=torch.long), [Segment(c, context, n) for c, n in zip(used, parts)])
        for c in used:
            c.truncate(context)

    return run


def target_step_fn(model: Transformer, one_segment: bool = False, caches=None):
    """step_fn(B): one verify forward over B tokens (TOKENS_PER_REQUEST per request, or all in one request),
    caches pre-filled and rolled back after each call."""
    run = _step_fn(model, caches or _warm_caches(model))
    return lambda b: run([b] if one_segment else _split(b))


def table_cell(b: int) -> tuple[int, int] | None:
    """The grid cell (R, k) whose step is the table's step over B tokens (all requests verifying k), if any."""
    parts = _split(b)
    return (len(parts), parts[0]) if len(set(parts)) == 1 else None


def grid_step_fn(model: Transformer, caches=None):
    """grid_fn(R, k): one forward of R requests verifying k tokens each."""
    run = _step_fn(model, caches or _warm_caches(model))
    return lambda r, k: run([k] * r)


def long_context(model: Transformer) -> int:
    """The context the context prices are measured at: LONG_CONTEXT, or what the model's window leaves room for
    (0: too short a window to measure anything)."""
    longest = min(LONG_CONTEXT, model.config.max_position - 128 - 8)
    return longest if longest >= 2 * CONTEXT else 0


def context_step_fn(model: Transformer, context: int):
    """grid_fn(R, k) with every request holding ``context`` tokens of context instead of CONTEXT."""
    run = _step_fn(model, _warm_caches(model, context), context)
    return lambda r, k: run([k] * r)


def prefill_at_fn(model: Transformer, start: int, longest: int = max(PREFILL_TOKENS)):
    """run(P): one forward of a P-token prompt chunk alone (P <= ``longest``) that starts after ``start`` tokens of
    its prompt (the next chunk of a long prompt: it attends to those too; 0: the first chunk)."""
    cache = model.new_cache(start + longest + 8)
    if start:
        model.forward(torch.arange(start) % model.config.vocab_size, [Segment(cache, 0, start)],
                      logit_rows=torch.tensor([start - 1]))

    def run(prompt: int) -> None:
        model.forward(torch.zeros(prompt, dtype=torch.long), [Segment(cache, start, prompt)],
                      logit_rows=torch.tensor([prompt - 1]))
        cache.truncate(start)

    return run


def prefill_step_fn(model: Transformer, caches=None, longest: int = 1024):
    """run(P, R): one forward of a P-token prompt chunk (a fresh cache) beside R requests decoding one token each,
    as the engine fuses a new request's prefill into a decoding step (R = 0: the prompt alone)."""
    caches = caches or _warm_caches(model)
    fresh = model.new_cache(longest)

    def run(prompt: int, n_requests: int) -> None:
        used = caches(n_requests)
        segments = [Segment(fresh, 0, prompt)] + [Segment(c, CONTEXT, 1) for c in used]
        model.forward(torch.zeros(prompt + n_requests, dtype=torch.long), segments,
                      logit_rows=torch.arange(prompt - 1, prompt + n_requests))
        fresh.truncate(0)
        for c in used:
            c.truncate(CONTEXT)

    return run


def _by_load(run):
    """prefill_fn(R, P) for measure_profile, from run(P, R)."""
    return lambda n_requests, prompt: run(prompt, n_requests)


def drafter_step_fn(model: Transformer, drafter, depth: int | None = None):
    """draft_fn(R, depth=depth): one propose() of ``depth`` slots (None: the full block) for R requests with warm
    256-token contexts (prefilled and observed once; a proposal commits nothing, so every call drafts from the
    same state)."""
    from ..decoding import SamplingParams, make_generator
    from ..drafters.base import DraftRequest

    requests: list = []
    params = SamplingParams(temperature=1.0)

    def step(r: int, depth: int | None = depth) -> None:
        while len(requests) < r:
            ids = (torch.arange(CONTEXT) * 31 + 7 * len(requests)) % model.config.vocab_size
            out = model.forward(ids, [Segment(model.new_cache(CONTEXT + 8), 0, CONTEXT)], logit_rows=ids[:1] * 0,
                                hidden_layers=drafter.needs_layers)
            req = DraftRequest(tokens=ids.tolist() + [int(ids[-1])], params=params,
                               generator=make_generator(len(requests)))
            drafter.observe(req, out.hidden, CONTEXT)
            requests.append(req)
        drafter.propose(requests[:r], depth=depth)

    return step


def measure_raw(model: Transformer, key: ProfileKey, drafter=None, prefill: bool = False,
                repeats: int = 9) -> SpeedProfile:
    """The target's forwards (and the drafter's proposals) as timed alone, before the engine's own work is priced
    in: what ``load_or_profile`` measures, then calibrates and caches."""
    draft = None if drafter is None else drafter_step_fn(model, drafter)
    extra = {} if drafter is None else {"draft_fn": draft, "shallow_draft_fn": functools.partial(draft, depth=1),
                                        "depth_draft_fn": lambda r, d: draft(r, depth=d),
                                        "draft_depth": drafter.gamma, "request_counts": PROFILE_REQUESTS}
    caches = _warm_caches(model)
    longest = long_context(model)
    if longest:
        extra.update(context_fn=context_step_fn(model, longest), context_cells=CONTEXT_CELLS,
                     context_tokens=(CONTEXT, longest))
    if prefill:
        extra.update(prefill_fn=_by_load(prefill_step_fn(model, caches)), prefill_requests=PREFILL_REQUESTS,
                     prefill_tokens=[p for p in PREFILL_TOKENS if p <= model.config.max_position])
        chunk = max(p for p in PREFILL_TOKENS if p <= model.config.max_position)
        if longest and longest + chunk + 8 <= model.config.max_position:
            # the next chunk of a long prompt, after LONG_CONTEXT tokens of it
            extra.update(prefill_context_fn=prefill_at_fn(model, longest), prefill_context_at=(chunk, longest))
    return measure_profile(target_step_fn(model, caches=caches), PROFILE_TOKENS, repeats=repeats, key=key,
                           one_segment_fn=target_step_fn(model, one_segment=True, caches=caches),
                           tokens_per_segment=TOKENS_PER_REQUEST, grid_fn=grid_step_fn(model, caches),
                           grid_requests=PROFILE_REQUESTS, grid_tokens=GRID_TOKENS,
                           min_job_seconds=MIN_JOB_SECONDS, shuffle_seed=0, table_cell=table_cell,
                           reference_every=REFERENCE_EVERY, precise_requests=PRECISE_REQUESTS,
                           precision=PRECISION, precise_seconds=PRECISE_SECONDS, **extra)


def profile_key(model_id: str, dtype: str, drafter_id: str, model: Transformer) -> ProfileKey:
    """The native kernels change the price of a step (projections of a few rows; attention of short segments, the
    per-request cost), so a profile measured without one of them, with another version of the projection kernel,
    or with another row limit for it (kernel_choice; read from `model`, which is therefore required: a key built
    without it never matched the cached one and every such caller re-measured and overwrote the profile) is stale
    and re-measured."""
    used = []
    if (dtype == "float32" and native.kernel() is not None) or model.lm_head.native:  # fp32 or bf16 (session 39)
        rows = "" if not model.lm_head.native else f"<={model.lm_head.native_rows}"
        used.append(f"native@{native.source_hash()[:8]}{rows}")
    if native_attention.usable(model.dtype, model.device):
        used.append(f"attention@{native_attention.source_hash()[:8]}")
    if native_norm.serves(model.dtype, model.device):
        used.append("norm")
    if model.lm_head.pad_to:  # kernel_choice pads oneDNN's few-row calls (the same for every projection)
        used.append("pad" + ",".join(f"{n}>{m}" for n, m in sorted(model.lm_head.pad_to.items())))
    kernels = "+".join(used) or "torch"
    return ProfileKey(model_id=model_id, drafter_id=drafter_id, machine=current_machine(), dtype=dtype,
                      kernels=kernels)


def profile_path(key: ProfileKey) -> Path:
    safe = "".join(ch if ch.isalnum() or ch in "-_." else "_" for ch in f"{key.model_id}-{key.drafter_id}-{key.dtype}")
    return cache_root() / "profiles" / f"{safe}.json"


def load_or_profile(model: Transformer, key: ProfileKey, repeats: int = 9, force: bool = False,
                    drafter=None, prefill: bool = False) -> SpeedProfile:
    """The cached profile for this key, or a fresh measurement (a mismatched cache warns and re-profiles).
    With a drafter, its drafting cost against the number of requests is measured too (key it by
    `drafter.profile_id`). With ``prefill`` the profile must hold the prefill table (a cached one without it is
    measured again, with it): only the simulator prices prompts, so an engine's first start does not measure it
    (49 s without it, 90 s with it on the dev CPU: results/prefill-s25/profile-time.txt)."""
    def measure() -> SpeedProfile:
        log.info("measuring this machine's speed profile for the scheduler (once, a few minutes; cached at %s)",
                 path)
        measured = measure_raw(model, key, drafter, prefill, repeats)
        return calibrated(model, drafter, measured)  # the engine's own work priced in (engine/overhead.py)

    path = profile_path(key)
    if force and path.exists():
        path.unlink()
    return load_or_measure(path, key, measure, usable=lambda p: bool(p.prefill_seconds) or not prefill)
