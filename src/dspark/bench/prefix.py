"""`dspark bench prefix`: what prompt-prefix reuse (engine/prefix_cache.py) saves, against the same engine with it
off, both stepped in turn in one process (each on its own clock, as `bench serve` does).

Workloads, closed-loop clients over ../shared/bench_data questions:
  system  every request: one long system prompt, then a different question
  chat    each client holds a conversation of `turns` turns and re-sends the whole history each turn, as an
          OpenAI-style client does (the answer re-templated from its text)
  n       each request asks `n` sampled answers to one question (n engine requests of one prompt at once)
Greedy for system and chat, seeded sampling for n: both settings must produce the same tokens (counted).
"""
from __future__ import annotations

import dataclasses
import random
import time
from dataclasses import dataclass, field
from pathlib import Path

from ..decoding import SamplingParams
from ..drafters import make_drafter
from ..engine.engine import Engine, EngineConfig
from ..engine.llm import build_policy, drafter_options
from ..models import load_model
from .common import load_bench_prompts, machine_info, markdown_table, median, write_results

SETS = ("mt-bench", "gsm8k", "humaneval", "arena-hard-v2")


@dataclass(frozen=True)
class PrefixBenchConfig:
    model: str = "smollm2-135m-instruct"
    drafter: str = "auto"
    policy: str = "auto"
    dtype: str = "float32"
    gamma: int = 7
    workloads: tuple[str, ...] = ("system", "chat", "n")
    concurrency: int = 8
    requests_per_client: int = 3  # system: requests; chat: turns; n: requests of n choices
    n: int = 4
    system_tokens: int = 400
    max_new_tokens: int = 64
    out: Path = field(default=Path("results/prefix"))

    def __post_init__(self):
        unknown = set(self.workloads) - {"system", "chat", "n"}
        if unknown or not self.workloads:
            raise ValueError(f"unknown workloads {sorted(unknown)}; choose from system, chat, n")
        if min(self.concurrency, self.requests_per_client, self.n, self.system_tokens, self.max_new_tokens) < 1:
            raise ValueError("concurrency, requests per client, n, system tokens and max new tokens must be >= 1")


def _template(tokenizer, messages: list[dict]) -> list[int]:
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def _system_text(tokenizer, texts: list[str], tokens: int) -> str:
    """A system prompt of about `tokens` tokens: instructions, then reference questions from the mix."""
    text, i = "You are a careful assistant. Answer briefly. Reference questions you may be asked about:", 0
    while len(tokenizer(text).input_ids) < tokens:
        text += "\n\n" + texts[i % len(texts)]
        i += 1
    return text


def clients(cfg: PrefixBenchConfig, workload: str, tokenizer, texts: list[str], greedy: SamplingParams):
    """One generator per client: each yields a job — [(prompt ids, params)] submitted at once — and receives
    the job's outputs (token lists) back."""
    system = _system_text(tokenizer, texts[::-1], cfg.system_tokens) if workload == "system" else ""

    def client(c: int):
        history = []
        for j in range(cfg.requests_per_client):
            text = texts[(c * cfg.requests_per_client + j) % len(texts)]
            if workload == "system":
                messages = [{"role": "system", "content": system}, {"role": "user", "content": text}]
                yield [(_template(tokenizer, messages), greedy)]
            elif workload == "chat":
                history.append({"role": "user", "content": text})
                outs = yield [(_template(tokenizer, history), greedy)]
                history.append({"role": "assistant", "content": tokenizer.decode(outs[0], skip_special_tokens=True)})
            else:
                ids = _template(tokenizer, [{"role": "user", "content": text}])
                yield [(ids, dataclasses.replace(greedy, temperature=0.8, seed=1000 * c + 10 * j + i))
                       for i in range(cfg.n)]
    return [client(c) for c in range(cfg.concurrency)]


