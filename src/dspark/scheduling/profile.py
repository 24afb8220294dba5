"""Hardware speed profile SPS(B): forward steps per second of the target against the tokens verified per step.

The prefix scheduler (policies.py) needs to know what one more verified token costs *on this machine at this
load*: on a GPU a verify step is nearly free up to some batch size and linear after it; on the CPUs this project
develops on it is ~flat to ~16 tokens (see DESIGN.md §3). We therefore measure a small table once, cache it on
disk keyed by everything that changes it (model, drafter, machine, dtype), and interpolate.

Conventions
  * B = tokens in the verify forward = R anchors + sum of verification lengths (so plain decoding is B = R).
  * ``seconds[i]`` is the wall time of one verify step over ``tokens[i]`` tokens.
  * The optional drafting cost is a second table: seconds of one drafting step for R running requests.
  * Between table points: piecewise-linear in *time* (time, not speed, is what grows linearly with work).
    Below the first point: flat (a step never gets cheaper than the smallest one measured).
    Above the last point: linear with the last segment's slope (clamped at >= 0), or flat if asked.
  * A step's cost depends on how many requests share it, not only on B: each request is its own attention
    segment, with per-op costs of its own (~1.7-2.6 ms per request per step for SmolLM2 on the dev CPU, as much as
    two extra tokens). The table is measured with ``tokens_per_segment`` tokens per request, so when a caller
    knows R: step(B, R) = table(B) + segment_seconds · (R − segments(B)), segments(B) = max(1, B // tps). Without
    it the scheduler at R = 1 overprices an 8-token block by ~20 % and at R = 16 overprices each verified token
    by ~50 % (the table's slope mixes the price of tokens with that of more requests).
  * Better still, a *grid* measures the steps the scheduler actually compares: R requests verifying k tokens
    each (k = 1 is plain decoding). With it step(B, R) interpolates the grid at (R, k = B / R) — linear in R,
    then in k, linear above both (slopes clamped at >= 0). The per-request model above priced R one-token requests
    18-21 % too high on the dev CPU at R = 4 and 16 (the native attention kernel makes a one-token request nearly
    free), i.e. it made plain decoding look dearer than it is and speculation cheaper.
  * Every table is measured with each request holding ``grid_context`` tokens of context. Attention over a longer
    one costs more, and more per verified token than per request: each verified token's query reads the whole
    context (dev CPU, SmolLM2, from 256 to 2,048 tokens of context: one request's 8-token step 18.7 → 35.5 ms, a
    1-token step 11.6 → 14.6 ms, four requests' 8-token step 41.4 → 109.8 ms; scripts/context_cost.py,
    results/context-s26). So the grid is corrected linearly: step(B, R, L) = step(B, R) + (L − grid_context) ·
    (context_request_s · R + context_token_s · B), L the running requests' mean context; measured at 1,024 tokens,
    it prices those steps at 1.01–1.13 of their time from 64 to 2,048 tokens, where the grid alone was off by
    0.85–2.72×. ``at_context(L)`` is the profile priced at L; without the two coefficients (older profiles, user
    tables) context is ignored. A prompt chunk's own context is priced apart (``prefill_context_s`` per chunk token
    per token before it): prefill attention runs as large products, ~0.46 µs per pair on the dev CPU against the
    decode steps' ~1.0–1.1 µs per verified token (a 512-token chunk after 1,536 tokens of its prompt: 758 ms
    against 387 ms from the start, priced 746 with it and 386 without).
"""

from __future__ import annotations

import copy
import platform
from dataclasses import dataclass, field, fields
from typing import Sequence

import numpy as np


@dataclass(frozen=True)
class ProfileKey:
    """Everything that makes a cached profile invalid when it changes."""

    model_id: str
    drafter_id: str
    machine: str
    dtype: str
    kernels: str = "torch"  # native kernels used: "native" (projections), "attention"; files without it: torch

    def as_dict(self) -> dict[str, str]:
        return {"model_id": self.model_id, "drafter_id": self.drafter_id, "machine": self.machine, "dtype": self.dtype,
                "kernels": self.kernels}


