"""`dspark bench serve`: closed-loop serving throughput vs per-user speed for each verification policy.

In-process (no HTTP) so the numbers are the engine's: C clients each keep one request in flight; when one
finishes the next prompt starts (`closed_loop.py`). At each concurrency every policy's clients run at once, their
engines stepped in turn and each timed on its own clock, for a fixed budget of that clock after an optional
warm-up; so a machine whose speed drifts (the dev VM switches between modes ~20 % apart for seconds at a time)
slows all policies alike. `sequential` runs the cells one after another instead. With `repeats` > 1 each repeat
visits every concurrency again; cells report medians over repeats, and `paired_ratios` compares the scheduler
with the best fixed policy repeat by repeat (the fastest fixed policy of each repeat, and the fixed policy fastest
over all repeats).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from ..decoding import SamplingParams
from ..drafters import make_drafter
from ..engine.engine import Engine, EngineConfig
from ..engine.llm import build_policy
from ..generate import prompt_ids
from ..models import load_model
from ..scheduling.profile_io import profile_to_dict
from ..scheduling.registry import check_spec
from .closed_loop import ClosedLoop, run_cell, run_loops
from .common import load_bench_prompts, machine_info, markdown_table, median, write_results

ALL_SETS = ("gsm8k", "math500", "humaneval", "mbpp", "mt-bench", "arena-hard-v2")


@dataclass(frozen=True)
class ServeBenchConfig:
    model: str = "smollm2-135m-instruct"
    drafter: str = "ngram"
    dtype: str = "float32"
    policies: tuple[str, ...] = ("none", "mtp1", "fixed-3", "fixed-7")
    concurrency: tuple[int, ...] = (1, 2, 4, 8, 16, 32)
    gamma: int = 7
    max_new_tokens: int = 96
    seconds_per_cell: float = 20.0
    repeats: int = 1
    warmup_s: float = 0.0  # per cell: run until the first wave of requests finished (at most this long), then measure
    temperature: float = 0.0
    top_p: float = 1.0
    out: Path = field(default=Path("results/serving"))
    traces: Path | None = None  # acceptance traces of this drafter: also simulate each cell (see `simulated`)
    sequential: bool = False  # run each policy's cell alone instead of stepping all policies' loops in turn
    length_spread: float = 0.5  # request i may produce up to max_new_tokens · u_i, u_i ~ U[1 − s, 1 + s] (seeded)
    requests_per_client: int = 0  # > 0: each cell is the same C × this many requests for every policy, not a time
    prompt_tokens: int = 0  # > 0: every prompt lengthened to at least this many tokens (see `lengthened`)
    prefix_cache: bool = True  # copy shared prompt prefixes (the mix's prompts recur once a cell sends more than 48)

    def __post_init__(self):
        if not 0 <= self.length_spread < 1:
            raise ValueError(f"bench serve needs 0 <= length spread < 1, got {self.length_spread}")
        if self.requests_per_client < 0 or self.prompt_tokens < 0:
            raise ValueError(f"bench serve needs requests per client >= 0 and prompt tokens >= 0, got "
                             f"{self.requests_per_client}, {self.prompt_tokens}")
        if self.repeats < 1 or self.seconds_per_cell <= 0 or self.warmup_s < 0 or not self.policies \
                or not self.concurrency or min(self.concurrency) < 1:
            raise ValueError("bench serve needs repeats >= 1, seconds > 0, warmup >= 0, at least one policy and "
                             f"concurrency levels >= 1 (got repeats={self.repeats}, seconds={self.seconds_per_cell}, "
                             f"warmup={self.warmup_s}, policies={self.policies}, concurrency={self.concurrency})")
        for spec in self.policies:  # before the model loads
            check_spec(spec)


def setup(cfg: ServeBenchConfig):
    """(loaded target, drafter, prompts, sampling params, {policy: engine}) exactly as the benchmark uses them."""
    loaded = load_model(cfg.model, dtype=cfg.dtype)
    drafter = make_drafter(cfg.drafter, target=loaded.model, gamma=cfg.gamma)
    if cfg.traces is not None and drafter is not None:  # measured (if absent) before the policies read it
        simulator_profile(cfg, loaded, drafter)
    texts = [text for _, text in mixed(load_bench_prompts(ALL_SETS, 8))]
    if cfg.prompt_tokens:
        texts = lengthened(texts, lambda t: len(prompt_ids(loaded.tokenizer, t, chat=True)), cfg.prompt_tokens,
                           loaded.model.config.max_position - cfg.max_new_tokens * 2 - cfg.gamma - 1)
    prompts = [prompt_ids(loaded.tokenizer, text, chat=True) for text in texts]
    params = SamplingParams(temperature=cfg.temperature, top_p=cfg.top_p, max_new_tokens=cfg.max_new_tokens, seed=0)
    engines = {}
    for name in cfg.policies:
        policy = build_policy(name, drafter, cfg.model, cfg.dtype, loaded.model, cfg.gamma)
        engines[name] = Engine(loaded.model, loaded.tokenizer, drafter if name != "none" else None, policy,
                               loaded.eos_ids, EngineConfig(gamma=cfg.gamma, max_running=max(cfg.concurrency),
                                                            prefix_cache=cfg.prefix_cache))
    return loaded, drafter, prompts, params, engines


def lengthened(texts: list[str], count, at_least: int, at_most: int) -> list[str]:
    """Each prompt behind a document made of the prompts after it in the mix (in turn) until it holds at least
    ``at_least`` tokens (``count(text)``), never more than ``at_most``: long-context serving from the same prompts,
    every policy given the same texts."""
    if at_least > at_most:
        raise ValueError(f"prompts of {at_least} tokens leave no room for the answers in this model's context "
                         f"(at most {at_most})")
    out = []
    for i, text in enumerate(texts):
        doc, j = [], i + 1
        while count(_with_document(doc, text)) < at_least and j < i + 4 * len(texts):
            candidate = doc + [texts[j % len(texts)]]
            if count(_with_document(candidate, text)) > at_most:
                break
            doc, j = candidate, j + 1
        out.append(_with_document(doc, text))
    return out


def _with_document(doc: list[str], question: str) -> str:
    return question if not doc else "Read this first:\n\n" + "\n\n".join(doc) + "\n\nNow: " + question


def live_factors(policy) -> dict[str, float]:
    """A live-priced policy's correction factors after a cell (measured / cached price of plain, verify and
    drafting steps; scheduling/live_profile.py), so a run shows how far the machine had drifted from its profile."""
    live = getattr(policy, "live", None)
    return {} if live is None else {f"live_{cls}": f for cls, f in live.factors().items()}


def mixed(pairs: list[tuple[str, str]]) -> list[tuple[str, str]]:
    """Round-robin over the sets (gsm8k 1, math500 1, ..., gsm8k 2, ...). The clients take prompts in order and a
    low-concurrency cell gets through only ~8 of them, so in set order it would measure math alone: the domain
    where speculation pays most (sessions before 9 did, and overstated what every drafting policy gains at C <= 2)."""
    by_set: dict[str, list[tuple[str, str]]] = {}
    for name, text in pairs:
        by_set.setdefault(name, []).append((name, text))
    rows = list(by_set.values())
    return [row[i] for i in range(max(map(len, rows), default=0)) for row in rows if i < len(row)]


def rotated(prompts: list, rep: int, repeats: int) -> list:
    """Repeat `rep` starts 1/repeats further along the mix, so repeats see different prompts (every policy the same)."""
    start = rep * len(prompts) // repeats
    return prompts[start:] + prompts[:start]


def run(cfg: ServeBenchConfig) -> dict:
    loaded, drafter, prompts, params, engines = setup(cfg)
    for engine in engines.values():
        run_cell(engine, prompts, 1, params, min(2.0, cfg.seconds_per_cell))  # warm-up
    runs = []
    for rep in range(cfg.repeats):
        for c in cfg.concurrency:
            for name, cell in measure(engines, rotated(prompts, rep, cfg.repeats), c, params, cfg):
                cell = {"policy": name, "repeat": rep, **cell, **live_factors(engines[name].policy)}
                runs.append(cell)
                print(f"#{rep} {name:10s} C={c:3d}: {cell['throughput_tok_s']:7.1f} tok/s aggregate, "
                      f"{cell['per_user_tok_s']:6.1f} tok/s per user, budget {cell['mean_verify_budget']:.2f}, "
                      f"tau {cell['tau']:.2f}" + "".join(f", {k} ×{v:.2f}" for k, v in cell.items()
                                                         if k.startswith("live_")), flush=True)
    cells = median_cells(runs)
    if cfg.traces is not None:
        simulated(cfg, loaded, drafter, cells, prompt_mix=tuple(map(len, prompts)), runs=runs)
    matched = per_user_at_matched_throughput(cells) if "mtp1" in cfg.policies else []
    paired = paired_ratios(runs) if "async" in cfg.policies else []
    variants = {v: paired_ratios(runs, v) for v in cfg.policies if is_async_variant(v)}  # paired columns
    profile = scheduler_profile(cfg, loaded, drafter, engines)
    data = {"config": {k: str(v) if isinstance(v, Path) else v for k, v in cfg.__dict__.items()},
            "machine": machine_info(), "profile": profile and profile_to_dict(profile), "cells": cells, "per_user_vs_mtp1_at_matched_throughput": matched,
            "async_paired_ratios": paired,
            **{f"{v.replace('-', '_')}_paired_ratios": r for v, r in variants.items()}, "runs": runs}
    sim = cfg.traces is not None
    md = (f"# Serving benchmark ({cfg.model}, drafter {cfg.drafter}, T={cfg.temperature:g}, "
          + (f"top-p {cfg.top_p:g}, " if cfg.top_p < 1 else "")
          + f"{cfg.max_new_tokens} ± {100 * cfg.length_spread:g} % new tokens per request, "
          + (f"the same {cfg.requests_per_client} × C requests per cell for every policy"
             if cfg.requests_per_client else f"{cfg.seconds_per_cell:g} s per cell")
          + (f", prompts lengthened to >= {cfg.prompt_tokens} tokens" if cfg.prompt_tokens else "")
          + (", cells one after another" if cfg.sequential else ", policies stepped in turn")
          + (f" after up to {cfg.warmup_s:g} s of warm-up (first wave)" if cfg.warmup_s and not cfg.requests_per_client
             else "")
          + f", {cfg.repeats} repeat(s), "
          f"medians)\n\n"
          + (f"The schedulers' speed profile: {profile.source}\n\n" if profile else "")
          + markdown_table(["policy", "C", "tok/s", "tok/s range", "per-user tok/s", "verify budget", "tau",
                            "finished", "drafter % of step", "engine overhead % of step"]
                           + (["simulated tok/s", "simulated budget", "measured / simulated"] if sim else []),
                           [[c["policy"], c["concurrency"], c["throughput_tok_s"],
                             f"{c['throughput_min']:.1f}–{c['throughput_max']:.1f}", c["per_user_tok_s"],
                             c["mean_verify_budget"], c["tau"], c["finished_requests"],
                             f"{100 * c['drafter_fraction']:.1f}", f"{100 * c['overhead_fraction']:.1f}"]
                            + ([c["sim_throughput_tok_s"], c["sim_mean_budget"],
                                f"{c['throughput_tok_s'] / c['sim_throughput_tok_s']:.2f}"] if sim else [])
                            for c in cells]) + "\n")
    if paired:
        rows = [[r["concurrency"], _span(r["vs_best_fixed"]), f"{_span(r['vs_best_policy'])} ({r['best_policy']})",
                 _span(r["vs_none"])] for r in paired]
        for ratios in variants.values():  # same concurrency levels in the same order
            for row, o in zip(rows, ratios):
                row += [_span(o["vs_best_fixed"]), _span(o["vs_best_policy"]), _span(o["vs_async"])]
        md += (f"\nAsync scheduler's throughput over the best of the fixed policies run (none, mtp1, fixed-K) and over "
               f"none, paired within each of {cfg.repeats} repeat(s): median [min, max]. \"best fixed\": the fastest "
               f"fixed policy of each repeat; \"best fixed policy\": the one fixed policy with the highest median "
               f"throughput, named, in every repeat (see `paired_ratios`)\n\n"
               + markdown_table(["C", "async / best fixed", "async / best fixed policy", "async / none"]
                                + [f"{v} / {ref}" for v in variants
                                   for ref in ("best fixed", "best fixed policy", "async")], rows)
               + "\n")
    live = [c for c in cells if any(k.startswith("live_") for k in c)]
    if live:
        md += ("\nLive prices at the end of each cell (median over repeats): measured / cached price of plain steps, "
               "verify steps and proposals (scheduling/live_profile.py)\n\n"
               + markdown_table(["policy", "C", "plain", "verify", "draft"],
                                [[c["policy"], c["concurrency"], *(f"{c[f'live_{k}']:.3f}" for k in
                                                                   ("plain", "verify", "draft"))] for c in live])
               + "\n")
    if matched:
        others = [p for p in dict.fromkeys(c["policy"] for c in cells) if p != "mtp1"]
        md += ("\nPer-user speed at MTP-1's aggregate throughput, as a multiple of MTP-1's (– : the policy's curve "
               "never reaches that throughput):\n\n"
               + markdown_table(["C (MTP-1)", "tok/s", *others],
                                [[r["concurrency"], r["throughput_tok_s"],
                                  *["–" if r[p] is None else f"{r[p]:.2f}" for p in others]] for r in matched])
               + "\n")
    write_results(cfg.out, "serving", data, md)
    plot(cells, cfg.out)
    print(md)
    return data


def measure(engines: dict[str, Engine], prompts, concurrency: int, params: SamplingParams,
            cfg: ServeBenchConfig):
    """(policy, cell) for every engine at this concurrency: all policies' closed loops stepped in turn (each
    timed on its own clock), or one after another with `cfg.sequential`. Each cell starts with no finished
    request kept as a prefix donor: the engines outlive cells, and the prompts an earlier cell left behind would
    spare later cells their prefills."""
    for engine in engines.values():
        engine.reset_prefix_cache()
    limit = cfg.requests_per_client * concurrency or None
    seconds = None if limit else cfg.seconds_per_cell
    if cfg.sequential:
        return [(name, run_cell(engine, prompts, concurrency, params, seconds, cfg.warmup_s, cfg.length_spread,
                                limit)) for name, engine in engines.items()]
    loops = [ClosedLoop(engine, prompts, concurrency, params, cfg.length_spread, limit=limit)
             for engine in engines.values()]
    return list(zip(engines, run_loops(loops, seconds, cfg.warmup_s)))


def scheduler_profile(cfg: ServeBenchConfig, loaded, drafter, engines):
    """The cached speed profile the run's load-dependent policies priced steps by (None: no policy reads one), so
    that a run records what its decisions were made from."""
    if drafter is None or not any(getattr(e.policy, "load_dependent", False) for e in engines.values()):
        return None
    from ..engine.profiling import load_or_profile, profile_key
    return load_or_profile(loaded.model, profile_key(cfg.model, cfg.dtype, drafter.profile_id, loaded.model),
                           drafter=drafter)


def simulator_profile(cfg: ServeBenchConfig, loaded, drafter):
    """This machine's cached profile with the prefill table the simulator prices new requests' prompts by."""
    from ..engine.profiling import load_or_profile, profile_key

    key = profile_key(cfg.model, cfg.dtype, drafter.profile_id, loaded.model)
    return load_or_profile(loaded.model, key, drafter=drafter, prefill=True)


def simulated(cfg: ServeBenchConfig, loaded, drafter, cells: list[dict], prompt_mix: tuple[int, ...],
              runs: list[dict] = ()) -> None:
    """Add the serving simulator's prediction to every measured cell: the same policies (built the same way,
    over the same cached speed profile, with this drafter's measured drafting cost), closed-loop clients at the
    same concurrency and output lengths (the same spread; with `requests_per_client`, as many requests from a cold
    start, drain included, each as long as the measured run's request in that place: `output_lengths` of `runs`,
    since with a few long prompts the draws of the spread, and where a request met its EOS, move a cell by tens of
    per cent), new requests prefilling the benchmark's prompt lengths in turn (`prompt_mix`, rotated per repeat as
    `rotated` does the prompts) in the shared forward, less the prompt tokens the measured request copied from
    another's cache (`cached_prompt_tokens` of `runs`: the mix's 64 prompts recur within a cell, so with prefix reuse
    most prompts after the first round cost no prefill), rounds replayed from `cfg.traces` (recorded with this
    drafter); medians over the repeats, as the measured cells."""
    from ..scheduling.simulator import ClosedLoop, simulate
    from ..scheduling.traces import AcceptanceTraces

    traces = AcceptanceTraces.load(cfg.traces)
    if traces.gamma != cfg.gamma:
        raise ValueError(f"{cfg.traces} was recorded at γ = {traces.gamma}, the benchmark runs γ = {cfg.gamma}")
    profile = simulator_profile(cfg, loaded, drafter)
    for cell in cells:
        sims = []
        for rep in range(cfg.repeats):
            policy = build_policy(cell["policy"], drafter, cfg.model, cfg.dtype, loaded.model, cfg.gamma)
            measured = [r for r in runs if (r["policy"], r["concurrency"], r["repeat"]) ==
                        (cell["policy"], cell["concurrency"], rep)]
            replay = measured[0] if measured and cfg.requests_per_client else {}
            outputs, cached = (tuple(replay.get(k, ())) for k in ("output_lengths", "cached_prompt_tokens"))
            loop = ClosedLoop(cell["concurrency"], cfg.max_new_tokens, output_spread=cfg.length_spread,
                              prompt_mix=rotated(prompt_mix, rep, cfg.repeats),
                              requests_per_client=cfg.requests_per_client, output_mix=tuple(max(1, n) for n in outputs),
                              cached_mix=cached)
            sims.append(simulate(profile, traces, policy, loop, seed=0, prefill_chunk=EngineConfig().prefill_chunk))
        cell.update({f"sim_{k}": median([getattr(r, attr) for r in sims]) for k, attr in (
            ("throughput_tok_s", "throughput_tps"), ("per_user_tok_s", "per_user_tps"), ("mean_budget", "mean_budget"),
            ("tau", "tau"))})


def _best_fixed_policy(by: dict, concurrency: int) -> str | None:
    """The fixed policy with the highest median throughput over the repeats at this concurrency (None: none ran)."""
    runs: dict[str, list[float]] = {}
    for (p, c, _), v in by.items():
        if c == concurrency and _is_fixed(p):
            runs.setdefault(p, []).append(v)
    return max(runs, key=lambda p: median(runs[p]), default=None)


def _is_fixed(policy: str) -> bool:
    return policy in ("none", "mtp1") or policy.startswith("fixed-")


def _span(values: list[float] | None) -> str:
    return "–" if not values else f"{median(values):.3f} [{min(values):.3f}, {max(values):.3f}]"


def median_cells(runs: list[dict]) -> list[dict]:
    """One cell per (policy, C), in first-seen order: the median of every numeric field over repeats, plus the
    throughput's min and max and the number of repeats."""
    groups: dict[tuple, list[dict]] = {}
    for r in runs:
        groups.setdefault((r["policy"], r["concurrency"]), []).append(r)
    order = {p: i for i, p in enumerate(dict.fromkeys(r["policy"] for r in runs))}
    cells = []
    for (policy, c), rs in sorted(groups.items(), key=lambda kv: (order[kv[0][0]], kv[0][1])):
        cell = {k: median(r[k] for r in rs) for k, v in rs[0].items()
                if isinstance(v, (int, float)) and k not in ("concurrency", "repeat")}
        thr = [r["throughput_tok_s"] for r in rs]
        cells.append({"policy": policy, "concurrency": c, **cell, "throughput_min": min(thr),
                      "throughput_max": max(thr), "repeats": len(rs)})
    return cells


