"""Shared pieces of the server tests: a fast random Llama that speaks through SmolLM2's real tokenizer, and a
server started on a free loopback port in a background thread of the test process (so tests can look at the
engine's KV accounting directly)."""
from __future__ import annotations

import shutil
import socket
import threading
import time
from pathlib import Path

import pytest
import torch

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


def smollm2_tokenizer_dir() -> Path:
    from dspark.models import resolve

    try:
        return resolve("smollm2-135m-instruct")
    except Exception as exc:  # the embedded model is an optional install on a fresh machine
        pytest.skip(f"SmolLM2's tokenizer is not available: {exc}")


def make_tiny_model(path: Path, max_position: int = 1024, seed: int = 0) -> Path:
    """A 2-layer, 64-wide random Llama with SmolLM2's vocabulary and tokenizer: real text in and out, with
    forwards of a few milliseconds, so dozens of concurrent requests fit in a test on two cores."""
    from transformers import AutoConfig, AutoModelForCausalLM

    source = smollm2_tokenizer_dir()
    path.mkdir(parents=True, exist_ok=True)
    config = AutoConfig.for_model(model_type="llama", vocab_size=49152, hidden_size=64, intermediate_size=128,
                                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                  max_position_embeddings=max_position, rms_norm_eps=1e-5,
                                  tie_word_embeddings=True, rope_theta=10000.0, eos_token_id=2, bos_token_id=1)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():  # peaked logits, so sampled text is not uniform noise and EOS stays rare
        model.model.embed_tokens.weight.mul_(4)
    model.save_pretrained(str(path))
    for name in TOKENIZER_FILES:
        if (source / name).is_file():
            shutil.copy(source / name, path / name)
    return path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_until(check, timeout: float = 10.0, interval: float = 0.05) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if check():
            return True
        time.sleep(interval)
    return check()


class ThreadServer:
    """uvicorn serving our app in a daemon thread; `stop()` runs the same graceful shutdown as SIGTERM."""

    def __init__(self, app, host: str = "127.0.0.1"):
        import uvicorn

        self.port = free_port()
        self.app = app
        self.server = uvicorn.Server(uvicorn.Config(app, host=host, port=self.port, log_level="warning",
                                                    lifespan="on"))
        self.server.install_signal_handlers = lambda: None  # signals belong to the test runner's main thread
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        if not wait_until(lambda: self.server.started, timeout=30):
            raise RuntimeError("the test server did not start")
        self.url = f"http://127.0.0.1:{self.port}"

    def stop(self) -> None:
        self.app.state.begin_drain()  # as SIGTERM does in `dspark serve`
        self.server.should_exit = True
        self.thread.join(timeout=30)


_TINY: dict[str, Path] = {}


def tiny_model_dir() -> Path:
    """Built once per test process (about a second) and shared by every server test module."""
    if "dir" not in _TINY:
        import atexit
        import tempfile

        root = Path(tempfile.mkdtemp(prefix="dspark-serve-tiny-"))
        atexit.register(shutil.rmtree, root, True)
        _TINY["dir"] = make_tiny_model(root / "tiny")
    return _TINY["dir"]


def start_server(**config) -> ThreadServer:
    """A ThreadServer over the tiny model; `config` goes to ServerConfig (max_concurrency also to the engine)."""
    from dspark.engine.llm import LLM
    from dspark.serving.server import ServerConfig, create_app

    engine_opts = {k: config.pop(k) for k in ("kv_budget_tokens",) if k in config}
    config.setdefault("model_name", "tiny")
    llm = LLM(model=str(tiny_model_dir()), drafter="ngram", gamma=4,
              max_running=config.get("max_concurrency", 16), **engine_opts)
    return ThreadServer(create_app(llm, ServerConfig(**config)))


def engine_idle(server: ThreadServer) -> bool:
    e = server.app.state.engine.engine
    return e.kv_reserved == 0 and not e.running and not e.waiting and not e.requests