def cpu_name() -> str:
    """The CPU model ("unknown-cpu" if it cannot be read)."""
    cpu = platform.processor() or ""
    try:  # /proc/cpuinfo names the CPU on Linux, where platform.processor() often says only "x86_64".
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return cpu or "unknown-cpu"


def current_machine() -> str:
    """platform + CPU model + torch threads (+ GPU name): the things that change step times by large factors."""
    parts = [platform.platform(), cpu_name()]
    try:
        import torch  # lazy: keeps this module importable (and fast to import) without torch.

        parts.append(f"torch-threads={torch.get_num_threads()}")
        if torch.cuda.is_available():
            parts.append(f"cuda={torch.cuda.get_device_name(0)}")
    except ImportError:
        parts.append("torch-threads=?")
    return " | ".join(parts)


def _check_table(xs: Sequence[float], ys: Sequence[float], what: str) -> None:
    if len(xs) != len(ys) or len(xs) == 0:
        raise ValueError(f"{what}: need the same non-zero number of sizes and seconds, got {len(xs)} and {len(ys)}")
    if any(int(x) != x or x < 1 for x in xs):
        raise ValueError(f"{what}: sizes must be integers >= 1, got {list(xs)}")
    if any(b <= a for a, b in zip(xs, xs[1:])):
        raise ValueError(f"{what}: sizes must be strictly increasing, got {list(xs)}")
    if any(not (np.isfinite(y) and y > 0) for y in ys):
        raise ValueError(f"{what}: seconds must be finite and > 0, got {list(ys)}")


def _interp(x, xs: np.ndarray, ys: np.ndarray, linear_above: bool):
    """np.interp (flat outside) plus optional linear extrapolation above the last point; scalar in -> float out."""
    xa = np.asarray(x, dtype=np.float64)
    y = np.interp(xa, xs, ys)
    if linear_above and len(xs) >= 2:
        # Clamp the slope: a noisy table whose last segment dips must not extrapolate to negative times.
        slope = max(0.0, (ys[-1] - ys[-2]) / (xs[-1] - xs[-2]))
        y = np.where(xa > xs[-1], ys[-1] + slope * (xa - xs[-1]), y)
    return float(y) if y.ndim == 0 else y


