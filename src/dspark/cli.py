"""The `dspark` command line. Each subcommand lives in a small `add_*` function; errors become one line."""
from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

from .decoding.sampling import SamplingError
from .drafters.base import DrafterError
from .drafters.deepspec_layout import add_export
from .engine.speculative import PromptTooLongError
from .models.config import ModelConfigError
from .bench.common import DOMAINS as DOMAIN_SETS
from .models.loader import DEFAULT_MODEL, EMBEDDED, ModelNotFoundError
from .models.weights import WeightsError

USER_ERRORS = (ModelNotFoundError, ModelConfigError, WeightsError, SamplingError, PromptTooLongError,
               DrafterError, FileNotFoundError, ValueError)


def _add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=DEFAULT_MODEL,
                   help=f"HF directory, .gguf file, hub id, or an embedded name ({', '.join(EMBEDDED)})")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                   help="weight/activation dtype of the target (bfloat16 is faster on CPU, not bit-equal to fp32)")


def add_generate(sub) -> None:
    p = sub.add_parser("generate", help="stream a completion, optionally with speculative decoding",
                       description="Generate text from one prompt, streaming tokens as they are accepted.")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="prompt text")
    src.add_argument("--prompt-file", type=Path, help="file whose whole content is the prompt")
    _add_model_args(p)
    p.add_argument("--drafter", default="auto", help="auto (the shipped DSpark drafter for this model where the "
                   "policy schedules it, else n-gram), dspark, ngram, none, or the path of a trained drafter; a "
                   "DSpark drafter may end in @fp32 or @bf16 (its own products; default: bf16 where the CPU "
                   "multiplies bf16 natively)")
    p.add_argument("--gamma", type=int, default=7, help="draft block size (tokens proposed per round)")
    p.add_argument("--policy", default="auto",
                   help="how many drafts each step verifies: auto (the async scheduler for a drafter with a "
                        "confidence head, else every draft), none, mtp1, fixed-<k>, sync, async, threshold; the "
                        "schedulers measure this machine's speed profile once (minutes) and cache it")
    p.add_argument("--chat", action=argparse.BooleanOptionalAction, default=True,
                   help="wrap the prompt in the tokenizer's chat template (default: on)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0, help="0 = off")
    p.add_argument("--min-p", type=float, default=0.0,
                   help="drop tokens less likely than this fraction of the most likely one (0 = off)")
    p.add_argument("--repetition-penalty", type=float, default=1.0,
                   help="divide positive (multiply negative) logits of tokens already in the prompt or output "
                        "(1 = off)")
    p.add_argument("--presence-penalty", type=float, default=0.0, help="OpenAI's, on generated tokens")
    p.add_argument("--frequency-penalty", type=float, default=0.0, help="OpenAI's, on generated tokens")
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--min-tokens", type=int, default=0, help="generate at least this many tokens before EOS")
    p.add_argument("--json", action="store_true", help="print one JSON object (text + statistics) instead")
    p.add_argument("--logprobs", type=int, default=None, metavar="N",
                   help="with --json: each token's log-probability under the target (its raw distribution) and its "
                        "N most likely alternatives (0-20)")
    p.add_argument("--prompt-logprobs", type=int, default=None, metavar="N",
                   help="with --json: the same for every prompt token after the first (the prompt as templated)")
    p.set_defaults(func=run_generate)


def run_generate(args) -> int:
    from .decoding import SamplingParams
    from .generate import TextGenerator

    params = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, min_p=args.min_p,
                            seed=args.seed, max_new_tokens=args.max_new_tokens, logprobs=args.logprobs,
                            prompt_logprobs=args.prompt_logprobs, min_tokens=args.min_tokens,
                            repetition_penalty=args.repetition_penalty, presence_penalty=args.presence_penalty,
                            frequency_penalty=args.frequency_penalty)  # checked before loading
    for flag, value in (("--logprobs", args.logprobs), ("--prompt-logprobs", args.prompt_logprobs)):
        if value is not None and not args.json:
            raise ValueError(f"{flag} needs --json (they are printed with the JSON object)")
    prompt = args.prompt if args.prompt is not None else args.prompt_file.read_text()
    gen = TextGenerator(args.model, args.drafter, gamma=args.gamma, dtype=args.dtype, policy=args.policy)
    stream = gen.stream(prompt, params, chat=args.chat)
    for piece in stream:
        if not args.json:
            print(piece, end="", flush=True)
    stats = stream.stats.to_dict()
    if args.json:
        print(json.dumps({"model": args.model, "drafter": args.drafter, "drafter_used": gen.drafter_name,
                          "policy": gen.policy_name, "text": stream.text, **stats,
                          **({"logprobs": _logprobs_json(stream.request.logprobs, gen.llm.tokenizer)}
                             if args.logprobs is not None else {}),
                          **({"prompt_logprobs": _logprobs_json(stream.request.prompt_logprobs, gen.llm.tokenizer)}
                             if args.prompt_logprobs is not None else {})}))
    else:
        print(f"\n\n[{gen.drafter_name} drafter, {gen.policy_name} policy: {stats['new_tokens']} tokens, "
              f"{stats['rounds']} steps, {stats['drafted']} drafts verified, tau {stats['tau']:.2f}, "
              f"{stats['tokens_per_s']:.1f} tok/s, ttft {stats['ttft_s'] * 1000:.0f} ms, "
              f"finish: {stats['finish_reason']}]", file=sys.stderr)
    return 0


