"""`dspark bench acceptance`: how many tokens each drafter gets accepted per round, per set and domain.

Every drafter runs the same prompts through the batched engine with a fixed-γ policy (every drafted token is
verified), so τ measures the drafter alone, not the scheduler. Reported per benchmark set, per domain and as a
macro-average over sets; relative gains against the first drafter; the position-wise *conditional* acceptance
P(slot k accepted | slots < k accepted) over full-length rounds, with a plot. Optionally (`--speed-prompts`)
batch-1 wall-clock speed against plain decoding, interleaved per prompt so machine noise hits both alike.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

from ..decoding import SamplingParams
from ..drafters import make_drafter
from ..engine.engine import Engine, EngineConfig
from ..generate import prompt_ids
from ..models import load_model
from ..scheduling.registry import make_policy
from .common import DOMAINS, load_bench_prompts, machine_info, markdown_table, median, median_seconds, write_results

ALL_SETS = tuple(DOMAINS)


@dataclass(frozen=True)
class AcceptanceConfig:
    model: str = "smollm2-135m-instruct"
    dtype: str = "float32"  # the target's; plain decoding in the speed comparison runs the same target
    drafters: tuple[str, ...] = ("default",)
    sets: tuple[str, ...] = ALL_SETS
    per_set: int = 20
    temperatures: tuple[float, ...] = (0.0, 1.0)
    gamma: int = 7
    max_new_tokens: int = 256
    batch: int = 16  # concurrent requests in the engine (τ does not depend on it: see tests)
    speed_prompts: int = 0  # per set, batch 1, against plain decoding; 0 = skip
    head_latency: bool = False  # time the sequential head at batch 1
    seed: int = 0
    out: Path = field(default=Path("results/acceptance"))

    def __post_init__(self):
        if self.dtype not in ("float32", "bfloat16"):
            raise ValueError(f"dtype must be float32 or bfloat16, not {self.dtype!r}")
        if min(self.per_set, self.gamma, self.max_new_tokens, self.batch) < 1 or self.speed_prompts < 0:
            raise ValueError(f"bench acceptance needs --limit, --gamma, --max-new-tokens and --batch >= 1 and "
                             f"--speed-prompts >= 0 (got {self.per_set}, {self.gamma}, {self.max_new_tokens}, "
                             f"{self.batch}, {self.speed_prompts})")
        if not self.drafters or not self.sets or not self.temperatures or min(self.temperatures) < 0:
            raise ValueError(f"bench acceptance needs at least one drafter, set and temperature, temperatures >= 0 "
                             f"(got {self.drafters}, {self.sets}, {self.temperatures})")


def round_records(engine_requests) -> list[tuple[int, int]]:
    """[(verified ℓ, accepted a)] over all rounds of the given finished requests."""
    return [(v, a) for r in engine_requests for v, a in zip(r.verified_hist, r.accepted_hist)]


def conditional_acceptance(rounds: list[tuple[int, int]], gamma: int) -> list[float | None]:
    """P(slot k accepted | slots < k accepted), k = 1..γ, over rounds that verified all γ slots."""
    full = [a for v, a in rounds if v == gamma]
    out = []
    for k in range(1, gamma + 1):
        reached = sum(a >= k - 1 for a in full)
        out.append(sum(a >= k for a in full) / reached if reached else None)
    return out


def tau_of(rounds: list[tuple[int, int]]) -> float:
    """Mean tokens per round, the bonus/replacement token included."""
    return sum(a + 1 for _, a in rounds) / len(rounds) if rounds else float("nan")


def run_engine(loaded, drafter, prompts: list[tuple[str, list[int]]], temperature: float, cfg: AcceptanceConfig):
    """All prompts through one engine at fixed γ -> (finished requests, wall seconds)."""
    policy = make_policy(f"fixed-{cfg.gamma}")
    engine = Engine(loaded.model, loaded.tokenizer, drafter, policy, loaded.eos_ids,
                    EngineConfig(gamma=cfg.gamma, max_running=cfg.batch))
    reqs = []
    for i, (_, ids) in enumerate(prompts):
        params = SamplingParams(temperature=temperature, max_new_tokens=cfg.max_new_tokens, seed=cfg.seed + i)
        reqs.append(engine.add_request(ids, params))
    t0 = time.perf_counter()
    while any(not r.finished for r in reqs):
        engine.step()
    return reqs, time.perf_counter() - t0


def summarise(name: str, temperature: float, prompts, reqs, seconds: float, gamma: int) -> dict:
    by_set: dict[str, list] = {}
    for (set_name, _), r in zip(prompts, reqs):
        by_set.setdefault(set_name, []).append(r)
    per_set = {s: tau_of(round_records(rs)) for s, rs in by_set.items()}
    domains: dict[str, list[float]] = {}
    for s, t in per_set.items():
        domains.setdefault(DOMAINS.get(s, "other"), []).append(t)
    rounds = round_records(reqs)
    return {"drafter": name, "temperature": temperature, "per_set": per_set,
            "per_domain": {d: sum(v) / len(v) for d, v in domains.items()},
            "macro_tau": sum(per_set.values()) / len(per_set), "micro_tau": tau_of(rounds),
            "conditional_acceptance": conditional_acceptance(rounds, gamma), "rounds": len(rounds),
            "output_tokens": sum(len(r.output) for r in reqs), "seconds": seconds,
            "errors": [r.error for r in reqs if r.error]}


def speed_vs_plain(loaded, drafter, prompts, temperature: float, cfg: AcceptanceConfig) -> dict:
    """Batch-1 tokens/s with the drafter and without, interleaved per prompt."""
    from ..engine.speculative import Generation, TransformerTarget

    target = TransformerTarget(loaded.model, hidden_layers=tuple(getattr(drafter, "needs_layers", ())))
    rates = {"plain": [], "spec": []}
    stats = {"plain": [], "spec": []}
    for i, (_, ids) in enumerate(prompts):
        for kind, d in (("plain", None), ("spec", drafter)):
            params = SamplingParams(temperature=temperature, max_new_tokens=cfg.max_new_tokens, seed=cfg.seed + i)
            gen = Generation(target, d, ids, params, loaded.eos_ids)
            for _ in gen:
                pass
            rates[kind].append(gen.stats.new_tokens / gen.stats.total_s)
            stats[kind].append(gen.stats)
    plain, spec = median(rates["plain"]), median(rates["spec"])
    return {"prompts": len(prompts), "plain_tok_s": plain, "spec_tok_s": spec, "speedup": spec / plain,
            "plain_round": in_loop_round(stats["plain"]), "spec_round": in_loop_round(stats["spec"])}


def in_loop_round(stats) -> dict:
    """Mean ms per round inside the generation loop, by phase, pooled over its prompts: each part timed where
    it runs, after the target forward before it, rather than in head_latency's repeated warm calls."""
    rounds = sum(s.rounds for s in stats)
    phases = {k: 1000 * sum(getattr(s, f"{k}_s") for s in stats) / rounds
              for k in ("propose", "forward", "verify", "observe")}
    decode_s = sum(s.total_s - s.ttft_s for s in stats)
    tokens = sum(s.new_tokens - 1 for s in stats)  # the first token comes from the prefill
    phases["other"] = 1000 * decode_s / rounds - sum(phases.values())
    return {**{f"{k}_ms": v for k, v in phases.items()}, "round_ms": 1000 * decode_s / rounds,
            "tokens_per_round": tokens / rounds, "ms_per_token": 1000 * decode_s / tokens,
            "prefill_ms": 1000 * sum(s.ttft_s for s in stats) / len(stats)}


