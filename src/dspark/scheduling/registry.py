"""The policy name registry the engine, CLI and simulator use: ``make_policy(name, ...)``.

The policy objects themselves live in ``policy_objects.py`` (stateless ones) and ``async_policy.py``; they are
re-exported here.
"""

from __future__ import annotations

import inspect
import re
import warnings
from typing import Callable

from .async_policy import AsyncPolicy
from .policy_objects import (
    CONFIDENCE_FREE,
    ConfidenceRequiredError,
    FixedPolicy,
    SyncPolicy,
    ThresholdPolicy,
)

__all__ = ["AsyncPolicy", "CONFIDENCE_FREE", "ConfidenceRequiredError", "FixedPolicy", "POLICIES", "SyncPolicy",
           "ThresholdPolicy", "check_spec", "make_policy"]


def _fixed(k: int = 0) -> FixedPolicy:
    return FixedPolicy(int(k))


POLICIES: dict[str, tuple[Callable[..., object], bool, str]] = {
    # name: (factory, needs confidences, one-line description)
    "none": (lambda: FixedPolicy(0), False, "no speculation (plain decoding)"),
    "mtp1": (lambda: FixedPolicy(1), False, "verify 1 draft per request ('MTP-1')"),
    "fixed": (_fixed, False, "verify k drafts per request (also spelled fixed-<k>)"),
    "sync": (SyncPolicy, True, "Algorithm 1: hardware-aware greedy prefix scheduler with early stop"),
    "async": (AsyncPolicy, True, "asynchronous scheduler: capacity from 2 steps earlier, top-K now"),
    "async-online": (lambda **kw: AsyncPolicy(online_calibration=True, **kw), True,
                     "async with confidences corrected online by the acceptance seen so far"),
    "threshold": (ThresholdPolicy, True, "static per-slot confidence threshold"),
}


def make_policy(name: str, *, confidence_available: bool = True, **kwargs):
    """Build a policy by name. ``sync``/``async`` need ``sps=``; ``fixed`` takes ``k=``; ``threshold`` takes
    ``threshold=``. ``confidence_available=False`` (drafter without a confidence head) rejects policies that need
    confidences up front instead of at the first step. Options may follow the name, ``async:min_gain=0.01:
    probe_every=16`` (numbers; unknown names are refused), so a variant can be served or benchmarked by name."""
    name, options = _resolve(name)
    kwargs = {**kwargs, **options}
    factory, needs, _ = POLICIES[name]
    if needs and not confidence_available:
        raise ConfidenceRequiredError(
            f"policy {name!r} needs a drafter with a confidence head; "
            f"policies that work without confidences: {', '.join(CONFIDENCE_FREE)}"
        )
    if kwargs.get("unsafe"):
        warnings.warn("sync scheduler without early stop is NOT lossless (biased output); tests only", stacklevel=2)
    try:
        return factory(**kwargs)
    except TypeError as e:
        raise TypeError(f"bad arguments for policy {name!r}: {e}") from e


def check_spec(spec: str) -> None:
    """Refuse an unknown policy name or option before anything is loaded (``make_policy`` refuses them too, but
    only once the model, drafter and speed profile it needs exist). ``auto`` is accepted: the caller resolves it."""
    if spec == "auto":
        return
    name, options = _resolve(spec)
    target = AsyncPolicy if name == "async-online" else POLICIES[name][0]  # its factory forwards to AsyncPolicy
    parameters = inspect.signature(target).parameters
    if any(p.kind is p.VAR_KEYWORD for p in parameters.values()):
        return
    unknown = sorted(set(options) - set(parameters))
    if unknown:
        raise ValueError(f"unknown option(s) {', '.join(unknown)} for policy {name!r}; it takes: "
                         f"{', '.join(parameters) or 'no options'}")


def _resolve(spec: str) -> tuple[str, dict[str, float | int]]:
    """(registered name, options) of a spec: "fixed-3:x=1" -> ("fixed", {"x": 1, "k": 3}); unknown names refused."""
    name, options = _split_options(spec)
    m = re.fullmatch(r"fixed-(\d+)", name)
    if m:
        name, options = "fixed", {**options, "k": int(m.group(1))}
    if name not in POLICIES:
        raise ValueError(f"unknown policy {name!r}; valid policies: {', '.join(POLICIES)} (and fixed-<k>)")
    return name, options


def base_name(spec: str) -> str:
    """The policy a spec names, without its options ("async:min_gain=0.01" -> "async")."""
    return spec.split(":", 1)[0]


def _split_options(spec: str) -> tuple[str, dict[str, float | int]]:
    """"async:min_gain=0.01:probe_every=16" -> ("async", {"min_gain": 0.01, "probe_every": 16})."""
    name, *parts = spec.split(":")
    options: dict[str, float | int] = {}
    for part in parts:
        key, sep, value = part.partition("=")
        try:
            if not (sep and key.isidentifier()):
                raise ValueError
            options[key] = int(value) if re.fullmatch(r"[+-]?\d+", value) else float(value)
        except ValueError:
            raise ValueError(f"bad policy option {part!r} in {spec!r}: expected name=number, e.g. "
                             "async:min_gain=0.01") from None
    return name, options