def _logprobs_json(entries, tokenizer) -> list[dict]:
    text = lambda t: tokenizer.decode([t])  # noqa: E731
    return [{"token_id": e.token, "token": text(e.token), "logprob": e.logprob,
             "top": [{"token_id": t, "token": text(t), "logprob": lp} for t, lp in e.top]}
            for e in entries]


def add_bench(sub) -> None:
    p = sub.add_parser("bench", help="benchmarks (results saved as JSON + Markdown + PNG)")
    bench = p.add_subparsers(dest="bench_command", required=True, metavar="BENCH")
    r = bench.add_parser("runtime", help="our plain/n-gram decoding vs transformers, and the forward speed curve",
                         description="Batch-1 speed of our runtime against HF generate and HF prompt lookup, "
                                     "side by side in one process, plus target forward time vs tokens verified.")
    _add_model_args(r)
    r.add_argument("--per-set", type=int, default=5, help="prompts per benchmark set")
    r.add_argument("--sets", default="humaneval,gsm8k,mt-bench")
    r.add_argument("--max-new-tokens", type=int, default=128)
    r.add_argument("--temperatures", default="0,1")
    r.add_argument("--skip-hf", action="store_true", help="skip the transformers baselines")
    r.add_argument("--out", type=Path, default=Path("results/runtime"))
    r.set_defaults(func=run_bench_runtime)
    s = bench.add_parser("serve", help="closed-loop serving throughput vs per-user speed for each policy",
                         description="In-process closed-loop clients at each concurrency, for each policy; "
                                     "writes results/serving/serving.{json,md,png}.")
    _add_model_args(s)
    s.add_argument("--drafter", default="ngram")
    s.add_argument("--policies", default="none,mtp1,fixed-3,fixed-7")
    s.add_argument("--concurrency", default="1,2,4,8,16,32")
    s.add_argument("--max-new-tokens", type=int, default=96)
    s.add_argument("--seconds", type=float, default=20.0,
                   help="seconds of each policy's own stepping time per (policy, concurrency) cell")
    s.add_argument("--repeats", type=int, default=1,
                   help="run every cell this many times, interleaved; report medians and paired ratios")
    s.add_argument("--warmup", type=float, default=0.0,
                   help="per cell, first run the loop until every client's first request has finished (at most this "
                        "many seconds), then measure: the steady state instead of the start-up wave")
    s.add_argument("--temperature", type=float, default=0.0)
    s.add_argument("--top-p", type=float, default=1.0)
    s.add_argument("--length-spread", type=float, default=0.5,
                   help="request i may produce up to max-new-tokens × u_i, u_i uniform in [1 - s, 1 + s] from a fixed "
                        "seed (the same sequence for every policy); 0: one length for all")
    s.add_argument("--requests-per-client", type=int, default=0,
                   help="> 0: each cell is the same first C × N requests of the mix for every policy, run until all "
                        "have finished (start-up and drain included; --seconds and --warmup unused): every policy "
                        "does the same work, so paired ratios are not moved by which prompts fit in a time window")
    s.add_argument("--prompt-tokens", type=int, default=0,
                   help="> 0: lengthen every prompt to at least this many tokens (the mix's other prompts before it as "
                        "a document to read; one user turn): serving at long context, where verification costs more")
    s.add_argument("--sequential", action="store_true",
                   help="run each policy's cell alone, one after another (default: step every policy's clients in "
                        "turn, each timed on its own clock, so machine speed drift hits all policies alike)")
    s.add_argument("--no-prefix-cache", action="store_true",
                   help="prefill every prompt in full (sessions before 28 did; the mix's 48 prompts recur from C = 8)")
    s.add_argument("--traces", type=Path, default=None,
                   help="acceptance traces of this drafter (traces.npz from `dspark calibrate`): also simulate every "
                        "cell from this machine's speed profile and print simulated beside measured")
    s.add_argument("--out", type=Path, default=Path("results/serving"))
    s.set_defaults(func=run_bench_serve)
    a = bench.add_parser("acceptance", help="τ per set/domain, conditional acceptance per position, per drafter",
                         description="Each drafter drafts γ tokens per round and all are verified (fixed-γ) on the "
                                     "same prompts; writes results/acceptance/acceptance.{json,md} and a plot.")
    a.add_argument("--model", default=DEFAULT_MODEL)
    a.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                   help="the target's dtype (plain decoding in the speed comparison uses the same target)")
    a.add_argument("--drafters", default="ngram", help="comma-separated drafter names or checkpoint paths")
    a.add_argument("--sets", default=",".join(DOMAIN_SETS), help="comma-separated benchmark sets")
    a.add_argument("--limit", type=int, default=20, help="prompts per set")
    a.add_argument("--temperatures", default="0,1")
    a.add_argument("--gamma", type=int, default=7)
    a.add_argument("--max-new-tokens", type=int, default=256)
    a.add_argument("--batch", type=int, default=16, help="concurrent requests in the engine")
    a.add_argument("--speed-prompts", type=int, default=0, help="per set: batch-1 speed vs plain decoding")
    a.add_argument("--head-latency", action="store_true", help="time the sequential head's share of a round")
    a.add_argument("--seed", type=int, default=0)
    a.add_argument("--out", type=Path, default=Path("results/acceptance"))
    a.set_defaults(func=run_bench_acceptance)
    from .bench import prefix

    prefix.add_parser(bench)