@dataclass(frozen=True)
class SpeedProfile:
    tokens: tuple[int, ...]  # [P] verified-token counts B, strictly increasing
    seconds: tuple[float, ...]  # [P] seconds per verify step at tokens[i]
    draft_requests: tuple[int, ...] = ()  # [D] running-request counts R (empty: drafting cost ignored)
    draft_seconds: tuple[float, ...] = ()  # [D] seconds per drafting step at draft_requests[i]
    extrapolate: str = "linear"  # above the last point: "linear" or "flat"
    key: ProfileKey | None = None
    source: str = ""  # free text: "measured", "user table <path>", "synthetic ..."
    segment_seconds: float = 0.0  # extra seconds per request at a fixed B (0: requests cost nothing extra)
    tokens_per_segment: int = 0  # how the table split B into requests when measured (0: no request model)
    # Drafting only as deep as the verification can use: seconds per drafting step at depth 1 for each
    # draft_requests[i], the full table being measured at depth ``draft_depth`` (γ); empty: depth not priced.
    shallow_draft_seconds: tuple[float, ...] = ()
    draft_depth: int = 0
    # depth_draft_seconds[i][j]: drafting depth i + 2 for draft_requests[j] (the depths between 1 and draft_depth;
    # empty: cost linear in depth between the two tables)
    depth_draft_seconds: tuple[tuple[float, ...], ...] = ()
    # Measured grid: grid_seconds[i][j] = one step of grid_requests[i] requests verifying grid_tokens[j] tokens each.
    grid_requests: tuple[int, ...] = ()  # [Gr]
    grid_tokens: tuple[int, ...] = ()  # [Gk]
    grid_seconds: tuple[tuple[float, ...], ...] = ()  # [Gr][Gk]
    # Measured prompt cost: prefill_seconds[i][j] = one step carrying a fresh prefill_tokens[j]-token prompt chunk
    # beside prefill_requests[i] requests decoding one token each (0: the prompt alone).
    prefill_requests: tuple[int, ...] = ()  # [Pr]
    prefill_tokens: tuple[int, ...] = ()  # [Pp]
    prefill_seconds: tuple[tuple[float, ...], ...] = ()  # [Pr][Pp]
    # Context: the tables were measured at grid_context tokens per request; each context token more costs
    # context_request_s per request and context_token_s per verified token (0, 0: context not priced).
    grid_context: int = 0
    context_request_s: float = 0.0
    context_token_s: float = 0.0
    context: float = 0.0  # the mean context this profile prices at (0: grid_context); see at_context
    # A prompt chunk that starts after ``start`` tokens already prefilled attends to them too: seconds per chunk token
    # per token before it (0: not priced; the prefill table measured chunks that start at 0).
    prefill_context_s: float = 0.0
    _views: dict = field(init=False, repr=False, compare=False)  # context -> this profile priced there (shared)
    # Cached numpy views, so sps() on a hot path does not rebuild arrays each call.
    _t: np.ndarray = field(init=False, repr=False, compare=False)
    _s: np.ndarray = field(init=False, repr=False, compare=False)
    _grid: tuple = field(init=False, repr=False, compare=False)  # (requests [Gr], tokens [Gk], seconds [Gr, Gk])
    _by_depth: np.ndarray | None = field(init=False, repr=False, compare=False)  # see _check_depth_table
    _hash: int | None = field(init=False, repr=False, compare=False, default=None)  # see __hash__

    def __hash__(self) -> int:
        """The compared fields' hash, computed once: the schedulers' price caches key on the profile and look it up
        right after the model's forwards, where hashing every table again cost ~25 µs a lookup (scripts/
        policy_step_cost.py). Frozen, so it never goes stale; ``at_context``'s views get their own."""
        if self._hash is None:
            object.__setattr__(self, "_hash", hash(tuple(getattr(self, f.name) for f in fields(self) if f.compare)))
        return self._hash

    def __post_init__(self) -> None:
        object.__setattr__(self, "tokens", tuple(int(t) for t in self.tokens))
        object.__setattr__(self, "seconds", tuple(float(s) for s in self.seconds))
        object.__setattr__(self, "draft_requests", tuple(int(t) for t in self.draft_requests))
        object.__setattr__(self, "draft_seconds", tuple(float(s) for s in self.draft_seconds))
        object.__setattr__(self, "shallow_draft_seconds", tuple(float(s) for s in self.shallow_draft_seconds))
        if self.shallow_draft_seconds:
            _check_table(self.draft_requests, self.shallow_draft_seconds, "depth-1 drafting cost table")
            if len(self.shallow_draft_seconds) != len(self.draft_seconds) or self.draft_depth < 2:
                raise ValueError("shallow_draft_seconds needs one value per draft_requests entry and a "
                                 f"draft_depth >= 2 (the full table's depth), got draft_depth {self.draft_depth}")
        self._check_depth_table()
        _check_table(self.tokens, self.seconds, "speed profile")
        if self.draft_requests or self.draft_seconds:
            _check_table(self.draft_requests, self.draft_seconds, "drafting cost table")
        if self.extrapolate not in ("linear", "flat"):
            raise ValueError(f"extrapolate must be 'linear' or 'flat', got {self.extrapolate!r}")
        if not (np.isfinite(self.segment_seconds) and self.segment_seconds >= 0) or self.tokens_per_segment < 0:
            raise ValueError(f"segment_seconds must be finite and >= 0 and tokens_per_segment >= 0, got "
                             f"{self.segment_seconds!r}, {self.tokens_per_segment!r}")
        self._check_grid()
        self._check_prefill()
        if self.grid_context < 0 or self.context < 0 or not all(np.isfinite(x) and x >= 0 for x in (
                self.context_request_s, self.context_token_s, self.prefill_context_s)):
            raise ValueError(f"grid_context, context and the context coefficients must be finite and >= 0, got "
                             f"{self.grid_context!r}, {self.context!r}, {self.context_request_s!r}, "
                             f"{self.context_token_s!r}")
        object.__setattr__(self, "_views", {})
        object.__setattr__(self, "_t", np.asarray(self.tokens, dtype=np.float64))
        object.__setattr__(self, "_s", np.asarray(self.seconds, dtype=np.float64))

    def _check_depth_table(self) -> None:
        rows = tuple(tuple(float(x) for x in row) for row in self.depth_draft_seconds)
        object.__setattr__(self, "depth_draft_seconds", rows)
        if rows and (not self.shallow_draft_seconds or len(rows) != self.draft_depth - 2):
            raise ValueError(f"depth_draft_seconds needs the depth-1 table and one row per depth 2 .. "
                             f"{self.draft_depth - 1}, got {len(rows)} rows")
        for depth, row in enumerate(rows, start=2):
            if len(row) != len(self.draft_requests):
                raise ValueError(f"depth_draft_seconds row of depth {depth} needs {len(self.draft_requests)} values")
            _check_table(self.draft_requests, row, f"depth-{depth} drafting cost table")
        # [draft_depth, D]: seconds at depth 1 .. draft_depth (what draft_s interpolates)
        object.__setattr__(self, "_by_depth", np.asarray(
            (self.shallow_draft_seconds, *rows, self.draft_seconds), dtype=np.float64) if rows else None)

    def _check_grid(self) -> None:
        grid = tuple(tuple(float(x) for x in row) for row in self.grid_seconds)
        object.__setattr__(self, "grid_seconds", grid)
        object.__setattr__(self, "grid_requests", tuple(int(r) for r in self.grid_requests))
        object.__setattr__(self, "grid_tokens", tuple(int(k) for k in self.grid_tokens))
        object.__setattr__(self, "_grid", tuple(np.asarray(x, dtype=np.float64)
                                                for x in (self.grid_requests, self.grid_tokens, grid)))
        if not (self.grid_requests or self.grid_tokens or grid):
            return
        _check_table(self.grid_requests, [1.0] * len(self.grid_requests), "grid requests")
        _check_table(self.grid_tokens, [1.0] * len(self.grid_tokens), "grid tokens per request")
        if len(grid) != len(self.grid_requests) or any(len(row) != len(self.grid_tokens) for row in grid):
            raise ValueError(f"grid_seconds must be {len(self.grid_requests)} rows of {len(self.grid_tokens)} values")
        for row in grid:
            _check_table(self.grid_tokens, row, "grid seconds")

    def _check_prefill(self) -> None:
        table = tuple(tuple(float(x) for x in row) for row in self.prefill_seconds)
        object.__setattr__(self, "prefill_seconds", table)
        object.__setattr__(self, "prefill_requests", tuple(int(r) for r in self.prefill_requests))
        object.__setattr__(self, "prefill_tokens", tuple(int(p) for p in self.prefill_tokens))
        if not (self.prefill_requests or self.prefill_tokens or table):
            return
        _check_table([r + 1 for r in self.prefill_requests], [1.0] * len(self.prefill_requests),
                     "prefill requests (>= 0)")
        _check_table(self.prefill_tokens, [1.0] * len(self.prefill_tokens), "prefill prompt tokens")
        if len(table) != len(self.prefill_requests) or any(len(row) != len(self.prefill_tokens) for row in table):
            raise ValueError(f"prefill_seconds must be {len(self.prefill_requests)} rows of "
                             f"{len(self.prefill_tokens)} values")
        for row in table:
            _check_table(self.prefill_tokens, row, "prefill seconds")

    def prefill_extra_s(self, prompt: int, n_requests: int) -> float:
        """Seconds a ``prompt``-token chunk adds to a step of ``n_requests`` decoding requests (0: the chunk alone),
        from the prefill table: linear in the prompt (time grows with the work), linear in the load between the
        loads measured and flat beyond them."""
        ps = np.asarray(self.prefill_tokens, dtype=np.float64)
        extras = []
        for r, row in zip(self.prefill_requests, self.prefill_seconds):
            base = float(self._table_step_s(r, n_requests=r)) if r else 0.0
            extras.append(_interp(prompt, ps, np.asarray(row) - base, self.extrapolate == "linear"))
        return float(max(0.0, np.interp(n_requests, self.prefill_requests, extras)))

    def _grid_step_s(self, n_tokens, n_requests):
        rs, ks, s = self._grid  # [Gr], [Gk], [Gr, Gk]
        r = np.maximum(np.asarray(n_requests, dtype=np.float64), 1.0)
        r, k = np.broadcast_arrays(r, np.maximum(np.asarray(n_tokens, dtype=np.float64) / r, 1.0))
        by_k = np.stack([np.asarray(_interp(r, rs, s[:, j], True)) for j in range(ks.size)], axis=-1)  # [..., Gk]
        if ks.size == 1:
            t = by_k[..., 0]
        else:
            hi = np.clip(np.searchsorted(ks, k, side="right"), 1, ks.size - 1)  # upper bracket of k
            y0 = np.take_along_axis(by_k, (hi - 1)[..., None], -1)[..., 0]
            y1 = np.take_along_axis(by_k, hi[..., None], -1)[..., 0]
            w = (k - ks[hi - 1]) / (ks[hi] - ks[hi - 1])
            t = np.where(w > 1, y1 + (w - 1) * np.maximum(y1 - y0, 0.0), y0 + w * (y1 - y0))
        t = np.maximum(t, s.min())  # never cheaper than the cheapest step measured
        return float(t) if np.ndim(t) == 0 else t

    @property
    def prices_context(self) -> bool:
        return self.grid_context > 0 and (self.context_request_s > 0 or self.context_token_s > 0)

    def at_context(self, context: float) -> "SpeedProfile":
        """This profile pricing every step at a mean context of ``context`` tokens per request (itself when it
        does not price context). A shallow copy made once per context and kept (the schedulers' price caches key on
        the object): the tables are shared, nothing is validated again."""
        if not self.prices_context or context == self.context:
            return self
        view = self._views.get(context)
        if view is None:
            if len(self._views) >= 256:  # the simulator asks at every exact mean context
                self._views.clear()
            view = self._views[context] = copy.copy(self)  # its _views is this dict: views of views are views
            object.__setattr__(view, "context", float(context))
            object.__setattr__(view, "_hash", None)  # its context is compared, so hashed: not the copied hash
        return view

    def _context_extra_s(self, n_tokens, n_requests):
        """Seconds the mean context adds to a step over the grid's (negative below grid_context)."""
        longer = self.context - self.grid_context
        if n_requests is None:  # as many requests as the table was measured with (one without a request model)
            tps = self.tokens_per_segment
            n_requests = np.maximum(1, np.asarray(n_tokens) // tps) if tps else 1
        r = np.asarray(n_requests, dtype=np.float64)
        return longer * (self.context_request_s * r + self.context_token_s * np.asarray(n_tokens, dtype=np.float64))

    def step_s(self, n_tokens, n_requests=None, prefill: Sequence = ()):
        """Seconds of one verify step (see ``_table_step_s``) at this profile's mean context. A ``prefill`` chunk is
        P tokens, or (P, start) for one that starts after ``start`` tokens of its prompt already prefilled."""
        t = self._table_step_s(n_tokens, n_requests, prefill)
        if not self.context or not self.prices_context:
            return t
        if n_requests is not None and not n_requests:  # prompt chunks alone: their own table prices them
            return t
        # Only the decoding part's context is priced: a prompt chunk's own context is part of its table's price.
        # Below grid_context a step gets cheaper, but never below half its table price.
        t = np.maximum(t + self._context_extra_s(n_tokens, n_requests), 0.5 * np.asarray(t))
        return float(t) if np.ndim(t) == 0 else t

    def _table_step_s(self, n_tokens, n_requests=None, prefill: Sequence = ()):
        """Seconds of one verify step over B tokens (scalar or array [n]), shared by ``n_requests`` requests when
        given (else by as many as the table was measured with); from the grid when there is one. ``prefill``: the
        prompt chunks of new requests riding in the same step (scalar B and R only), priced by the prefill table
        when there is one, else as one more request of that many tokens each (on the dev CPU that priced a
        128-token prompt beside 8 decoding requests 1.38x its cost: scripts/prefill_cost.py)."""
        if len(prefill):
            chunks = [(int(c), 0) if np.ndim(c) == 0 else (int(c[0]), int(c[1])) for c in prefill]
            later = sum(self.prefill_context_s * p * start for p, start in chunks)  # attention to earlier chunks
            if not self.prefill_seconds:
                return later + self._table_step_s(n_tokens + sum(p for p, _ in chunks),
                                                  n_requests=(n_requests or 0) + len(chunks))
            decoding = int(n_requests if n_requests is not None else 0)
            base = float(self._table_step_s(n_tokens, n_requests)) if decoding else 0.0
            return base + later + sum(self.prefill_extra_s(p, decoding) for p, _ in chunks)
        if n_requests is not None and self.grid_seconds:
            return self._grid_step_s(n_tokens, n_requests)
        t = _interp(n_tokens, self._t, self._s, self.extrapolate == "linear")
        if n_requests is None or not self.segment_seconds or not self.tokens_per_segment:
            return t
        measured_with = np.maximum(1, np.asarray(n_tokens) // self.tokens_per_segment)
        # Never cheaper than the smallest step measured: a wildly small R must not price a step at ~0 s.
        t = np.maximum(t + self.segment_seconds * (np.asarray(n_requests) - measured_with), self._s[0])
        return float(t) if np.ndim(t) == 0 else t

    def draft_s(self, n_requests, depth=None):
        """Seconds of one drafting step for R requests (0 when no drafting table was given), drafting ``depth``
        slots (scalar or array; None: the full block). From the table of each depth when the profile has them
        (``depth_draft_seconds``), else linear in depth between the depth-1 and the full-depth tables."""
        if not self.draft_requests:
            shape = np.broadcast(np.asarray(n_requests), np.asarray(depth if depth is not None else 0)).shape
            return 0.0 if not shape else np.zeros(shape)
        xs = np.asarray(self.draft_requests, dtype=np.float64)
        linear = self.extrapolate == "linear"
        if depth is not None and self._by_depth is not None:
            return self._depth_table_s(n_requests, depth, xs, linear)
        full = _interp(n_requests, xs, np.asarray(self.draft_seconds, dtype=np.float64), linear)
        if depth is None or not self.shallow_draft_seconds:
            return full
        one = _interp(n_requests, xs, np.asarray(self.shallow_draft_seconds, dtype=np.float64),
                      self.extrapolate == "linear")
        frac = np.clip((np.asarray(depth, dtype=np.float64) - 1) / (self.draft_depth - 1), 0.0, 1.0)
        t = one + (full - one) * frac
        return float(t) if np.ndim(t) == 0 else t

    def _depth_table_s(self, n_requests, depth, xs: np.ndarray, linear: bool):
        """``draft_s`` from the table of every depth: each depth's row at R, then linear between whole depths."""
        r, d = np.broadcast_arrays(np.asarray(n_requests, dtype=np.float64), np.asarray(depth, dtype=np.float64))
        at_r = np.stack([np.asarray(_interp(r.ravel(), xs, row, linear)) for row in self._by_depth])  # [depths, n]
        d = np.clip(d.ravel(), 1.0, float(self.draft_depth)) - 1.0
        lo = np.floor(d).astype(np.int64)
        hi = np.minimum(lo + 1, self.draft_depth - 1)
        cols = np.arange(d.size)
        t = (at_r[lo, cols] * (1.0 - (d - lo)) + at_r[hi, cols] * (d - lo)).reshape(r.shape)
        return float(t) if t.ndim == 0 else t

    def sps(self, n_tokens, n_requests: int | None = None, depth=None):
        """Steps per second at B tokens; with ``n_requests`` the drafting cost of that many requests (drafting
        ``depth`` slots, default the full block) is added."""
        t = self.step_s(n_tokens, n_requests)
        if n_requests is not None:
            t = t + self.draft_s(n_requests, depth)
        return 1.0 / t

    __call__ = sps  # a SpeedProfile can be passed wherever an SPS callable is expected
