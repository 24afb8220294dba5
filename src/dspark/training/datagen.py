"""`dspark datagen`: regenerate the answers of a prompt file with the target itself.

Output directory: data.jsonl (one finished conversation per line, in completion order) and meta.json (model,
sampling settings, chat template, prompt-file hash). A record is written only when all its turns are done, as
one line; a restart re-reads the file, drops a torn last line, and skips the ids already present — so an
interruption loses at most the conversations in flight and never duplicates one.
"""
from __future__ import annotations

import hashlib
import json
import os
import sys
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from .conversations import read_prompts

FORMAT, VERSION = "dspark.datagen", 1
DATA, META = "data.jsonl", "meta.json"
BACKENDS = ("runtime", "transformers")  # our ragged runtime (CPU) | transformers' padded generate (GPU)


class DatagenError(ValueError):
    pass


@dataclass(frozen=True)
class DatagenSettings:
    temperature: float = 0.7
    top_p: float = 1.0
    top_k: int = 0
    max_new_tokens: int = 512
    seed: int = 0
    batch_size: int = 16  # concurrent conversations in our runtime's ragged forward
    batch_tokens: int = 0  # transformers backend: cap on rows x (prompt + max_new_tokens) per generate call
    concurrency: int = 8  # parallel HTTP requests with --endpoint
    max_context: int = 0  # 0 = the model's context window

    def sampling(self) -> dict:
        return {k: v for k, v in asdict(self).items() if k in ("temperature", "top_p", "top_k", "max_new_tokens",
                                                                "seed")}


def record_seed(seed: int, record_id: str) -> int:
    """A per-conversation seed: its answer does not depend on which other prompts share its batch."""
    return int.from_bytes(hashlib.sha256(f"{seed}:{record_id}".encode()).digest()[:8], "little") >> 1


def file_sha256(path: str | Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


class OutputStore:
    """data.jsonl with exactly-once records across restarts (see module docstring)."""

    def __init__(self, out_dir: str | Path, meta: dict):
        self.dir = Path(out_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self._check_meta(meta)
        self.path = self.dir / DATA
        self.done = self._scan()
        self._file = open(self.path, "a", encoding="utf-8")
        self._lock = threading.Lock()

    def _check_meta(self, meta: dict) -> None:
        path = self.dir / META
        if path.is_file():
            old = json.loads(path.read_text())
            diff = [k for k in ("model", "endpoint", "sampling", "prompts_sha256") if old.get(k) != meta.get(k)]
            if diff:
                raise DatagenError(f"{self.dir} holds data generated with other settings ({', '.join(diff)} "
                                   f"differ); choose a new --out directory")
            return
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(meta, indent=2) + "\n")
        os.replace(tmp, path)

    def _scan(self) -> set[str]:
        """Ids already written; a torn last line (interrupted write) is cut off so it is generated again."""
        done: set[str] = set()
        if not self.path.exists():
            return done
        good = 0
        with open(self.path, "rb") as f:
            for raw in f:
                if not raw.endswith(b"\n"):
                    break
                try:
                    done.add(json.loads(raw)["id"])
                except (ValueError, KeyError, TypeError):
                    break
                good += len(raw)
        if good < self.path.stat().st_size:
            print(f"datagen: dropping a torn record at the end of {self.path}", file=sys.stderr)
            with open(self.path, "r+b") as f:
                f.truncate(good)
        return done

    def append(self, record: dict) -> None:
        line = json.dumps(record, ensure_ascii=False) + "\n"
        with self._lock:
            if record["id"] in self.done:
                return  # never twice, even if a caller retries
            self._file.write(line)
            self._file.flush()
            self.done.add(record["id"])

    def close(self) -> None:
        with self._lock:
            self._file.flush()
            os.fsync(self._file.fileno())
            self._file.close()


def run_datagen(prompts: str | Path, out_dir: str | Path, settings: DatagenSettings = DatagenSettings(), *,
                model: str = "smollm2-135m-instruct", endpoint: str | None = None, api_model: str | None = None,
                limit: int = 0, skip_bad: bool = False, progress: bool = True, on_record=None,
                loaded=None, backend: str = "runtime", device: str = "auto") -> dict:
    """Generate answers for every prompt not yet in out_dir. `loaded`: an already loaded model (tests);
    `on_record(record)`: called after each record is stored. Returns a summary."""
    if backend not in BACKENDS:
        raise DatagenError(f"unknown backend {backend!r}; choose one of {', '.join(BACKENDS)}")
    records, problems = read_prompts(prompts, skip_bad=skip_bad, limit=limit)
    for p in problems:
        print(f"datagen: skipped {p}", file=sys.stderr)
    tokenizer = None
    if endpoint is None:
        if loaded is None:
            from ..models import load_model
            loaded = load_model(model)
        tokenizer = loaded.tokenizer
    meta = {"format": FORMAT, "version": VERSION, "model": api_model or model if endpoint else model,
            "endpoint": endpoint, "sampling": settings.sampling(), "prompts": str(prompts),
            "prompts_sha256": file_sha256(prompts), "created": time.strftime("%Y-%m-%dT%H:%M:%S"),
            "chat_template": getattr(tokenizer, "chat_template", None),
            "backend": "endpoint" if endpoint else backend}
    store = OutputStore(out_dir, meta)
    todo = [r for r in records if r.id not in store.done]
    bar = _progress(len(todo), progress)
    counts = {"records": 0, "answer_tokens": 0, "skipped": 0, "failed": 0}
    t0 = time.perf_counter()

    def emit(record: dict) -> None:
        store.append(record)
        counts["records"] += 1
        counts["answer_tokens"] += sum(record.get("answer_tokens", []))
        counts["skipped"] += record.get("status") != "ok"
        bar.update(1)
        bar.set_postfix(tok_s=f"{counts['answer_tokens'] / max(time.perf_counter() - t0, 1e-9):.0f}")
        if on_record is not None:
            on_record(record)

    try:
        if endpoint:
            from .datagen_endpoint import generate_endpoint
            counts["failed"] = generate_endpoint(endpoint, api_model or model, todo, settings, emit)
        elif backend == "transformers":
            from .datagen_hf import generate_transformers
            generate_transformers(loaded, todo, settings, emit, device)
        else:
            from .datagen_local import generate_local
            generate_local(loaded, iter(todo), settings, emit)
    finally:
        bar.close()
        store.close()
    elapsed = time.perf_counter() - t0
    return {**counts, "already_done": len(records) - len(todo), "bad_lines": len(problems),
            "seconds": round(elapsed, 2), "tokens_per_s": round(counts["answer_tokens"] / max(elapsed, 1e-9), 1)}


def _progress(total: int, enabled: bool):
    from tqdm import tqdm

    return tqdm(total=total, unit="conv", desc="datagen", disable=not enabled, dynamic_ncols=True)
