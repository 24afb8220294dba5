"""Speed profiles on disk: the versioned cache the engine writes, and tables a user supplies (e.g. from a GPU).

Two different failure policies, on purpose:
  * the *cache* is ours and disposable: a missing, stale (other model/drafter/machine/dtype), old-version or
    corrupt cache gives ``None`` (with a warning, except when simply missing) and the caller re-profiles;
  * a *user table* is an explicit input: anything malformed raises ``ProfileFormatError`` naming the line,
    because silently ignoring it would make the scheduler optimise for the wrong hardware.
"""

from __future__ import annotations

import csv
import dataclasses
import io
import math
import os
import warnings
from pathlib import Path
from typing import Callable

from ._jsonio import FileFormatError, check_header, read_json, write_json_atomic
from .profile import ProfileKey, SpeedProfile

FORMAT = "dspark.speed_profile"
VERSION = 15  # 2: segment_seconds / tokens_per_segment; 3: shallow_draft_seconds / draft_depth; 4: the (R, k)
# grid; 5: drafting timed in the same rounds as the target's steps; 6: cheap steps sampled more, rounds shuffled;
# 7: grid k = 1, 2, 3, 4, 5, 8; 8: oneDNN rows 9-32 padded to a multiple of 4, not 16; 9: rows past 32 padded by
# under 1/8, not to a multiple of 16 or 128; 10: the prefill table (older: re-measured); 11: context prices;
# 12: drafting timed at every depth (depth_draft_seconds); 13: with a drafter, the engine's own work priced in
# (engine/overhead.py); 14: that work added as seconds (commit, feed; scheduling/engine_work.py), not as factors;
# 15: steps of <= 4 requests timed until their medians' errors are under 1 % (up to 120 s more)


class ProfileFormatError(FileFormatError):
    """A supplied or cached speed-profile file is malformed; the message names the file and line/row."""


def profile_to_dict(p: SpeedProfile) -> dict:
    return {
        "format": FORMAT,
        "version": VERSION,
        "key": p.key.as_dict() if p.key else None,
        "tokens": list(p.tokens),
        "seconds": list(p.seconds),
        "draft_requests": list(p.draft_requests),
        "draft_seconds": list(p.draft_seconds),
        "extrapolate": p.extrapolate,
        "source": p.source,
        "segment_seconds": p.segment_seconds,
        "tokens_per_segment": p.tokens_per_segment,
        "shallow_draft_seconds": list(p.shallow_draft_seconds),
        "draft_depth": p.draft_depth,
        "depth_draft_seconds": [list(row) for row in p.depth_draft_seconds],
        "grid_requests": list(p.grid_requests),
        "grid_tokens": list(p.grid_tokens),
        "grid_seconds": [list(row) for row in p.grid_seconds],
        "prefill_requests": list(p.prefill_requests),
        "prefill_tokens": list(p.prefill_tokens),
        "prefill_seconds": [list(row) for row in p.prefill_seconds],
        "grid_context": p.grid_context,
        "context_request_s": p.context_request_s,
        "context_token_s": p.context_token_s,
        "prefill_context_s": p.prefill_context_s,
    }


def profile_from_dict(obj: dict, path: str | os.PathLike = "<dict>") -> SpeedProfile:
    check_header(obj, path, fmt=FORMAT, version=VERSION, error=ProfileFormatError)
    try:
        key = ProfileKey(**obj["key"]) if obj.get("key") else None
        return SpeedProfile(
            tuple(obj["tokens"]),
            tuple(obj["seconds"]),
            tuple(obj.get("draft_requests", ())),
            tuple(obj.get("draft_seconds", ())),
            extrapolate=obj.get("extrapolate", "linear"),
            key=key,
            source=str(obj.get("source", "")),
            segment_seconds=float(obj.get("segment_seconds", 0.0)),
            tokens_per_segment=int(obj.get("tokens_per_segment", 0)),
            shallow_draft_seconds=tuple(obj.get("shallow_draft_seconds", ())),
            draft_depth=int(obj.get("draft_depth", 0)),
            depth_draft_seconds=tuple(tuple(row) for row in obj.get("depth_draft_seconds", ())),
            grid_requests=tuple(obj.get("grid_requests", ())),
            grid_tokens=tuple(obj.get("grid_tokens", ())),
            grid_seconds=tuple(tuple(row) for row in obj.get("grid_seconds", ())),
            prefill_requests=tuple(obj.get("prefill_requests", ())),
            prefill_tokens=tuple(obj.get("prefill_tokens", ())),
            prefill_seconds=tuple(tuple(row) for row in obj.get("prefill_seconds", ())),
            grid_context=int(obj.get("grid_context", 0)),
            context_request_s=float(obj.get("context_request_s", 0.0)),
            context_token_s=float(obj.get("context_token_s", 0.0)),
            prefill_context_s=float(obj.get("prefill_context_s", 0.0)),
        )
    except (KeyError, TypeError, ValueError) as e:
        raise ProfileFormatError(f"{path}: invalid speed profile: {e}") from e


def save_profile(p: SpeedProfile, path: str | os.PathLike) -> Path:
    return write_json_atomic(path, profile_to_dict(p))


def load_cached_profile(path: str | os.PathLike, key: ProfileKey) -> SpeedProfile | None:
    """The cached profile at ``path`` if it was made for exactly ``key``; otherwise None (re-profile)."""
    path = Path(path)
    if not path.exists():
        return None
    try:
        obj = read_json(path, kind="speed profile", error=ProfileFormatError)
        prof = profile_from_dict(obj, path)
    except FileFormatError as e:  # includes version mismatches: old caches are simply re-measured
        warnings.warn(f"ignoring unusable speed-profile cache, re-profiling: {e}", stacklevel=2)
        return None
    if prof.key != key:
        theirs = prof.key.as_dict() if prof.key else {}
        diff = {k: (theirs.get(k), v) for k, v in key.as_dict().items() if theirs.get(k) != v}
        warnings.warn(
            f"speed profile {path} was made for a different setup (cached, wanted): {diff}; re-profiling",
            stacklevel=2,
        )
        return None
    return prof