def run_bench_runtime(args) -> int:
    from .bench.runtime import RuntimeBenchConfig, run

    cfg = RuntimeBenchConfig(model=args.model, dtype=args.dtype, per_set=args.per_set,
                             sets=tuple(args.sets.split(",")), max_new_tokens=args.max_new_tokens,
                             temperatures=tuple(float(t) for t in args.temperatures.split(",")),
                             hf=not args.skip_hf, out=args.out)
    run(cfg)
    return 0


def run_bench_acceptance(args) -> int:
    from .bench.acceptance import AcceptanceConfig, run

    run(AcceptanceConfig(model=args.model, dtype=args.dtype, drafters=tuple(args.drafters.split(",")),
                         sets=tuple(args.sets.split(",")),
                         per_set=args.limit, temperatures=tuple(float(t) for t in args.temperatures.split(",")),
                         gamma=args.gamma, max_new_tokens=args.max_new_tokens, batch=args.batch,
                         speed_prompts=args.speed_prompts, head_latency=args.head_latency, seed=args.seed,
                         out=args.out))
    return 0


def run_bench_serve(args) -> int:
    from .bench.serving import ServeBenchConfig, run

    run(ServeBenchConfig(model=args.model, drafter=args.drafter, dtype=args.dtype,
                         policies=tuple(args.policies.split(",")),
                         concurrency=tuple(int(c) for c in args.concurrency.split(",")),
                         max_new_tokens=args.max_new_tokens, seconds_per_cell=args.seconds, repeats=args.repeats,
                         warmup_s=args.warmup, temperature=args.temperature, top_p=args.top_p, out=args.out,
                         traces=args.traces,
                         sequential=args.sequential, length_spread=args.length_spread,
                         requests_per_client=args.requests_per_client, prompt_tokens=args.prompt_tokens,
                         prefix_cache=not args.no_prefix_cache))
    return 0


