"""Command-line entry points of the training pipeline: `datagen`, `cache build`, `cache estimate`, `train`.

`add_subcommands(subparsers)` registers them on any argparse sub-parser set (the main `dspark` CLI);
`python -m dspark.training ...` runs them standalone (and under `torchrun`). Each handler returns an exit code.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from pathlib import Path

DEFAULT_MODEL = "smollm2-135m-instruct"


def _human(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if n < 1024 or unit == "TB":
            return f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TB"


def cmd_datagen(args) -> int:
    from .datagen import DatagenSettings, run_datagen

    settings = DatagenSettings(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                               max_new_tokens=args.max_new_tokens, seed=args.seed, batch_size=args.batch_size,
                               batch_tokens=args.batch_tokens, concurrency=args.concurrency,
                               max_context=args.max_context)
    summary = run_datagen(args.prompts, args.out, settings, model=args.model, endpoint=args.endpoint,
                          api_model=args.api_model, limit=args.limit, skip_bad=args.skip_bad,
                          progress=not args.no_progress, backend=args.backend, device=args.device)
    print(json.dumps(summary))
    return 1 if summary["failed"] else 0


def _cache_inputs(args):
    """Tokenizer, model config and tokenised data, without loading the target weights."""
    from ..drafters.dspark_model import default_layer_ids
    from ..models.config import load_hf_config
    from ..models.loader import load_tokenizer, resolve
    from .features import load_sequences

    hf_dir = resolve(args.model)
    config = load_hf_config(hf_dir)
    layers = (tuple(int(x) for x in args.layers.split(",")) if args.layers
              else default_layer_ids(config.num_layers, args.num_feature_layers))
    data = load_sequences(args.data, load_tokenizer(hf_dir), args.max_seq_len, args.limit)
    return config, layers, data


def cmd_cache_estimate(args) -> int:
    from .target_cache import estimate

    config, layers, data = _cache_inputs(args)
    est = estimate(data, len(layers), config.hidden_size, args.dtype)
    free = shutil.disk_usage(Path(args.out).parent if args.out else Path.cwd()).free
    print(f"{est['sequences']} sequences, {est['tokens']} tokens; layers {list(layers)} + final hidden, "
          f"{args.dtype}: {est['bytes_per_token']} bytes/token -> {_human(est['bytes'])} "
          f"(free disk: {_human(free)})")
    return 0 if est["bytes"] < free else 1


def cmd_cache_build(args) -> int:
    from ..models import load_model
    from .target_cache import build_cache, estimate

    config, layers, data = _cache_inputs(args)
    est = estimate(data, len(layers), config.hidden_size, args.dtype)
    print(f"cache: {est['sequences']} sequences, {est['tokens']} tokens, about {_human(est['bytes'])}",
          file=sys.stderr)
    loaded = load_model(args.model)
    manifest = build_cache(args.out, loaded.model, data, layers, target_name=args.model, dtype=args.dtype,
                           shard_tokens=args.shard_tokens, batch_tokens=args.batch_tokens,
                           progress=not args.no_progress, overwrite=args.overwrite)
    print(json.dumps({k: manifest[k] for k in ("sequences", "tokens", "layer_ids", "dtype", "complete")}))
    return 0


def cmd_train(args) -> int:
    import torch.distributed as dist

    from .config import load_config
    from .trainer import Trainer

    overrides = list(args.set or [])
    if args.no_resume:
        overrides.append("run.resume=false")
    if args.no_progress:
        overrides.append("run.progress=false")
    cfg = load_config(args.config, overrides)
    if cfg.run.tf32 and cfg.target.device.startswith("cuda"):
        import torch

        # Process-wide, so it is set here and not inside Trainer: fp32 products in TF32 on the GPU (features,
        # target logits at the scored slots, the drafter). Training only; decoding never runs with it.
        torch.set_float32_matmul_precision("high")
    try:
        summary = Trainer(cfg).run()
        if dist.is_initialized():
            dist.barrier()  # leave together: a rank tearing gloo down while its peer still talks aborts the peer
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    if int(os.environ.get("RANK", "0")) == 0:  # one summary line, not one per torchrun process
        print(json.dumps({k: v for k, v in summary.items() if k != "last"}))
    return 0


def _cache_args(p, build: bool) -> None:
    p.add_argument("--data", required=True, help="datagen output directory, or a .jsonl (.xz, .gz) of conversations")
    p.add_argument("--out", required=build, help="cache directory" + ("" if build else " (for the disk check)"))
    p.add_argument("--model", default=DEFAULT_MODEL, help="target model spec (default: %(default)s)")
    p.add_argument("--layers", default="", help="comma-separated target layers to capture (default: spread)")
    p.add_argument("--num-feature-layers", type=int, default=5, help="layers when --layers is not given")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "int8", "float32"],
                   help="storage precision (int8: per-row absmax scales)")
    p.add_argument("--max-seq-len", type=int, default=2048, help="truncate sequences to this many tokens")
    p.add_argument("--limit", type=int, default=0, help="only the first N sequences")


def add_subcommands(subparsers) -> None:
    p = subparsers.add_parser("datagen", help="regenerate answers to prompts with the target",
                              description="Regenerate answers with the target (our batched runtime, or an "
                              "OpenAI-compatible --endpoint); resumable: re-run to continue.")
    p.add_argument("--prompts", required=True, help="JSONL: {\"turns\": [...]} / {\"messages\": [...]} per line")
    p.add_argument("--out", required=True, help="output directory (data.jsonl + meta.json)")
    p.add_argument("--model", default=DEFAULT_MODEL, help="target model spec (default: %(default)s)")
    p.add_argument("--endpoint", help="base URL of an OpenAI-compatible server instead of our runtime")
    p.add_argument("--api-model", help="model name to send to --endpoint (default: --model)")
    p.add_argument("--limit", type=int, default=0, help="only the first N prompts")
    p.add_argument("--temperature", type=float, default=0.7)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--max-new-tokens", type=int, default=512, help="per assistant turn")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--batch-size", type=int, default=16, help="conversations per forward")
    p.add_argument("--batch-tokens", type=int, default=0,
                   help="transformers backend: at most rows x (prompt + max new tokens) per generate call")
    p.add_argument("--backend", default="runtime", choices=["runtime", "transformers"],
                   help="runtime: our ragged runtime (CPU); transformers: padded batched generate (for a GPU)")
    p.add_argument("--device", default="auto", help="device of the transformers backend (default: %(default)s)")
    p.add_argument("--concurrency", type=int, default=8, help="parallel requests (--endpoint)")
    p.add_argument("--max-context", type=int, default=0, help="context limit (default: the model's)")
    p.add_argument("--skip-bad", action="store_true", help="skip malformed prompt lines instead of failing")
    p.add_argument("--no-progress", action="store_true")
    p.set_defaults(func=cmd_datagen)

    cache = subparsers.add_parser("cache", help="build or size the target cache (hidden states for training)")
    sub = cache.add_subparsers(dest="cache_command", required=True)
    b = sub.add_parser("build", help="compute and store target features (resumable)",
                       description="Run the target over the dataset and store the captured layers and final "
                       "hidden state per token; re-run to resume.")
    _cache_args(b, build=True)
    b.add_argument("--shard-tokens", type=int, default=16384, help="tokens per shard file (resume granularity)")
    b.add_argument("--batch-tokens", type=int, default=2048, help="tokens per target forward")
    b.add_argument("--overwrite", action="store_true", help="discard an existing cache in --out")
    b.add_argument("--no-progress", action="store_true")
    b.set_defaults(func=cmd_cache_build)
    e = sub.add_parser("estimate", help="print the cache size before building it")
    _cache_args(e, build=False)
    e.set_defaults(func=cmd_cache_estimate)

    t = subparsers.add_parser("train", help="train a DSpark/DFlash drafter",
                              description="Train a drafter from a TOML/JSON config; resumes from the last "
                              "checkpoint in run.out_dir. Launch with torchrun for several processes.")
    t.add_argument("--config", help="TOML or JSON config (sections: target, drafter, data, optim, loss, run)")
    t.add_argument("--set", action="append", metavar="SECTION.KEY=VALUE", help="override a config value")
    t.add_argument("--no-resume", action="store_true", help="ignore existing checkpoints")
    t.add_argument("--no-progress", action="store_true")
    t.set_defaults(func=cmd_train)

    s = subparsers.add_parser("synth-prompts", help="write templated math/code/chat prompts (seeded)",
                              description="Deterministic synthetic prompts for the domains drafters are judged "
                              "on; regenerate their answers with `datagen`.")
    s.add_argument("--out", required=True, help="output .jsonl")
    s.add_argument("--count", type=int, default=6000)
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--interleave-with", help="alternate with a seeded shuffle of this prompt file's records")
    s.set_defaults(func=cmd_synth_prompts)


def cmd_synth_prompts(args) -> int:
    from .synth_prompts import write_prompts

    if args.count < 1:
        raise ValueError("--count must be at least 1")
    n = write_prompts(args.out, args.count, args.seed, args.interleave_with)
    print(json.dumps({"prompts": n, "out": args.out}))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m dspark.training")
    add_subcommands(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError) as exc:  # bad input: one clear line, no traceback
        print(f"error: {exc}", file=sys.stderr)
        return 2