class Loop:
    """Closed-loop clients on one engine, timed on the loop's own clock."""

    def __init__(self, engine: Engine, gens):
        self.engine, self.clock = engine, 0.0
        self.gens, self.live = list(gens), {}  # client -> [(request, sent at)]
        self.ttft: list[float] = []
        self.started: set[str] = set()  # requests whose first token has been timed
        self.outputs: dict[tuple[int, int, int], list[int]] = {}  # (client, job, choice) -> tokens
        self.jobs = [0] * len(self.gens)  # jobs each client has finished
        self.computed0, self.cached0 = engine.stats.prompt_tokens, engine.stats.cached_prompt_tokens
        for c, gen in enumerate(self.gens):
            self._send(c, next(gen))

    def _send(self, c: int, job) -> None:
        self.live[c] = [(self.engine.add_request(ids, params), self.clock) for ids, params in job]

    @property
    def busy(self) -> bool:
        return bool(self.live)

    def tick(self) -> None:
        t0 = time.perf_counter()
        self.engine.step()
        now = self.clock + time.perf_counter() - t0
        for c, reqs in list(self.live.items()):
            for req, sent in reqs:
                if req.output and req.request_id not in self.started:
                    self.started.add(req.request_id)
                    self.ttft.append(now - sent)
            if all(req.finished for req, _ in reqs):
                if any(req.error for req, _ in reqs):
                    raise RuntimeError(f"a benchmark request failed: {[req.error for req, _ in reqs]}")
                self.outputs.update(((c, self.jobs[c], i), list(req.output)) for i, (req, _) in enumerate(reqs))
                self.jobs[c] += 1
                del self.live[c]
                try:
                    self._send(c, self.gens[c].send([req.output for req, _ in reqs]))
                except StopIteration:
                    pass
        self.clock += time.perf_counter() - t0

    def summary(self) -> dict:
        s = self.engine.stats
        produced = sum(map(len, self.outputs.values()))
        return {"requests": len(self.outputs), "seconds": self.clock, "output_tokens": produced,
                "throughput_tok_s": produced / self.clock, "median_ttft_s": median(self.ttft),
                "prompt_tokens_computed": s.prompt_tokens - self.computed0,
                "prompt_tokens_cached": s.cached_prompt_tokens - self.cached0}


def run(cfg: PrefixBenchConfig) -> dict:
    loaded = load_model(cfg.model, dtype=cfg.dtype)
    drafter = make_drafter(cfg.drafter, target=loaded.model, gamma=cfg.gamma, **drafter_options(cfg.drafter,
                                                                                                 cfg.policy))
    texts = [text for _, text in load_bench_prompts(SETS, 12)]
    greedy = SamplingParams(temperature=0.0, max_new_tokens=cfg.max_new_tokens)
    rows, order = [], random.Random(0)
    for workload in cfg.workloads:
        loops = {}
        for on in (True, False):
            policy = build_policy(cfg.policy, drafter, cfg.model, cfg.dtype, loaded.model, cfg.gamma)
            engine = Engine(loaded.model, loaded.tokenizer, drafter, policy, loaded.eos_ids,
                            EngineConfig(gamma=cfg.gamma, max_running=cfg.concurrency * cfg.n, prefix_cache=on))
            loops[on] = Loop(engine, clients(cfg, workload, loaded.tokenizer, texts, greedy))
        while any(loop.busy for loop in loops.values()):
            for loop in order.sample(list(loops.values()), 2):
                if loop.busy:
                    loop.tick()
        on, off = loops[True].summary(), loops[False].summary()
        same = sum(loops[True].outputs[k] == loops[False].outputs.get(k) for k in loops[True].outputs)
        rows.append({"workload": workload, "prefix_cache": on, "no_prefix_cache": off,
                     "ttft_ratio": on["median_ttft_s"] / off["median_ttft_s"],
                     "throughput_ratio": on["throughput_tok_s"] / off["throughput_tok_s"],
                     "same_outputs": same, "outputs": len(loops[True].outputs)})
        print(f"{workload}: TTFT {on['median_ttft_s'] * 1e3:.0f} vs {off['median_ttft_s'] * 1e3:.0f} ms, "
              f"{on['throughput_tok_s']:.1f} vs {off['throughput_tok_s']:.1f} tok/s, prompt tokens computed "
              f"{on['prompt_tokens_computed']} vs {off['prompt_tokens_computed']}, "
              f"same outputs {same}/{rows[-1]['outputs']}")
    data = {"config": {k: str(v) for k, v in dataclasses.asdict(cfg).items()}, "machine": machine_info(),
            "drafter": getattr(drafter, "profile_id", "none"), "rows": rows}
    write_results(cfg.out, "prefix", data, _markdown(cfg, rows))
    _plot(rows, cfg.out / "prefix.png")
    return data


