"""Serving simulator: continuous batching under a verification policy, driven by a speed profile and traces.

Each step every running request replays a random recorded round (``walk``: its next one; confidences c [γ],
accepted count n_acc), the
policy picks ℓ for all of them at once, request r emits min(n_acc_r, ℓ_r) + 1 tokens, and the clock advances by
step_s(B = R + sum ℓ, R requests) + draft_s(R'), R' the requests drafted (all, or fewer on an async probe), the
drafting cost being skipped on steps where the policy's ``prepare`` says the drafter need not run (plain decoding;
the async scheduler at K = 0). Requests join and leave
between steps (``workload.py``), with no batch-size cap. With prompts a new request first spends steps in prefill:
its prompt rides in the same forward as the decoding requests (at most ``prefill_chunk`` prompt tokens per step,
as the engine does), priced by the profile's prefill table (a later chunk also by what attending to the chunks
before it costs), and its first token comes out of the step that finishes the prompt. Decoding steps are priced at
the decoding requests' mean context (prompt and tokens so far), and a policy that prices context is told it, as
the engine tells it. Only model time is priced: an engine's own overhead (scheduling, sampling, streaming; 2-3 %
of a step at C = 16 on the dev CPU) is not. Everything is
seeded; policies compared with the same seed see the same round draws as long as their batches have the same size,
which keeps comparisons between them low-noise.

Reported per run (``SimResult``):
  throughput_tps  aggregate emitted tokens / simulated seconds
  per_user_tps    emitted tokens / request-seconds spent running (= throughput / C for a closed loop)
  mean_budget     mean ℓ: drafts verified per request per step
  tau             mean tokens emitted per request per step, min(n_acc, ℓ) + 1
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Mapping, Sequence

import numpy as np

from .profile import SpeedProfile
from .registry import AsyncPolicy, FixedPolicy, SyncPolicy, ThresholdPolicy
from .traces import AcceptanceTraces, synthetic_traces
from .workload import Arrival, ClosedLoop, Poisson, Requests


def gpu_like_profile(flat_until: int = 128, flat_seconds: float = 0.020, draft_seconds: float = 0.0005,
                     draft_per_request: float = 2e-6) -> SpeedProfile:
    """SYNTHETIC (not measured anywhere): a GPU-shaped curve — a verify step costs ``flat_seconds`` up to
    ``flat_until`` tokens (memory-bound: weights are read once whatever the batch), then grows linearly (compute-
    bound). Drafting costs ``draft_seconds + draft_per_request * R`` (a cheap one-pass parallel drafter)."""
    if flat_until < 1:
        raise ValueError(f"flat_until must be >= 1, got {flat_until}")
    tokens = (flat_until, 32 * flat_until)  # below the first point the profile is flat by construction
    seconds = (flat_seconds, 32 * flat_seconds)
    reqs = (1, 1024)
    dsec = (draft_seconds + draft_per_request, draft_seconds + 1024 * draft_per_request)
    return SpeedProfile(tokens, seconds, reqs, dsec,
                        source=f"synthetic gpu-like (flat to {flat_until} tokens, then linear)")


@dataclass(frozen=True)
class SimResult:
    policy: str
    load: float  # concurrency C (closed loop) or arrival rate (Poisson)
    throughput_tps: float
    per_user_tps: float
    mean_budget: float
    tau: float
    mean_batch_tokens: float  # mean B per step
    steps: int
    sim_seconds: float
    completed: int


def _prefill_take(prefill: np.ndarray, chunk: int) -> np.ndarray:
    """Prompt tokens each request prefills this step: in arrival order, ``chunk`` tokens in all. [R] -> [R]"""
    before = np.cumsum(prefill) - prefill
    return np.clip(chunk - before, 0, prefill)


def simulate(profile: SpeedProfile, traces: AcceptanceTraces, policy, arrival: Arrival, *, seed: int = 0,
             prefill_chunk: int = 512, walk: bool = False) -> SimResult:
    """Run one simulation. ``policy`` is a registry policy object (AsyncPolicy is reset first).

    ``walk``: each request replays consecutive recorded rounds from a random start instead of a random round each
    step. ``dspark calibrate`` records a request's rounds in order, so a walk keeps how a request's confidences
    follow one another (their lag-1 correlation is 0.33 in results/calibration-s34/traces.npz), which is what an
    async scheduler's old confidences can know of the current step; independent draws leave it nothing."""
    if isinstance(policy, AsyncPolicy):
        policy.reset()
    rng = np.random.default_rng(seed)
    gamma, reqs = traces.gamma, Requests(arrival, rng, seed)
    t = t0 = reqs.start
    tokens = steps = completed = 0
    sum_ell = sum_emit = request_steps = sum_b = 0
    busy, end = 0.0, t0  # request-seconds spent running, for per-user speed; the last step's end
    while (t := reqs.admit(t, steps)) is not None:
        remaining, prefill = reqs.remaining, reqs.prefill
        decoding = prefill == 0
        n_dec = int(decoding.sum())
        take = _prefill_take(np.where(decoding, 0, prefill), prefill_chunk)  # [R]
        emit = np.zeros(remaining.size, dtype=np.int64)
        emit[~decoding & (take == prefill)] = 1  # the step that ends a prompt yields its first token
        b, drafted, depth, n_drafted = n_dec + int(take.sum()), False, gamma, 0
        priced = profile  # priced at the decoding requests' mean context when there are any
        if n_dec:  # like the engine: no decoding requests, no policy call
            # Draw rounds even when the drafter is skipped, so policies run with one seed see the same draws.
            rounds = (reqs.cursor[decoding] % len(traces)) if walk else rng.integers(len(traces), size=n_dec)
            reqs.cursor[decoding] += 1
            conf, n_acc = traces.conf[rounds], traces.n_acc[rounds]  # [R_dec, γ], [R_dec]
            context = float(reqs.context[decoding].mean())  # the decoding requests' mean context
            priced = profile.at_context(context)
            drafted = (policy.prepare(n_dec, context=context) if getattr(policy, "prices_context", False)
                       else policy.prepare(n_dec))  # decided before drafting, as an engine must
            depth = policy.draft_depth(gamma) if drafted and hasattr(policy, "draft_depth") else gamma
            conf, n_acc = conf[:, :depth], np.minimum(n_acc, depth)  # drafted shallower: fewer slots exist
            n_drafted = policy.requests_to_draft(n_dec) if drafted and hasattr(policy, "requests_to_draft") else n_dec
            extra = {}
            if n_drafted < n_dec:  # a probe of a few requests: the rest have no drafts (the engine's first rows)
                conf, n_acc, extra = conf.copy(), n_acc.copy(), {"drafted": list(range(n_drafted))}
                conf[n_drafted:], n_acc[n_drafted:] = 0.0, 0
            shown = conf if (drafted and policy.needs_confidence) else None
            ell = policy.select(shown, n_requests=n_dec, gamma=gamma, **extra)
            emit[decoding] = np.minimum(n_acc, ell) + 1
            if shown is not None and hasattr(policy, "observe_outcomes"):
                policy.observe_outcomes(shown, ell, np.minimum(n_acc, ell))
            b += int(ell.sum())
            sum_ell += int(ell.sum())
            sum_emit += int(emit[decoding].sum())
            request_steps += n_dec
        # prompt chunks riding in this step, priced as prefill: (tokens, tokens of the prompt before them)
        chunks = [(int(p), int(s)) for p, s in zip(take[take > 0], (reqs.context - reqs.prefill)[take > 0])]
        dt = float(priced.step_s(b - sum(p for p, _ in chunks), n_requests=n_dec, prefill=chunks)) + (
            float(profile.draft_s(n_drafted, depth)) if drafted else 0.0)
        t += dt
        busy += remaining.size * dt
        steps += 1
        sum_b += b
        got = np.minimum(emit, remaining)  # a request stops at its output length mid-round
        tokens += int(got.sum())
        completed += reqs.advance(take, got)
        end = t
    span = end - t0
    return SimResult(
        policy=getattr(policy, "name", type(policy).__name__),
        load=float(arrival.concurrency if reqs.closed else arrival.rate),
        throughput_tps=tokens / span if span > 0 else 0.0,
        per_user_tps=tokens / busy if busy > 0 else 0.0,
        mean_budget=sum_ell / max(request_steps, 1),
        tau=sum_emit / max(request_steps, 1),
        mean_batch_tokens=sum_b / max(steps, 1),
        steps=steps,
        sim_seconds=span,
        completed=completed,
    )