def is_async_variant(policy: str) -> bool:
    """Async schedulers reported beside the default in the paired table: async-online, async:<options>."""
    return policy != "async" and policy.startswith("async")


def paired_ratios(runs: list[dict], policy: str = "async") -> list[dict]:
    """Per concurrency, `policy`'s throughput over the best fixed policy (none, mtp1, fixed-K) and over none, each
    ratio taken within one repeat (cells run back to back), listed over repeats.

    Two readings of "the best fixed policy": ``vs_best_fixed`` divides by the fastest fixed policy of each repeat
    (an oracle that picks after seeing the noise: where two fixed policies are within the noise of each other, the
    max of the pair sits above both, so this errs against the scheduler); ``vs_best_policy`` divides, in every
    repeat, by the one fixed policy ``best_policy`` with the highest median throughput over the repeats (the
    fixed policy a user would have picked from this run)."""
    by = {(r["policy"], r["concurrency"], r.get("repeat", 0)): r["throughput_tok_s"] for r in runs}
    rows = []
    for c in dict.fromkeys(r["concurrency"] for r in runs):
        reps = sorted({k[2] for k in by if k[0] == policy and k[1] == c})
        best, none = [], []
        for rep in reps:
            fixed = [v for (p, cc, rr), v in by.items() if cc == c and rr == rep and _is_fixed(p)]
            mine = by[(policy, c, rep)]
            if fixed:
                best.append(mine / max(fixed))
            if ("none", c, rep) in by:
                none.append(mine / by[("none", c, rep)])
        top = _best_fixed_policy(by, c)
        row = {"concurrency": c, "vs_best_fixed": best, "vs_none": none, "best_policy": top,
               "vs_best_policy": [by[(policy, c, rep)] / by[(top, c, rep)] for rep in reps if (top, c, rep) in by]}
        if policy != "async":  # a variant: also against the default scheduler it modifies
            row["vs_async"] = [by[(policy, c, rep)] / by[("async", c, rep)] for rep in reps if ("async", c, rep) in by]
        rows.append(row)
    return rows


