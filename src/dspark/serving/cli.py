"""`dspark serve`: registered by `add_serve(subparsers)`; also runnable as `python -m dspark.serving`."""
from __future__ import annotations

import argparse
import ipaddress
import os
import sys

from ..models.loader import DEFAULT_MODEL


def add_serve(sub) -> None:
    p = sub.add_parser("serve", help="OpenAI-compatible HTTP server (SSE streaming, Prometheus /metrics)",
                       description="Serve /v1/chat/completions, /v1/completions, /v1/models, /health and /metrics "
                                   "with speculative decoding. Stops gracefully on SIGTERM.")
    p.add_argument("--model", default=DEFAULT_MODEL, help="HF directory, .gguf file, hub id, or an embedded name")
    p.add_argument("--served-model-name", default=None, help="the `model` clients send (default: --model)")
    p.add_argument("--drafter", default="auto", help="auto (the shipped DSpark drafter for this model where the "
                   "policy schedules it, else n-gram), dspark, ngram, none, or the path of a trained drafter; a "
                   "DSpark drafter may end in @fp32 or @bf16 (its own products; default: bf16 where the CPU "
                   "multiplies bf16 natively)")
    p.add_argument("--policy", default="auto",
                   help="verification policy: auto, none, mtp1, fixed-<k>, sync, async, async-online, threshold; "
                        "options may follow the name, e.g. async:min_gain=0.01")
    p.add_argument("--gamma", type=int, default=7, help="draft block size")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--host", default="127.0.0.1", help="bind address (default: loopback only)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", default=os.environ.get("DSPARK_API_KEY"),
                   help="require 'Authorization: Bearer KEY' (default: $DSPARK_API_KEY, which keeps it out of ps)")
    p.add_argument("--max-concurrency", type=int, default=16, help="requests decoded together (engine batch)")
    p.add_argument("--max-queue", type=int, default=64, help="requests waiting beyond the batch; more get 429")
    p.add_argument("--timeout", type=float, default=600.0, help="per-request limit in seconds (0 = none)")
    p.add_argument("--default-max-tokens", type=int, default=256, help="max_tokens when a request gives none")
    p.add_argument("--max-body-bytes", type=int, default=2 * 2**20, help="larger request bodies get 413")
    p.add_argument("--kv-budget-gb", type=float, default=4.0, help="KV cache memory the engine may reserve")
    p.add_argument("--no-prefix-cache", action="store_true",
                   help="prefill every prompt in full (default: copy the KV of a prompt prefix that a running or "
                        "recently finished request shares — system prompts, n choices, the next chat turn)")
    p.add_argument("--shutdown-deadline", type=float, default=30.0,
                   help="seconds in-flight requests get to finish after SIGTERM before they are cancelled")
    p.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    p.set_defaults(func=run_serve)


def _check(args) -> None:
    for name in ("max_concurrency", "max_queue", "default_max_tokens", "max_body_bytes", "gamma"):
        least = 0 if name == "max_queue" else 1
        if getattr(args, name) < least:
            raise ValueError(f"--{name.replace('_', '-')} must be >= {least}, got {getattr(args, name)}")
    if args.timeout < 0 or args.shutdown_deadline < 0 or args.kv_budget_gb <= 0:
        raise ValueError("--timeout and --shutdown-deadline must be >= 0 and --kv-budget-gb > 0")
    if not 0 <= args.port <= 65535:
        raise ValueError(f"--port must be in 0..65535, got {args.port}")


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def run_serve(args) -> int:
    _check(args)  # before the model loads: a typo should not cost a model load
    import uvicorn

    from ..engine.llm import LLM
    from .server import ServerConfig, create_app

    if args.api_key is not None and not args.api_key.strip():
        raise ValueError("--api-key is empty")
    if not _is_loopback(args.host) and not args.api_key:
        print(f"warning: serving on {args.host} without --api-key: anyone who can reach it may use it",
              file=sys.stderr)
    llm = LLM(model=args.model, drafter=args.drafter, policy=args.policy, gamma=args.gamma, dtype=args.dtype,
              max_running=args.max_concurrency, kv_budget_gb=args.kv_budget_gb,
              prefix_cache=not args.no_prefix_cache)
    config = ServerConfig(model_name=args.served_model_name or args.model, api_key=args.api_key,
                          max_concurrency=args.max_concurrency, max_queue=args.max_queue,
                          timeout_s=args.timeout or None, max_body_bytes=args.max_body_bytes,
                          default_max_tokens=args.default_max_tokens, shutdown_deadline_s=args.shutdown_deadline)
    app = create_app(llm, config)
    server = draining_server_class()(uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                                           timeout_graceful_shutdown=args.shutdown_deadline + 5,
                                           timeout_keep_alive=5))
    server.dspark_state = app.state
    server.run()
    return 0


def draining_server_class():
    import uvicorn  # imported only when serving, so registering `serve` costs nothing

    class DrainingServer(uvicorn.Server):
        """On SIGTERM/SIGINT uvicorn stops listening and waits for open connections; we also start the engine's
        drain at once, so in-flight requests finish or are cancelled by the deadline and those connections end."""

        dspark_state = None

        def handle_exit(self, sig, frame) -> None:
            if self.dspark_state is not None:
                self.dspark_state.begin_drain()
            super().handle_exit(sig, frame)

    return DrainingServer


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m dspark.serving")
    add_serve(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["serve", *(sys.argv[1:] if argv is None else argv)])
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError) as exc:  # user errors: one line, as `dspark` prints them
        print(f"error: {exc}", file=sys.stderr)
        return 2
