"""`python -m dspark.serving` in a subprocess: argument checks, and graceful shutdown on SIGTERM."""
import json
import signal
import subprocess
import sys
import threading
import time
import urllib.request

import pytest

pytest.importorskip("starlette")
pytest.importorskip("uvicorn")

from server_testlib import free_port, tiny_model_dir  # noqa: E402


def test_serve_subcommand_registers_and_checks_arguments():
    import argparse

    from dspark.serving.cli import add_serve

    parser = argparse.ArgumentParser()
    add_serve(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["serve", "--model", "m", "--api-key", "k", "--max-concurrency", "4", "--max-queue",
                              "8", "--timeout", "30", "--drafter", "none", "--policy", "fixed-3", "--port", "9"])
    assert (args.host, args.max_concurrency, args.max_queue, args.timeout) == ("127.0.0.1", 4, 8, 30.0)
    bad = subprocess.run([sys.executable, "-m", "dspark.serving", "--max-concurrency", "0"], capture_output=True,
                         text=True, timeout=60)
    assert bad.returncode == 2 and "--max-concurrency must be >= 1" in bad.stderr  # before any model load


def test_sigterm_stops_accepting_and_cancels_in_flight_work_by_the_deadline():
    port = free_port()
    # Deadline 0.2 s, signalled once the stream has begun: the 1,000-token request takes ~1 s on the tiny model,
    # so it is still running at the deadline (signalling after a fixed 1 s raced its completion on a fast machine).
    proc = subprocess.Popen([sys.executable, "-m", "dspark.serving", "--model", str(tiny_model_dir()), "--port",
                             str(port), "--shutdown-deadline", "0.2", "--log-level", "warning"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(300):
            try:
                urllib.request.urlopen(f"{url}/health", timeout=1)
                break
            except OSError:
                time.sleep(0.1)
        events = []

        def stream():
            body = {"prompt": "Go on", "max_tokens": 1000, "ignore_eos": True, "stream": True}
            req = urllib.request.Request(f"{url}/v1/completions", data=json.dumps(body).encode())
            with urllib.request.urlopen(req, timeout=60) as r:
                for line in r:
                    if line.strip():
                        events.append(line.decode().strip())
        reader = threading.Thread(target=stream)
        reader.start()
        for _ in range(200):  # until the first streamed chunk: the request is in flight
            if events:
                break
            time.sleep(0.05)
        start = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=20)
        elapsed = time.monotonic() - start
        reader.join(10)
        assert elapsed < 6, f"shutdown took {elapsed:.1f} s with a 0.2 s deadline"
        assert events[-1] == "data: [DONE]"
        assert json.loads(events[-2].removeprefix("data: "))["error"]["code"] == "shutting_down"
        with pytest.raises(OSError):  # no longer listening
            urllib.request.urlopen(f"{url}/health", timeout=2)
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()
