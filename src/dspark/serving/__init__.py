"""OpenAI-compatible HTTP serving for the engine: `dspark serve` (or `python -m dspark.serving`).

Layout: protocol.py (request schemas → engine inputs), errors.py (OpenAI error bodies), bridge.py (the engine
seen from the event loop), generation.py (SSE and plain responses), metrics.py (Prometheus text), server.py (the
Starlette app), cli.py (the `serve` subcommand), loadtest.py (load and fault test against a running server).

Nothing here is imported by the rest of the package, so `dspark` works without the serving extra installed.
"""