def default_policies(profile: SpeedProfile, gamma: int = 7, threshold: float = 0.7) -> dict[str, Callable[[], object]]:
    """Factories (fresh objects per run) for the paper's comparison: none, MTP-1, fixed 2..γ, threshold, sync,
    async."""
    pols: dict[str, Callable[[], object]] = {"none": lambda: FixedPolicy(0), "mtp1": lambda: FixedPolicy(1)}
    for k in range(2, gamma + 1):
        pols[f"fixed-{k}"] = lambda k=k: FixedPolicy(k)
    pols[f"threshold-{threshold:g}"] = lambda: ThresholdPolicy(threshold)
    pols["sync"] = lambda: SyncPolicy(profile)
    pols["async"] = lambda: AsyncPolicy(profile)
    return pols


def sweep(profile: SpeedProfile, traces: AcceptanceTraces, concurrencies: Sequence[int] = (1, 8, 64, 256), *,
          policies: Mapping[str, Callable[[], object]] | None = None, output_tokens: int = 256,
          n_steps: int = 400, seed: int = 0, prompt_tokens: int = 0, prompt_mix: Sequence[int] = (),
          output_spread: float = 0.0) -> dict[str, dict[int, SimResult]]:
    """Closed-loop simulation of every policy at every concurrency -> results[policy name][C]."""
    policies = policies or default_policies(profile, traces.gamma)
    out: dict[str, dict[int, SimResult]] = {}
    for name, make in policies.items():
        out[name] = {}
        for c in concurrencies:
            loop = ClosedLoop(c, output_tokens, n_steps, prompt_tokens, tuple(prompt_mix), output_spread)
            out[name][c] = simulate(profile, traces, make(), loop, seed=seed)
    return out


