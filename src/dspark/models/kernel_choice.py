"""Up to how many rows our C kernel serves a projection on this machine: measured once per machine, then cached.

Why measured: which kernel reads the weights faster for a few rows depends on the CPU and even on the VM's phase.
On the 2-core dev machine the C kernel (models/native.py) beat oneDNN's packed product at every row count up to
16 in one phase (`python -m dspark.bench.kernels --rows 1,2,3,4,6,8,12,16`, results/kernels-s20), while in a
faster phase its one-row-at-a-time predecessor lost from 4 rows (results/runtime-s16). A fixed limit fits one
of them; a verify step of 3-8 tokens then pays the slower kernel (57 -> 81 ms from 2 to 3 tokens with the limit
at 2, results/serving-s19-early-stop/profile.txt).

The measurement times every projection of one forward (the model's own weights, so the weight traffic is the
real one) through both kernels, interleaved in rounds so that drift hits them alike, and keeps the largest row
count up to which ours is never slower. It takes ≈ 15 s on the 2-core dev machine and is cached per CPU, kernel
source, torch version, thread count and weight shapes; `DSPARK_NATIVE_ROWS=n` overrides it, and `dspark profile
--force` measures it again (the speed profile records the limit it was measured with, profiling.profile_key).
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch

from . import native
from .layers import Projection

log = logging.getLogger("dspark")
VERSION = 1
CANDIDATE_ROWS = (1, 2, 3, 4, 5, 6, 8, 10, 12, 16)
ROUNDS = 5


def projections(model) -> list[Projection]:
    return [p for layer in model.layers for p in (layer.qkv, layer.o, layer.gate_up, layer.down)] + [model.lm_head]


def is_tunable(model) -> bool:
    """Both kernels must be available on every projection for there to be a choice."""
    projs = projections(model)
    return all(p.native and p.packed is not None for p in projs)


def _key(projs: list[Projection]) -> str:
    shapes = sorted({(tuple(p.weight.shape), p.bias is not None) for p in projs})
    parts = [native._cpu_signature(), native.source_hash(), torch.__version__, repr(shapes),
             str(torch.get_num_threads())]
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:16]


def cache_path(model) -> Path:
    from .loader import cache_root

    return cache_root() / "kernels" / f"native-rows-{_key(projections(model))}.json"


def measure(model, rows: tuple[int, ...] = CANDIDATE_ROWS, rounds: int = ROUNDS) -> tuple[int, dict]:
    """(limit, {rows: [native s, oneDNN s]}): every projection through each kernel, `rounds` interleaved rounds
    after one warm-up; the limit is the largest count before the first one where ours is the slower median."""
    projs = projections(model)
    paths = {"native": lambda p, x: native.linear(x, p.weight, p.bias), "onednn": Projection.packed_linear}
    table: dict[int, list[float]] = {}
    for n in rows:
        xs = [torch.randn(n, p.weight.shape[1], dtype=p.weight.dtype) for p in projs]
        times: dict[str, list[float]] = {name: [] for name in paths}
        for i in range(rounds + 1):
            for name, fn in paths.items():
                t0 = time.perf_counter()
                for p, x in zip(projs, xs):
                    fn(p, x)
                if i:
                    times[name].append(time.perf_counter() - t0)
        table[n] = [statistics.median(times["native"]), statistics.median(times["onednn"])]
    return crossover(table), table


def crossover(table: dict[int, list[float]]) -> int:
    """The largest row count before the first one where ours is slower ({rows: [native, oneDNN]}). A prefix, not
    every count where ours wins: one noisy win past a loss would route rows the measurement says are slower."""
    limit = 0
    for n in sorted(table):
        if table[n][0] > table[n][1]:
            break
        limit = n
    return limit


def _write_atomic(path: Path, payload: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".json", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(payload, f, indent=1)
        os.replace(tmp, path)  # readers see the old file or the new one, never a partial one
    except BaseException:
        os.unlink(tmp)
        raise


def _cached(path: Path) -> int | None:
    try:
        obj = json.loads(path.read_text())
        if obj.get("version") == VERSION and isinstance(obj.get("native_rows"), int) and obj["native_rows"] >= 0:
            return obj["native_rows"]
        log.warning("%s is from another version or malformed; measuring the kernel crossover again", path)
    except FileNotFoundError:
        pass
    except (OSError, ValueError) as exc:
        log.warning("could not read %s (%s); measuring the kernel crossover again", path, exc)
    return None


def native_rows(model, force: bool = False) -> int | None:
    """The row limit for this model's projections on this machine (None: no choice to make here)."""
    env = os.environ.get("DSPARK_NATIVE_ROWS")
    if env is not None:
        if not env.isdigit():
            raise ValueError(f"DSPARK_NATIVE_ROWS must be a non-negative integer, got {env!r}")
        return int(env)
    if not is_tunable(model):
        return None
    path = cache_path(model)
    if not force and (cached := _cached(path)) is not None:
        return cached
    log.info("measuring up to how many rows the C projection kernel beats oneDNN here (once; cached at %s)", path)
    limit, table = measure(model)
    _write_atomic(path, {"version": VERSION, "native_rows": limit, "rounds": ROUNDS,
                         "seconds": {str(n): t for n, t in table.items()}, "threads": torch.get_num_threads(),
                         "measured_at": time.strftime("%Y-%m-%dT%H:%M:%S%z")})
    return limit


def apply(model, limit: int | None) -> None:
    """Route each projection of `model` through our kernel for at most `limit` rows (None: leave as built)."""
    if limit is None:
        return
    for p in projections(model):
        p.native_rows = limit
    model.native_rows = limit


def tune(model, force: bool = False) -> int | None:
    limit = native_rows(model, force)
    apply(model, limit)
    return limit