def head_latency(loaded, drafter, ids: list[int], repeats: int = 20) -> dict | None:
    """Batch-1 cost of a proposal, part by part — the parallel backbone, the draft LM head, and the left-to-right
    block draw (Markov head, sampling, confidence head) — each timed on its own, next to the target's verification
    forward of γ + 1 tokens. The draw is timed directly rather than as propose() with the heads switched off: off,
    the drafter samples in torch instead of the Markov draws' C kernel, and the difference came out negative
    (session 54's bf16 drafter)."""
    import torch

    from ..drafters.base import DraftRequest
    from ..models import Segment

    if getattr(drafter, "model", None) is None:
        return None  # model-free drafters (n-gram): nothing to split
    cache = loaded.model.new_cache()
    out = loaded.model.forward(torch.tensor(ids), [Segment(cache, 0, len(ids))],
                               logit_rows=torch.tensor([len(ids) - 1]), hidden_layers=drafter.needs_layers)
    request = DraftRequest(tokens=list(ids) + [int(out.logits.argmax())], params=SamplingParams(temperature=1.0),
                           generator=torch.Generator().manual_seed(0))
    drafter.observe(request, out.hidden, len(ids))

    def timed(fn) -> float:
        with torch.inference_mode():  # as in propose(): the Markov draws' kernel serves only without autograd
            return median_seconds(fn, repeats) * 1000

    propose = timed(lambda: drafter.propose([request]))
    block = [request.tokens[-1]] * (drafter.gamma + 1)
    verify = timed(lambda: (cache.truncate(len(ids)), loaded.model.forward(
        torch.tensor(block), [Segment(cache, len(ids), len(block))], hidden_layers=drafter.needs_layers)))
    row = {"propose_ms": propose, "verify_forward_ms": verify, "round_ms": propose + verify}
    if not hasattr(drafter, "block_states"):  # a chain drafter (Eagle3): its LM head on γ rows, about γ calls' cost
        rows = torch.randn(1, drafter.gamma, loaded.model.config.hidden_size)
        return {**row, "lm_head_ms": timed(lambda: drafter.draft_logits(rows))}
    with torch.inference_mode():
        h, anchor = drafter.block_states([request])  # [1, γ, d]; [1]
        base = drafter.draft_logits(h)  # [1, γ, Vd]
    draw = timed(lambda: drafter.sample_block(h, base, anchor, [request]))
    return {**row, "backbone_ms": timed(lambda: drafter.block_states([request])),
            "lm_head_ms": timed(lambda: drafter.draft_logits(h)), "draw_ms": draw,
            "draw_share_of_round": draw / (propose + verify)}