def load_or_measure(path: str | os.PathLike, key: ProfileKey, measure: Callable[[], SpeedProfile],
                    usable: Callable[[SpeedProfile], bool] = lambda p: True) -> SpeedProfile:
    """What an engine does at start: the cached profile for ``key`` if there is one (and it is ``usable``: holds
    what the caller needs), else ``measure()`` it (e.g. ``lambda: measure_profile(step_fn, counts)``), stamp it
    with ``key`` and cache it for next time."""
    prof = load_cached_profile(path, key)
    if prof is None or not usable(prof):
        m = measure()
        prof = dataclasses.replace(m, key=key)
        save_profile(prof, path)
    return prof


def _row_values(tokens_raw: object, seconds_raw: object, where: str, path: Path) -> tuple[int, float]:
    try:
        t = float(tokens_raw)  # type: ignore[arg-type]
        s = float(seconds_raw)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        raise ProfileFormatError(
            f"{path}: {where}: tokens and seconds must be numbers, got {tokens_raw!r}, {seconds_raw!r}")
    if not (math.isfinite(t) and t == int(t) and t >= 1):
        raise ProfileFormatError(f"{path}: {where}: tokens must be an integer >= 1, got {tokens_raw!r}")
    if not (math.isfinite(s) and s > 0):
        raise ProfileFormatError(f"{path}: {where}: seconds must be finite and > 0, got {seconds_raw!r}")
    return int(t), s


def _sorted_unique(rows: list[tuple[int, float, str]], path: Path) -> tuple[tuple[int, ...], tuple[float, ...]]:
    if not rows:
        raise ProfileFormatError(f"{path}: the table has no data rows")
    seen: dict[int, str] = {}
    for t, _, where in rows:
        if t in seen:
            raise ProfileFormatError(f"{path}: {where}: tokens={t} repeats {seen[t]}")
        seen[t] = where
    rows = sorted(rows)
    return tuple(r[0] for r in rows), tuple(r[1] for r in rows)


def load_profile_table(path: str | os.PathLike, *, key: ProfileKey | None = None) -> SpeedProfile:
    """A user-supplied table with columns ``tokens,seconds`` (seconds per verify step).

    CSV: a header naming both columns (others ignored), ``#`` comments and blank lines allowed.
    JSON: a list of ``{"tokens": B, "seconds": s}`` rows, or ``{"rows": [...]}``; with ``"draft": [{"requests": R,
    "seconds": s}, ...]`` optionally giving the drafting cost. Rows may come in any order.
    """
    path = Path(path)
    if path.suffix.lower() == ".json":
        return _load_json_table(path, key)
    text = path.read_text(encoding="utf-8")
    lines = [(i + 1, ln) for i, ln in enumerate(text.splitlines()) if ln.strip() and not ln.lstrip().startswith("#")]
    if not lines:
        raise ProfileFormatError(f"{path}: empty table (expected a header 'tokens,seconds' and rows)")
    header_no, header = lines[0]
    cols = [c.strip().lower() for c in next(csv.reader(io.StringIO(header)))]
    if "tokens" not in cols or "seconds" not in cols:
        raise ProfileFormatError(
            f"{path}: line {header_no}: header must name columns 'tokens' and 'seconds', got {cols}")
    ti, si = cols.index("tokens"), cols.index("seconds")
    rows = []
    for no, ln in lines[1:]:
        cells = [c.strip() for c in next(csv.reader(io.StringIO(ln)))]
        if len(cells) != len(cols):
            raise ProfileFormatError(f"{path}: line {no}: expected {len(cols)} columns, got {len(cells)}: {ln!r}")
        rows.append((*_row_values(cells[ti], cells[si], f"line {no}", path), f"line {no}"))
    tokens, seconds = _sorted_unique(rows, path)
    return SpeedProfile(tokens, seconds, key=key, source=f"user table {path}")


def _load_json_table(path: Path, key: ProfileKey | None) -> SpeedProfile:
    obj = read_json(path, kind="speed table", error=ProfileFormatError)  # syntax errors name line and column
    body = obj.get("rows") if isinstance(obj, dict) else obj
    if not isinstance(body, list):
        raise ProfileFormatError(f"{path}: expected a list of {{'tokens', 'seconds'}} rows or {{'rows': [...]}}")

    def parse(items: list, a: str, label: str) -> list[tuple[int, float, str]]:
        out = []
        for i, row in enumerate(items):
            where = f"{label} {i + 1} (entry [{i}])"
            if not isinstance(row, dict) or a not in row or "seconds" not in row:
                raise ProfileFormatError(f"{path}: {where}: expected an object with '{a}' and 'seconds', got {row!r}")
            out.append((*_row_values(row[a], row["seconds"], where, path), where))
        return out

    tokens, seconds = _sorted_unique(parse(body, "tokens", "row"), path)
    dreq: tuple[int, ...] = ()
    dsec: tuple[float, ...] = ()
    if isinstance(obj, dict) and obj.get("draft"):
        if not isinstance(obj["draft"], list):
            raise ProfileFormatError(f"{path}: 'draft' must be a list of {{'requests', 'seconds'}} rows")
        dreq, dsec = _sorted_unique(parse(obj["draft"], "requests", "draft row"), path)
    return SpeedProfile(tokens, seconds, dreq, dsec, key=key, source=f"user table {path}")