def per_user_at_matched_throughput(cells: list[dict], reference: str = "mtp1") -> list[dict]:
    """The paper's Figure-7 comparison as numbers: for each `reference` cell, the per-user speed every other
    policy reaches at the same aggregate throughput, interpolated linearly along that policy's curve over
    concurrency (per-user = aggregate / C, the closed-loop mean); the best where its curve passes that throughput
    more than once, None where it never does."""
    curves: dict[str, list[tuple[float, float]]] = {}
    for c in sorted(cells, key=lambda c: c["concurrency"]):
        curves.setdefault(c["policy"], []).append((c["throughput_tok_s"], c["throughput_tok_s"] / c["concurrency"]))
    rows = []
    for ref in (c for c in cells if c["policy"] == reference):
        x, ref_pu = ref["throughput_tok_s"], ref["throughput_tok_s"] / ref["concurrency"]
        row = {"concurrency": ref["concurrency"], "throughput_tok_s": x, "reference_per_user_tok_s": ref_pu}
        for name, pts in curves.items():
            if name == reference:
                continue
            found = [pu0 + (pu1 - pu0) * ((x - t0) / (t1 - t0) if t1 != t0 else 0.0)
                     for (t0, pu0), (t1, pu1) in zip(pts, pts[1:]) if min(t0, t1) <= x <= max(t0, t1)]
            row[name] = max(found) / ref_pu if found else None
        rows.append(row)
    return rows


def plot(cells: list[dict], out: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    for policy in dict.fromkeys(c["policy"] for c in cells):
        pts = [c for c in cells if c["policy"] == policy]
        a.plot([p["per_user_tok_s"] for p in pts], [p["throughput_tok_s"] for p in pts], marker="o", label=policy)
        b.plot([p["concurrency"] for p in pts], [p["mean_verify_budget"] for p in pts], marker="o", label=policy)
    a.set_xlabel("per-user tokens/s (median)")
    a.set_ylabel("aggregate tokens/s")
    a.set_title("throughput vs per-user speed")
    b.set_xscale("log", base=2)
    b.set_xlabel("concurrency")
    b.set_ylabel("drafts verified per request per step")
    b.set_title("verification budget vs load")
    for ax in (a, b):
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(out / "serving.png", dpi=120)
    plt.close(fig)