def _markdown(cfg: PrefixBenchConfig, rows: list[dict]) -> str:
    on, off = "prefix_cache", "no_prefix_cache"
    table = [[r["workload"], r[on]["prompt_tokens_computed"], r[off]["prompt_tokens_computed"],
              r[on]["prompt_tokens_cached"], r[on]["median_ttft_s"] * 1e3, r[off]["median_ttft_s"] * 1e3,
              r["ttft_ratio"], r[on]["throughput_tok_s"], r[off]["throughput_tok_s"], r["throughput_ratio"],
              f"{r['same_outputs']}/{r['outputs']}"]
             for r in rows]
    head = (f"# Prompt-prefix reuse: on vs off\n\nC = {cfg.concurrency} clients × {cfg.requests_per_client}, "
            f"n = {cfg.n}, system prompt ≈ {cfg.system_tokens} tokens, {cfg.max_new_tokens} new tokens, "
            f"drafter {cfg.drafter}, policy {cfg.policy}\n\n")
    return head + markdown_table(["workload", "prompt computed (on)", "(off)", "copied (on)", "TTFT ms (on)", "(off)",
                                  "TTFT on/off", "tok/s (on)", "(off)", "tok/s on/off", "same outputs"], table) + (
        "\n\nSame outputs: greedy workloads (system, chat) must match token for token. The sampled one (n) is a valid "
        "draw either way; it repeats only while float rounding does — a copied prefix computes its last prompt token "
        "in another forward, and a load-dependent policy (async) or a drafter with bf16 products turns that into other "
        "draws (scripts/seeded_repeatability.py).\n")


def _plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(9, 3.5))
    x = range(len(rows))
    for ax, key, label in ((axes[0], "median_ttft_s", "median time to first token (s)"),
                           (axes[1], "throughput_tok_s", "output tokens / s")):
        ax.bar([i - 0.2 for i in x], [r["prefix_cache"][key] for r in rows], 0.4, label="prefix cache")
        ax.bar([i + 0.2 for i in x], [r["no_prefix_cache"][key] for r in rows], 0.4, label="off")
        ax.set_xticks(list(x), [r["workload"] for r in rows])
        ax.set_ylabel(label)
    axes[0].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def add_parser(bench) -> None:
    p = bench.add_parser("prefix", help="prompt-prefix reuse on vs off: system prompt, multi-turn chat, n choices",
                         description="Closed-loop clients on two engines, prefix cache on and off, stepped in turn; "
                                     "writes results/prefix/prefix.{json,md,png}.")
    p.add_argument("--model", default=PrefixBenchConfig.model)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--drafter", default="auto")
    p.add_argument("--policy", default="auto")
    p.add_argument("--workloads", default="system,chat,n")
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--requests-per-client", type=int, default=3)
    p.add_argument("--n", type=int, default=4)
    p.add_argument("--system-tokens", type=int, default=400)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--out", type=Path, default=Path("results/prefix"))
    p.set_defaults(func=_run_args)


def _run_args(args) -> int:
    run(PrefixBenchConfig(model=args.model, dtype=args.dtype, drafter=args.drafter, policy=args.policy,
                          workloads=tuple(args.workloads.split(",")), concurrency=args.concurrency,
                          requests_per_client=args.requests_per_client, n=args.n, system_tokens=args.system_tokens,
                          max_new_tokens=args.max_new_tokens, out=args.out))
    return 0
