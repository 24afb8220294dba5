"""Shared pieces of the benchmarks: the benchmark prompt sets, machine facts, result writers, shuffled timing."""
from __future__ import annotations

import datetime
import json
import os
import platform
import random
import statistics
import time
from pathlib import Path

import torch

from ..scheduling.profile import cpu_name

DOMAINS = {"gsm8k": "math", "math500": "math", "aime25": "math", "humaneval": "code", "mbpp": "code",
           "livecodebench": "code", "mt-bench": "chat", "arena-hard-v2": "chat"}


def shared_dir() -> Path | None:
    """../shared beside the checkout (or $DSPARK_SHARED); None when absent."""
    env = os.environ.get("DSPARK_SHARED")
    candidates = [Path(env)] if env else []
    candidates += [Path.cwd().parent / "shared", Path(__file__).resolve().parents[4] / "shared"]
    return next((c for c in candidates if (c / "bench_data").is_dir()), None)


def load_bench_prompts(sets: tuple[str, ...], per_set: int) -> list[tuple[str, str]]:
    """[(set name, first user turn)] from ../shared/bench_data; a clear error when missing."""
    root = shared_dir()
    if root is None:
        raise FileNotFoundError("benchmark prompts live in ../shared/bench_data (or $DSPARK_SHARED/bench_data), "
                                "which is not present on this machine")
    out = []
    for name in sets:
        path = root / "bench_data" / f"{name}.jsonl"
        if not path.is_file():
            available = sorted(p.stem for p in (root / "bench_data").glob("*.jsonl"))
            raise FileNotFoundError(f"no benchmark set {name!r}; available: {', '.join(available)}")
        with path.open() as f:
            for line, _ in zip(f, range(per_set)):
                out.append((name, json.loads(line)["turns"][0]))
    return out


def machine_info() -> dict:
    return {"cpu": cpu_name(), "cores": os.cpu_count(), "torch_threads": torch.get_num_threads(),
            "torch": torch.__version__, "python": platform.python_version(), "platform": platform.platform(),
            "date": datetime.datetime.now().isoformat(timespec="seconds")}


def median(values) -> float:
    values = list(values)
    return float(statistics.median(values)) if values else float("nan")


def median_seconds(fn, repeats: int, warmup: int = 1) -> float:
    """Median wall time of `repeats` calls of fn, after `warmup` untimed ones."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return median(times)


def markdown_table(headers: list[str], rows: list[list]) -> str:
    def fmt(v):
        return f"{v:.3g}" if isinstance(v, float) else str(v)
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(fmt(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


def timing_report(title: str, machine: dict, rounds: int, headers: list[str], rows: list[list]) -> str:
    """A cost script's Markdown: title, the machine and how it was timed, then the table."""
    return (f"# {title}\n\nMachine: {machine['cpu']}, torch {machine['torch']}, {machine['torch_threads']} threads, "
            f"{machine['date']}; medians of {rounds} shuffled rounds.\n\n" + markdown_table(headers, rows) + "\n")


def publish(out: Path | None, name: str, data: dict, markdown: str) -> None:
    """Print the Markdown; with an output folder also write name.json and name.md there."""
    print(markdown)
    if out is not None:
        write_results(out, name, data, markdown)


def write_results(out: Path, name: str, data: dict, markdown: str) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps(data, indent=2))
    (out / f"{name}.md").write_text(markdown)


def shuffled_medians(jobs: dict, rounds: int, seed: int = 0) -> dict:
    """Median seconds of each job (a no-argument callable) over ``rounds`` rounds, each visiting every job once in a
    fresh seeded order (one untimed warm-up round first): a slow phase of a shared machine then lands on every job
    alike, and no job always follows the same neighbour."""
    times = {name: [] for name in jobs}
    rng = random.Random(seed)
    for i in range(rounds + 1):
        for name in rng.sample(list(jobs), len(jobs)):
            t0 = time.perf_counter()
            jobs[name]()
            if i:
                times[name].append(time.perf_counter() - t0)
    return {name: float(statistics.median(ts)) for name, ts in times.items()}