def _tables(cfg: AcceptanceConfig, rows: list[dict]) -> str:
    sets = [s for s in cfg.sets]
    md = []
    for t in cfg.temperatures:
        these = [r for r in rows if r["temperature"] == t]
        base = these[0]["macro_tau"] if these else float("nan")
        md += [f"\n## T = {t}\n", markdown_table(
            ["drafter", *sets, "math", "code", "chat", "macro τ", "vs first"],
            [[r["drafter"], *[r["per_set"].get(s, float("nan")) for s in sets],
              *[r["per_domain"].get(d, float("nan")) for d in ("math", "code", "chat")], r["macro_tau"],
              f"{r['macro_tau'] / base:.3f}×"] for r in these])]
        md += ["\nConditional acceptance P(slot k | slots < k), full-length rounds:\n", markdown_table(
            ["drafter", *[f"k={k}" for k in range(1, cfg.gamma + 1)]],
            [[r["drafter"], *["-" if c is None else c for c in r["conditional_acceptance"]]] for r in these])]
        lat = [r for r in these if r.get("head_latency")]
        if lat:
            md += ["\nRound cost at batch 1 (median ms; per token = round / micro τ of this run):\n", markdown_table(
                ["drafter", "propose", "verify forward (γ+1)", "round", "ms per token"],
                [[r["drafter"], r["head_latency"]["propose_ms"], r["head_latency"]["verify_forward_ms"],
                  r["head_latency"]["round_ms"], r["head_latency"]["round_ms"] / r["micro_tau"]] for r in lat])]
            split = [r for r in lat if "draw_ms" in r["head_latency"]]
            md += ["\nA proposal's parts at batch 1, each timed alone (median ms; the draw is the left-to-right "
                   "part: Markov head, sampling, confidence head):\n", markdown_table(
                       ["drafter", "propose", "backbone", "LM head", "block draw", "verify forward (γ+1)",
                        "draw % of round"],
                       [[r["drafter"], *(r["head_latency"][k] for k in ("propose_ms", "backbone_ms", "lm_head_ms",
                                                                        "draw_ms", "verify_forward_ms")),
                         f"{100 * r['head_latency']['draw_share_of_round']:.1f}"] for r in split])] if split else []
        speed = [r for r in these if "speed" in r]
        if speed:
            md += ["\nBatch-1 speed against plain decoding (median tok/s):\n", markdown_table(
                ["drafter", "prompts", "plain", "speculative", "speedup"],
                [[r["drafter"], r["speed"]["prompts"], r["speed"]["plain_tok_s"], r["speed"]["spec_tok_s"],
                  f"{r['speed']['speedup']:.2f}×"] for r in speed])]
            phases = ("propose", "forward", "verify", "observe", "other")
            md += ["\nA round inside those generation loops (mean ms; forward = the target's, verify = the "
                   "acceptance rule, observe = feeding the drafter; prefill excluded):\n", markdown_table(
                       ["drafter", "loop", *phases, "round", "tokens / round", "ms per token"],
                       [[r["drafter"], kind, *(r["speed"][f"{kind}_round"][f"{p}_ms"] for p in phases),
                         r["speed"][f"{kind}_round"]["round_ms"], r["speed"][f"{kind}_round"]["tokens_per_round"],
                         r["speed"][f"{kind}_round"]["ms_per_token"]]
                        for r in speed if "spec_round" in r["speed"] for kind in ("plain", "spec")])]
    return "\n".join(md)


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    temps = sorted({r["temperature"] for r in rows})
    fig, axes = plt.subplots(1, len(temps), figsize=(5 * len(temps), 3.6), squeeze=False)
    for ax, t in zip(axes[0], temps):
        for r in (r for r in rows if r["temperature"] == t):
            ys = r["conditional_acceptance"]
            ax.plot(range(1, len(ys) + 1), [float("nan") if y is None else y for y in ys], marker="o",
                    label=f"{r['drafter']} (τ {r['macro_tau']:.2f})")
        ax.set(title=f"T = {t}", xlabel="draft position k", ylabel="P(accept k | accepted < k)", ylim=(0, 1))
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def run(cfg: AcceptanceConfig) -> dict:
    texts = load_bench_prompts(cfg.sets, cfg.per_set)  # a missing set is reported before the model loads
    loaded = load_model(cfg.model, dtype=cfg.dtype)
    prompts = [(s, prompt_ids(loaded.tokenizer, text, True)) for s, text in texts]
    speed_set = [p for s in cfg.sets for p in [q for q in prompts if q[0] == s][:cfg.speed_prompts]]
    rows = []
    for spec in cfg.drafters:
        drafter = make_drafter(spec, target=loaded.model, gamma=cfg.gamma)
        if drafter is None:
            raise ValueError("bench acceptance compares drafters; 'none' drafts nothing")
        for t in cfg.temperatures:
            reqs, seconds = run_engine(loaded, drafter, prompts, t, cfg)
            row = summarise(spec, t, prompts, reqs, seconds, cfg.gamma)
            if speed_set:
                row["speed"] = speed_vs_plain(loaded, drafter, speed_set, t, cfg)
            if cfg.head_latency and t == cfg.temperatures[0]:
                row["head_latency"] = head_latency(loaded, drafter, prompts[0][1])
            rows.append(row)
            print(f"{spec} T={t}: macro τ {row['macro_tau']:.3f} ({row['rounds']} rounds, {seconds:.0f} s)",
                  flush=True)
    data = {"config": {k: str(v) if isinstance(v, Path) else v for k, v in cfg.__dict__.items()},
            "machine": machine_info(), "results": rows}
    md = (f"# Acceptance ({cfg.model} in {cfg.dtype}, γ = {cfg.gamma}, {cfg.per_set} prompts per set, "
          f"{cfg.max_new_tokens} new tokens, fixed-γ verification)\n\nMachine: {data['machine']['cpu']}, "
          f"torch {data['machine']['torch']}, {data['machine']['date']}\n" + _tables(cfg, rows) + "\n")
    write_results(cfg.out, "acceptance", data, md)
    plot(rows, cfg.out / "conditional_acceptance.png")
    print(md)
    return data