def add_models(sub) -> None:
    p = sub.add_parser("models", help="list the embedded model names and where they resolve")
    p.set_defaults(func=run_models)


def run_models(args) -> int:
    from .models.loader import embedded_path

    for name in EMBEDDED:
        try:
            where = str(embedded_path(name))
        except ModelNotFoundError as exc:
            where = f"not installed ({exc})"
        print(f"{name}\t{where}")
    return 0


def add_profile(sub) -> None:
    p = sub.add_parser("profile", help="measure (or show the cached) target speed profile SPS(B) on this machine",
                       description="Time one verification forward against the number of tokens B; the table is "
                                   "cached per model, drafter, machine and dtype for the scheduler.")
    _add_model_args(p)
    p.add_argument("--repeats", type=int, default=9)
    p.add_argument("--force", action="store_true", help="re-measure even if a matching cached profile exists")
    p.add_argument("--drafter", default="none",
                   help="also measure this drafter's cost per step against the number of requests (none: target only)")
    p.set_defaults(func=run_profile)


def run_profile(args) -> int:
    from .engine.profiling import load_or_profile, profile_key, profile_path
    from .models import kernel_choice, load_model

    from .drafters import make_drafter

    loaded = load_model(args.model, dtype=args.dtype, tune=not args.force)  # --force measures the routes once, below
    if args.force:  # the kernel crossover is part of what a step costs, so it is measured again too
        chosen = kernel_choice.tune(loaded.model, force=True)
        if chosen is not None:
            ours = "none" if chosen.native_rows is None else f"up to {chosen.native_rows} rows"
            pads = ", ".join(f"{n} -> {m}" for n, m in sorted(chosen.pad_to.items())) or "none"
            print(f"# projections: our C kernel serves {ours}; oneDNN runs padded (rows -> padded rows): {pads}")
    drafter = None if args.drafter == "none" else make_drafter(args.drafter, target=loaded.model)
    key = profile_key(args.model, args.dtype, drafter.profile_id if drafter else "none", loaded.model)
    prof = load_or_profile(loaded.model, key, repeats=args.repeats, force=args.force, drafter=drafter, prefill=True)
    print(f"# speed profile ({prof.source}) cached at {profile_path(key)}")
    print("tokens\tms/step\tsteps/s")
    for b, s in zip(prof.tokens, prof.seconds):
        print(f"{b}\t{s * 1000:.1f}\t{1 / s:.2f}")
    if prof.tokens_per_segment:
        print(f"# measured with {prof.tokens_per_segment} tokens per request; one more request at a fixed B costs "
              f"{prof.segment_seconds * 1000:.2f} ms")
    if prof.grid_seconds:  # what the scheduler reads when it knows R
        print("requests\t" + "\t".join(f"ms, {k} token(s) each" for k in prof.grid_tokens))
        for r, row in zip(prof.grid_requests, prof.grid_seconds):
            print(f"{r}\t" + "\t".join(f"{s * 1000:.1f}" for s in row))
    if prof.prices_context:
        print(f"# measured at {prof.grid_context} tokens of context per request; each token of context more costs "
              f"{prof.context_request_s * 1e6:.3f} µs per request and {prof.context_token_s * 1e6:.3f} µs per "
              f"verified token")
    if prof.draft_requests:
        # shallower tables first: depth 1, then 2 .. draft_depth - 1 when measured, then the full block
        tables = ([(1, prof.shallow_draft_seconds)] if prof.shallow_draft_seconds else []) \
            + list(enumerate(prof.depth_draft_seconds, start=2)) + [(prof.draft_depth or "full", prof.draft_seconds)]
        print("requests\tdraft ms/step at depth " + "\t".join(str(d) for d, _ in tables))
        for i, r in enumerate(prof.draft_requests):
            print(f"{r}\t" + "\t".join(f"{row[i] * 1000:.1f}" for _, row in tables))
    return 0


