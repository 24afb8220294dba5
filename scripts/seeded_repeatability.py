"""How exactly does a seeded, sampled request repeat? Same engine settings twice, a different batch limit
(max_running 32 vs 4: other batch compositions), and prompt-prefix reuse on vs off, under a fixed policy (whose
draws depend on the request alone), for each drafter.

Every run is a valid sample of the target's distribution; what can differ is float rounding: a position computed
in another forward (a copied prefix's last token, a different batch) rounds differently, and a draw near a
boundary then goes the other way. A drafter with bf16 products turns an fp32 difference of 1e-5 into one bf16
step of its context (0.06 at magnitude 26), so its drafts — and which of the request's uniforms decide what — move
more often. Workload: `dspark bench prefix`'s "n" (C = 8 clients, 3 jobs of 4 choices of one prompt, T = 0.8).

    python scripts/seeded_repeatability.py --drafters dspark,dspark@fp32,none --out results/repeatability-s28
"""
from __future__ import annotations

import argparse
from pathlib import Path

from dspark.bench.common import load_bench_prompts, machine_info, markdown_table, write_results
from dspark.bench.prefix import SETS, Loop, PrefixBenchConfig, clients
from dspark.decoding import SamplingParams
from dspark.drafters import make_drafter
from dspark.engine.engine import Engine, EngineConfig
from dspark.engine.llm import build_policy
from dspark.models import load_model

SETTINGS = {"same settings": ((True, 32), (True, 32)), "max_running 32 vs 4": ((False, 32), (False, 4)),
            "prefix reuse on vs off": ((True, 32), (False, 32))}


def first_difference(a: list[int], b: list[int]) -> int | None:
    for j, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return j
    return None if len(a) == len(b) else min(len(a), len(b))


def compare(loaded, spec: str, policy: str, texts) -> list[list]:
    cfg = PrefixBenchConfig(drafter=spec, policy=policy, workloads=("n",))
    drafter = make_drafter(spec, target=loaded.model, gamma=cfg.gamma)
    name = policy if drafter is not None else "none"
    greedy = SamplingParams(temperature=0.0, max_new_tokens=cfg.max_new_tokens)
    rows = []
    for label, pair in SETTINGS.items():
        loops = [Loop(Engine(loaded.model, loaded.tokenizer, drafter,
                             build_policy(name, drafter, cfg.model, cfg.dtype, loaded.model, cfg.gamma),
                             loaded.eos_ids, EngineConfig(gamma=cfg.gamma, max_running=max_running, prefix_cache=on)),
                      clients(cfg, "n", loaded.tokenizer, texts, greedy)) for on, max_running in pair]
        while any(loop.busy for loop in loops):
            for loop in loops:
                if loop.busy:
                    loop.tick()
        a, b = (loop.outputs for loop in loops)
        diffs = sorted(d for k in a if (d := first_difference(a[k], b[k])) is not None)
        rows.append([spec, name, label, len(a) - len(diffs), len(a), diffs[0] if diffs else "-"])
        print(rows[-1])
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--drafters", default="dspark,dspark@fp32,none")
    ap.add_argument("--policy", default="fixed-3")
    ap.add_argument("--out", type=Path, default=Path("results/repeatability"))
    args = ap.parse_args()
    loaded = load_model(PrefixBenchConfig.model)
    texts = [text for _, text in load_bench_prompts(SETS, 12)]
    rows = [row for spec in args.drafters.split(",") for row in compare(loaded, spec, args.policy, texts)]
    headers = ["drafter", "policy", "compared", "same outputs", "of", "earliest difference (token)"]
    write_results(args.out, "repeatability", {"machine": machine_info(), "headers": headers, "rows": rows},
                  "# Seeded sampled outputs: how exactly they repeat\n\n" + markdown_table(headers, rows) + "\n")


if __name__ == "__main__":
    main()
