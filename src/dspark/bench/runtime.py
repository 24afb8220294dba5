"""`dspark bench runtime`: batch-1 decoding speed of our runtime vs transformers, and the forward speed curve.

All systems run side by side in one process, interleaved per prompt so machine noise hits them alike:
HF `generate` (fp32) vs our plain decoding, HF prompt-lookup assisted generation vs our n-gram speculation, and
the batched engine with one request, as `dspark generate` runs it: plain (`--drafter none`: the engine's own cost
at batch 1) and with its defaults (`--drafter auto --policy auto`).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..decoding import SamplingParams
from ..drafters import make_drafter
from ..engine.engine import Engine
from ..engine.llm import build_policy
from ..engine.speculative import Generation, TransformerTarget
from ..scheduling.registry import make_policy
from ..generate import prompt_ids
from ..models import Segment, load_model
from .common import load_bench_prompts, machine_info, markdown_table, median, write_results
from .kernels import projection_kernels

HF_LOOKUP_TOKENS = 10  # transformers' documented prompt_lookup_num_tokens example value
CURVE_TOKENS = (1, 2, 4, 6, 8, 12, 16, 24, 32)
CURVE_CONTEXT = 256


@dataclass(frozen=True)
class RuntimeBenchConfig:
    model: str = "smollm2-135m-instruct"
    dtype: str = "float32"
    per_set: int = 5
    sets: tuple[str, ...] = ("humaneval", "gsm8k", "mt-bench")
    max_new_tokens: int = 128
    temperatures: tuple[float, ...] = (0.0, 1.0)
    hf: bool = True
    out: Path = field(default=Path("results/runtime"))

    def __post_init__(self):
        if self.per_set < 1 or self.max_new_tokens < 1 or not self.sets or not self.temperatures \
                or min(self.temperatures) < 0:
            raise ValueError(f"bench runtime needs --per-set and --max-new-tokens >= 1 and at least one set and "
                             f"temperature >= 0 (got {self.per_set}, {self.max_new_tokens}, {self.sets}, "
                             f"{self.temperatures})")


def _ours(target, drafter, ids, temperature, max_new, eos, seed) -> dict:
    params = SamplingParams(temperature=temperature, max_new_tokens=max_new, seed=seed)
    gen = Generation(target, drafter, ids, params, eos)
    for _ in gen:
        pass
    s = gen.stats
    return {"tokens": s.new_tokens, "seconds": s.total_s, "tau": s.tau if drafter else 1.0}


def _engine(engine: Engine, ids, temperature, max_new, seed) -> dict:
    req = engine.add_request(ids, SamplingParams(temperature=temperature, max_new_tokens=max_new, seed=seed))
    while not req.finished:
        engine.step()
    if req.finish_reason == "error":
        raise RuntimeError(f"engine request failed: {req.error}")
    return {"tokens": len(req.output), "seconds": req.finished_at - req.arrival, "tau": req.tau}


def generate_engines(cfg: RuntimeBenchConfig, loaded) -> dict[str, Engine]:
    """`dspark generate`'s engine with --drafter none, and with its defaults (auto drafter, auto policy)."""
    auto = make_drafter("auto", target=loaded.model, gamma=7, scheduled=True)
    policy = build_policy("auto", auto, cfg.model, cfg.dtype, loaded.model, 7)
    return {"engine plain": Engine(loaded.model, loaded.tokenizer, None, make_policy("none"), loaded.eos_ids),
            f"engine {auto.name} {policy.name}": Engine(loaded.model, loaded.tokenizer, auto, policy, loaded.eos_ids)}


def _hf(model, ids, temperature, max_new, lookup: bool, seed) -> dict:
    torch.manual_seed(seed)
    kwargs = dict(max_new_tokens=max_new, do_sample=temperature > 0, pad_token_id=model.config.eos_token_id)
    if temperature > 0:
        kwargs.update(temperature=temperature, top_k=0, top_p=1.0)
    if lookup:
        kwargs["prompt_lookup_num_tokens"] = HF_LOOKUP_TOKENS
    x = torch.tensor([ids])
    t0 = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(x, **kwargs)
    return {"tokens": int(out.shape[1] - x.shape[1]), "seconds": time.perf_counter() - t0}


def decode_benchmark(cfg: RuntimeBenchConfig, loaded, hf_model) -> list[dict]:
    target = TransformerTarget(loaded.model)
    ngram = make_drafter("ngram", target=loaded.model, gamma=7)
    engines = generate_engines(cfg, loaded)
    prompts = load_bench_prompts(cfg.sets, cfg.per_set)
    runs = []
    for temperature in cfg.temperatures:
        for i, (set_name, text) in enumerate(prompts):
            ids = prompt_ids(loaded.tokenizer, text, chat=True)
            systems = {"ours plain": lambda: _ours(target, None, ids, temperature, cfg.max_new_tokens,
                                                   loaded.eos_ids, i),
                       "ours ngram": lambda: _ours(target, ngram, ids, temperature, cfg.max_new_tokens,
                                                   loaded.eos_ids, i)}
            for name, engine in engines.items():
                systems[name] = (lambda e: lambda: _engine(e, ids, temperature, cfg.max_new_tokens, i))(engine)
            if hf_model is not None:
                systems["hf generate"] = lambda: _hf(hf_model, ids, temperature, cfg.max_new_tokens, False, i)
                systems["hf prompt lookup"] = lambda: _hf(hf_model, ids, temperature, cfg.max_new_tokens, True, i)
            for name, fn in systems.items():
                r = fn()
                r.update(system=name, temperature=temperature, set=set_name, prompt=i,
                         tokens_per_s=r["tokens"] / r["seconds"])
                runs.append(r)
                print(f"T={temperature:g} {set_name:10s} #{i:2d} {name:17s} {r['tokens']:4d} tok "
                      f"{r['tokens_per_s']:6.1f} tok/s" + (f" tau {r['tau']:.2f}" if "tau" in r else ""), flush=True)
    return runs