def format_sweep(results: Mapping[str, Mapping[int, SimResult]]) -> str:
    """Markdown table: one row per policy and concurrency."""
    lines = ["| policy | C | throughput tok/s | per-user tok/s | mean budget ℓ | τ |",
             "|---|---:|---:|---:|---:|---:|"]
    for name, by_c in results.items():
        for c, r in by_c.items():
            lines.append(f"| {name} | {c} | {r.throughput_tps:.0f} | {r.per_user_tps:.1f} | {r.mean_budget:.2f} "
                         f"| {r.tau:.2f} |")
    return "\n".join(lines)


def write_sweep_plot(results: Mapping[str, Mapping[int, SimResult]], path: str | os.PathLike, *,
                     title: str = "") -> Path:
    """Two panels: aggregate throughput against concurrency, and throughput against per-user speed (the paper's
    serving trade-off: up and to the right is better). Needs matplotlib (imported here, not by the package)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(11, 4.2))
    FigureCanvasAgg(fig)
    ax1, ax2 = fig.add_subplot(1, 2, 1), fig.add_subplot(1, 2, 2)
    for name, by_c in results.items():
        cs = sorted(by_c)
        thr = [by_c[c].throughput_tps for c in cs]
        style = {"lw": 2.5, "marker": "o"} if name in ("sync", "async") else {"lw": 1, "marker": ".", "alpha": 0.7}
        ax1.plot(cs, thr, label=name, **style)
        ax2.plot([by_c[c].per_user_tps for c in cs], thr, label=name, **style)
    ax1.set(xscale="log", xlabel="concurrency C", ylabel="throughput (tokens/s)")
    ax2.set(xlabel="per-user speed (tokens/s)", ylabel="throughput (tokens/s)")
    ax1.legend(fontsize=7, ncol=2)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    return path


def main(argv: Sequence[str] | None = None) -> dict[str, dict[int, SimResult]]:
    """``python -m dspark.scheduling [--profile table.csv] [--traces traces.npz] [--out DIR]``:
    closed-loop sweep of every policy; prints a Markdown table and, with --out, writes sweep.md/.json/.png."""
    import argparse
    import json
    from dataclasses import asdict

    from .profile_io import load_profile_table

    ap = argparse.ArgumentParser(prog="python -m dspark.scheduling", description=main.__doc__)
    ap.add_argument("--profile", help="user speed table (CSV/JSON tokens,seconds); default: synthetic GPU-like")
    ap.add_argument("--traces", help="acceptance traces .npz (AcceptanceTraces.save); default: synthetic")
    ap.add_argument("--concurrency", default="1,8,64,256", help="comma-separated closed-loop concurrencies")
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--output-tokens", type=int, default=256)
    ap.add_argument("--prompt-tokens", type=int, default=0, help="prompt length each new request prefills")
    ap.add_argument("--prompt-mix", default="", help="comma-separated prompt lengths new requests take in turn")
    ap.add_argument("--output-spread", type=float, default=0.0,
                    help="output lengths spread as output_tokens · U[1 − s, 1 + s]")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", help="directory for sweep.md, sweep.json and sweep.png")
    args = ap.parse_args(argv)
    prof = load_profile_table(args.profile) if args.profile else gpu_like_profile()
    traces = AcceptanceTraces.load(args.traces) if args.traces else synthetic_traces(seed=args.seed)
    cs = tuple(int(c) for c in args.concurrency.split(","))
    mix = tuple(int(p) for p in args.prompt_mix.split(",") if p)
    res = sweep(prof, traces, cs, output_tokens=args.output_tokens, n_steps=args.steps, seed=args.seed,
                prompt_tokens=args.prompt_tokens, prompt_mix=mix, output_spread=args.output_spread)
    table = format_sweep(res)
    print(table)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "sweep.md").write_text(f"profile: {prof.source}\n\n{table}\n", encoding="utf-8")
        rows = [asdict(r) for by_c in res.values() for r in by_c.values()]
        (out / "sweep.json").write_text(json.dumps({"profile": prof.source, "results": rows}, indent=1))
        try:
            write_sweep_plot(res, out / "sweep.png", title=prof.source)
        except ImportError:
            print("matplotlib not installed: no plot")
    return res