def add_simulate(sub) -> None:
    # main() hands everything after `simulate` to the simulator's own parser; this entry is for the listing.
    p = sub.add_parser("simulate", help="serving simulator sweep over scheduling policies",
                       description="Run `dspark simulate --help` for the simulator's options.")
    p.set_defaults(func=lambda args: _simulate([]))


def _simulate(argv) -> int:
    from .scheduling.simulator import main as simulate

    simulate(argv)
    return 0


def add_calibrate(sub) -> None:
    p = sub.add_parser("calibrate", help="fit STS confidence calibration on held-out rollouts; save with the drafter",
                       description="Rollouts at full block record raw confidence logits and realised acceptance; "
                                   "STS is fitted on half the requests and reported on the other half (ECE, "
                                   "ROC-AUC, Brier per position, reliability diagram, threshold sweep). Writes "
                                   "calibration.json into the drafter directory.")
    p.add_argument("--drafter", required=True, help="trained drafter directory (with a confidence head)")
    p.add_argument("--prompts", help="held-out prompt .jsonl (never the drafter's training data); required unless "
                                     "--from-rollouts")
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--limit", type=int, default=200, help="prompts to roll out")
    p.add_argument("--skip", type=int, default=0, help="skip the first N prompts of the file")
    p.add_argument("--skip-bad", action="store_true", help="skip malformed prompt lines instead of failing")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=Path("results/calibration"))
    p.add_argument("--no-shift", action="store_true",
                   help="temperatures only (the paper's STS); by default a per-position shift is fitted too")
    p.add_argument("--from-rollouts", type=Path,
                   help="refit from a rollouts.npz saved by an earlier run (no model is run; --prompts unused)")
    p.set_defaults(func=run_calibrate)


def run_calibrate(args) -> int:
    from .calibrate import CalibrateConfig, run

    if not args.prompts and args.from_rollouts is None:
        raise SystemExit("dspark calibrate: --prompts FILE.jsonl is required (or --from-rollouts rollouts.npz)")
    run(CalibrateConfig(drafter=args.drafter, prompts=args.prompts or "", model=args.model, limit=args.limit,
                        skip=args.skip, temperature=args.temperature, max_new_tokens=args.max_new_tokens,
                        batch=args.batch, seed=args.seed, out=args.out, shift=not args.no_shift,
                        from_rollouts=args.from_rollouts, skip_bad=args.skip_bad))
    return 0


def _optional_commands(sub) -> None:
    """Training and serving live in their own packages (training never imports the engine or server)."""
    from .serving.cli import add_serve
    from .training.cli import add_subcommands as add_training

    add_training(sub)
    add_serve(sub)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="dspark", description="Lossless confidence-scheduled speculative decoding.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for add in (add_generate, add_bench, add_models, add_profile, add_simulate, add_calibrate, _optional_commands,
                add_export):
        add(sub)
    return parser


class _StderrNotes(logging.Handler):
    """Writes to whatever sys.stderr is when a note is emitted (not the stream of the first call)."""

    def emit(self, record: logging.LogRecord) -> None:
        print(f"[dspark] {record.getMessage()}", file=sys.stderr)


def show_progress_notes() -> None:
    """The package's INFO notes (a profile being measured, a kernel falling back) on stderr."""
    log = logging.getLogger("dspark")
    if not any(isinstance(h, _StderrNotes) for h in log.handlers):
        log.addHandler(_StderrNotes())
    log.setLevel(logging.INFO)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["simulate"]:
        return _simulate(argv[1:])
    args = build_parser().parse_args(argv)
    show_progress_notes()
    try:
        return args.func(args)
    except KeyboardInterrupt:
        print("\ninterrupted", file=sys.stderr)
        return 130
    except USER_ERRORS as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
