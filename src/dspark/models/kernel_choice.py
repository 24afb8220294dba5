"""How this machine's projection kernels serve a few rows: measured once per machine, then cached.

Two choices, both measured because they depend on the CPU and even on the VM's phase:

* Up to how many rows our C kernel (models/native.py; fp32, and bf16 on AVX512-BF16 or AVX2) serves a
  projection before oneDNN's packed product does — or, where torch packs no weights of the model's dtype (bf16 on
  an AVX2-only CPU), before torch's plain product does, prefill sizes included. On the 2-core dev machine the C
  kernel beat oneDNN at every row count up to 16 in one phase (`python -m dspark.bench.kernels --rows 1,2,3,4,6,8,12,16`,
  results/kernels-s20), while in a faster phase its one-row-at-a-time predecessor lost from 4 rows
  (results/runtime-s16). A fixed limit fits one of them; a verify step of 3-8 tokens then pays the slower kernel
  (57 -> 81 ms from 2 to 3 tokens with the limit at 2, results/serving-s19-early-stop/profile.txt).
* Which row counts below `PAD_TO` oneDNN runs faster padded to `PAD_TO` rows. On the dev CPU its packed product
  takes a slower path for 1-2 rows than for 4: in a bf16 SmolLM2 forward its own time is 12.3 / 13.4 ms at 1 / 2
  rows against 10.7 at 4 (results/forward-parts-s38). A bf16 model had no C kernel then, so every decode step
  paid it; padded, its forward is 1.05x faster at 1 row and 1.10x at 2 (results/pad-cost-s38). Since session 39
  the bf16 C kernel serves one row on the dev CPU and padded oneDNN two (results/kernels-s39/routes-bf16.json).

The measurement times every projection of one forward (the model's own weights, so the weight traffic is the
real one) through each route, interleaved in rounds so that drift hits them alike: the C kernel, oneDNN, and for
rows below `PAD_TO` oneDNN padded (the padding copy included). A row count is padded where that is faster; the C
kernel's limit is the largest row count up to which it is never slower than oneDNN's better route. It takes ≈ 15 s
on the 2-core dev machine and is cached per CPU, kernel source, torch version, thread count and weight shapes and
dtypes; `DSPARK_NATIVE_ROWS=n` sets the limit instead (and pads nothing), and `dspark profile --force` measures
again (the speed profile records the routes it was measured with, profiling.profile_key).
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import statistics
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

from . import native
from .layers import Projection, bucket_rows

log = logging.getLogger("dspark")
VERSION = 2  # 2: oneDNN padding for a few rows; weight dtypes in the key
CANDIDATE_ROWS = (1, 2, 3, 4, 5, 6, 8, 10, 12, 16)
PAD_TO = 4  # oneDNN calls of fewer rows may run padded to this many
ROUNDS = 5
PAD_ROUNDS = 15  # rows below PAD_TO: padding gains ~5 % at one row, which 5 rounds on a noisy VM did not always see


@dataclass(frozen=True)
class Routes:
    """native_rows: our C kernel serves up to this many rows (None: it serves none of this model's projections);
    pad_to: {rows: padded rows} for oneDNN calls that run faster padded."""

    native_rows: int | None
    pad_to: dict[int, int] = field(default_factory=dict)


def projections(model) -> list[Projection]:
    return [p for layer in model.layers for p in (layer.qkv, layer.o, layer.gate_up, layer.down)] + [model.lm_head]


def has_packed(model) -> bool:
    return all(p.packed is not None for p in projections(model))


def is_tunable(model) -> bool:
    """oneDNN's packed product must serve every projection for there to be a choice (of padding; of the C kernel's
    limit where it serves them too), or the C kernel must, against torch's plain product (a bf16 model where
    oneDNN packs no bf16 weights: an AVX2-only CPU)."""
    return has_packed(model) or has_native(model)


def has_native(model) -> bool:
    return all(p.native for p in projections(model))


def _key(projs: list[Projection]) -> str:
    shapes = sorted({(tuple(p.weight.shape), str(p.weight.dtype), p.bias is not None) for p in projs})
    parts = [native._cpu_signature(), native.source_hash(), torch.__version__, repr(shapes),
             str(torch.get_num_threads()), str(PAD_TO)]
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:16]


def cache_path(model) -> Path:
    from .loader import cache_root

    return cache_root() / "kernels" / f"routes-{_key(projections(model))}.json"


ROUTES = {"native": lambda p, x: native.linear(x, p.weight, p.bias),  # what each route runs, as the engine would
          "onednn": lambda p, x: p.packed_linear(x, size=bucket_rows(x.shape[0])),
          "padded": lambda p, x: p.packed_linear(x, size=PAD_TO),
          "torch": lambda p, x: F.linear(x, p.weight, p.bias)}  # only where nothing is packed
# Without a packed product the C kernel is weighed against torch's plain one, which for bf16 on a CPU without bf16
# instructions falls further behind as rows grow (all of SmolLM2's projections on the AVX2 EPYC: 14.2 against 16.2
# ms at 1 row, 48 against 230 at 16, 178 against 909 at 64, 725 against 3,561 at 256:
# results/bf16-avx2-s53/routes-bf16.json), so a prefill's rows are measured too, and a kernel never slower up to
# the last of them serves every row count (up to 64: the larger counts took 40 s of the first start to confirm it).
UNPACKED_ROWS = CANDIDATE_ROWS + (32, 64)
EVERY_ROW = 2**31 - 1  # native_rows where the C kernel serves every row count


def measure(model, rows: tuple[int, ...] | None = None, rounds: int = ROUNDS) -> tuple[Routes, dict]:
    """(routes, {rows: {route: median s}}): every projection through each route that applies to the row count,
    `rounds` interleaved rounds (at least PAD_ROUNDS below PAD_TO where padding is measured) after one warm-up.
    Without the C kernel only the rows below PAD_TO are measured."""
    projs = projections(model)
    with_native, packed = has_native(model), has_packed(model)
    if rows is None:
        rows = (CANDIDATE_ROWS if packed else UNPACKED_ROWS) if with_native else \
            tuple(n for n in CANDIDATE_ROWS if n < PAD_TO)
    others = ("onednn", "padded") if packed else ("torch",)
    table: dict[int, dict[str, float]] = {}
    for n in rows:
        names = [r for r in ROUTES if (r == "native" and with_native or r in others) and (r != "padded" or n < PAD_TO)]
        xs = [torch.randn(n, p.weight.shape[1], dtype=p.weight.dtype) for p in projs]
        times: dict[str, list[float]] = {name: [] for name in names}
        for i in range((rounds if n >= PAD_TO or not packed else max(rounds, PAD_ROUNDS)) + 1):  # padding's
            for name in names:
                t0 = time.perf_counter()
                for p, x in zip(projs, xs):
                    ROUTES[name](p, x)
                if i:
                    times[name].append(time.perf_counter() - t0)
        table[n] = {name: statistics.median(t) for name, t in times.items()}
    # torch's fp32 product is a blocked GEMM that may overtake ours (tuned for a few rows) at a prefill's rows,
    # where its emulated bf16 one falls further behind: only bf16 is extrapolated past the counts measured (fp32
    # gets here only where torch packs nothing at all)
    return routes_from(table, with_native, every_row=all(p.weight.dtype == torch.bfloat16 for p in projs)), table


def routes_from(table: dict[int, dict[str, float]], with_native: bool, every_row: bool = True) -> Routes:
    """Pad where padded is faster; the C kernel's limit against oneDNN's better route at each row count. Without a
    packed product the other route is torch's, which loses ground as rows grow, so the limit is the largest count
    where ours is not slower (a near-tie lost at one row must not hand a prefill to torch), and where that is the
    last count measured, ours serves every count."""
    pad_to = {n: PAD_TO for n, t in table.items() if "padded" in t and t["padded"] < t["onednn"]}
    limit = None
    if with_native and table and all("torch" in t for t in table.values()):
        limit = max((n for n, t in table.items() if t["native"] <= t["torch"]), default=0)
        limit = EVERY_ROW if every_row and limit == max(table) >= UNPACKED_ROWS[-1] else limit
    elif with_native:
        limit = crossover({n: [t["native"], min(t["onednn"], t.get("padded", t["onednn"]))]
                           for n, t in table.items()})
    return Routes(limit, pad_to)


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


def _cached(path: Path) -> Routes | None:
    try:
        obj = json.loads(path.read_text())
        limit, pads = obj.get("native_rows"), obj.get("pad_to")
        if (obj.get("version") == VERSION and (limit is None or isinstance(limit, int) and limit >= 0)
                and isinstance(pads, dict) and all(k.isdigit() and isinstance(v, int) for k, v in pads.items())):
            return Routes(limit, {int(k): v for k, v in pads.items()})
        log.warning("%s is from another version or malformed; measuring the kernel routes again", path)
    except FileNotFoundError:
        pass
    except (OSError, ValueError, AttributeError) as exc:
        log.warning("could not read %s (%s); measuring the kernel routes again", path, exc)
    return None


def routes(model, force: bool = False) -> Routes | None:
    """This model's projection routes on this machine (None: no choice to make here)."""
    env = os.environ.get("DSPARK_NATIVE_ROWS")
    if env is not None:
        if not env.isdigit():
            raise ValueError(f"DSPARK_NATIVE_ROWS must be a non-negative integer, got {env!r}")
        return Routes(int(env))
    if not is_tunable(model):
        return None
    path = cache_path(model)
    if not force and (cached := _cached(path)) is not None:
        return cached
    log.info("measuring how this machine's projection kernels serve a few rows (once; cached at %s)", path)
    found, table = measure(model)
    _write_atomic(path, {"version": VERSION, "native_rows": found.native_rows,
                         "pad_to": {str(n): m for n, m in found.pad_to.items()},
                         "rounds": ROUNDS, "pad_rounds": PAD_ROUNDS,
                         "seconds": {str(n): t for n, t in table.items()}, "threads": torch.get_num_threads(),
                         "measured_at": time.strftime("%Y-%m-%dT%H:%M:%S%z")})
    return found


def apply(model, chosen: Routes | None) -> None:
    """Route each projection of `model` as `chosen` says (None: leave them as built)."""
    if chosen is None:
        return
    for p in projections(model):
        if chosen.native_rows is not None:
            p.native_rows = chosen.native_rows
        p.pad_to = dict(chosen.pad_to)


def tune(model, force: bool = False) -> Routes | None:
    chosen = routes(model, force)
    apply(model, chosen)
    return chosen