def forward_curve(model) -> list[dict]:
    """Median seconds of one target forward vs tokens verified, for 1 request and spread over several."""
    rows = []
    layouts = [("1 request", lambda b: [b])] + [(f"{r} requests", (lambda r: lambda b: [b // r] * r)(r))
                                                for r in (4, 16)]
    for label, split in layouts:
        for b in CURVE_TOKENS:
            parts = split(b)
            if 0 in parts or sum(parts) != b:
                continue
            caches = [model.new_cache(CURVE_CONTEXT + 64) for _ in parts]
            for c in caches:
                model.forward(torch.arange(CURVE_CONTEXT) % 1000, [Segment(c, 0, CURVE_CONTEXT)])
            times = []
            for _ in range(7):
                segs = [Segment(c, CURVE_CONTEXT, n) for c, n in zip(caches, parts)]
                t0 = time.perf_counter()
                model.forward(torch.zeros(b, dtype=torch.long), segs)
                times.append(time.perf_counter() - t0)
            rows.append({"layout": label, "tokens": b, "seconds": median(times[1:])})
            print(f"forward {label:12s} B={b:3d}: {rows[-1]['seconds'] * 1000:7.1f} ms", flush=True)
    return rows


def summarise(runs: list[dict]) -> list[dict]:
    out = []
    for t in sorted({r["temperature"] for r in runs}):
        for system in dict.fromkeys(r["system"] for r in runs):
            sel = [r for r in runs if r["temperature"] == t and r["system"] == system]
            tokens, seconds = sum(r["tokens"] for r in sel), sum(r["seconds"] for r in sel)
            taus = [r["tau"] for r in sel if "tau" in r]
            out.append({"temperature": t, "system": system, "prompts": len(sel),
                        "median_tokens_per_s": median(r["tokens_per_s"] for r in sel),
                        "aggregate_tokens_per_s": tokens / seconds,
                        "mean_tau": sum(taus) / len(taus) if taus else None})
    return out


def _ratios(summary: list[dict]) -> list[list]:
    rows = []
    for t in sorted({s["temperature"] for s in summary}):
        by = {s["system"]: s["median_tokens_per_s"] for s in summary if s["temperature"] == t}
        engines = [name for name in by if name.startswith("engine ")]
        for ours, theirs in (("ours plain", "hf generate"), ("ours ngram", "hf prompt lookup"),
                             ("ours ngram", "ours plain"), *((e, "ours plain") for e in engines),
                             *((e, "ours ngram") for e in engines if e != "engine plain")):
            if ours in by and theirs in by:
                rows.append([t, f"{ours} / {theirs}", by[ours] / by[theirs]])
    return rows


def plot_curve(curve: list[dict], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for layout in dict.fromkeys(r["layout"] for r in curve):
        pts = [r for r in curve if r["layout"] == layout]
        ax.plot([p["tokens"] for p in pts], [p["seconds"] * 1000 for p in pts], marker="o", label=layout)
    ax.set_xlabel("tokens in the verification forward (B)")
    ax.set_ylabel("median forward time (ms)")
    ax.set_title(f"target forward vs B (context {CURVE_CONTEXT})")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def run(cfg: RuntimeBenchConfig) -> dict:
    loaded = load_model(cfg.model, dtype=cfg.dtype)
    hf_model = None
    if cfg.hf:
        from transformers import AutoModelForCausalLM
        hf_model = AutoModelForCausalLM.from_pretrained(str(loaded.hf_dir), dtype=torch.float32).eval()
    curve = forward_curve(loaded.model)
    kernels = projection_kernels(loaded.model)
    runs = decode_benchmark(cfg, loaded, hf_model)
    summary = summarise(runs)
    data = {"config": {k: str(v) if isinstance(v, Path) else v for k, v in cfg.__dict__.items()},
            "machine": machine_info(), "summary": summary, "ratios": _ratios(summary), "forward_curve": curve,
            "projection_kernels": kernels, "runs": runs}
    md = [f"# Runtime benchmark ({cfg.model}, {cfg.dtype}, batch 1, {cfg.max_new_tokens} new tokens)\n",
          f"Machine: {data['machine']['cpu']}, {data['machine']['torch_threads']} threads, torch "
          f"{data['machine']['torch']}, {data['machine']['date']}\n",
          markdown_table(["T", "system", "prompts", "median tok/s", "aggregate tok/s", "mean tau"],
                         [[s["temperature"], s["system"], s["prompts"], s["median_tokens_per_s"],
                           s["aggregate_tokens_per_s"], s["mean_tau"] if s["mean_tau"] else "-"] for s in summary]),
          "\nRatios of median tokens/s:\n", markdown_table(["T", "pair", "ratio"], data["ratios"]),
          "\nTarget forward time vs tokens verified:\n",
          markdown_table(["layout", "B", "ms"], [[r["layout"], r["tokens"], r["seconds"] * 1000] for r in curve]),
          f"\nAll projections of one forward ({kernels[0]['weight_mb']:.0f} MB of weights) per kernel:\n",
          markdown_table(["kernel", "rows", "ms", "GB/s"],
                         [[k["kernel"], k["rows"], k["seconds"] * 1000, k["gb_per_s"]] for k in kernels])]
    write_results(cfg.out, "runtime", data, "\n".join(md) + "\n")
    plot_curve(curve, cfg.out / "forward_curve.png")
    print("\n".join(md))
    return data
