"""Drafters shipped inside the package, found by the target they were trained for.

`shipped/<name>/` holds a trained drafter checkpoint (config.json + bf16 model.safetensors, + calibration.json).
A checkpoint records its target's fingerprint (shapes and an embedding signature), so the right one is found
from the loaded target itself, whatever name or path it was loaded by.

    dspark   the shipped DSpark drafter for this target (an error listing what is shipped when there is none)
    auto     the shipped drafter when there is one for this target and it pays where it will run, else n-gram
             prompt lookup. `shipped/defaults.json` records, per shipped drafter, when `auto` may pick it and the
             measurement behind that choice: `true` (always), `false` (never), or `"scheduled"` — only where a
             confidence-scheduled policy (async, sync) decides per step whether its drafts are worth verifying
             (the engine, the server, `dspark generate`), not where every draft is verified (`Generation`). The
             caller says which with ``scheduled=True``.
"""
from __future__ import annotations

import json
from pathlib import Path

from .base import DrafterError, register_drafter
from .dspark_checkpoint import check_target

SHIPPED_DIR = Path(__file__).parent / "shipped"
DEFAULTS = SHIPPED_DIR / "defaults.json"


def auto_allowed(path: Path, scheduled: bool = False) -> bool:
    """Whether `auto` may pick this shipped drafter (defaults.json; absent entry = yes), given whether a
    confidence-scheduled policy will drive it."""
    if not DEFAULTS.is_file():
        return True
    mode = json.loads(DEFAULTS.read_text()).get(path.name, {}).get("auto", True)
    if not (mode is True or mode is False or mode == "scheduled"):
        raise DrafterError(f"{DEFAULTS}: 'auto' of {path.name} must be true, false or \"scheduled\", got {mode!r}")
    return mode is True or (mode == "scheduled" and scheduled)


def shipped_dirs() -> list[Path]:
    if not SHIPPED_DIR.is_dir():
        return []
    return sorted(p for p in SHIPPED_DIR.iterdir() if (p / "config.json").is_file() and
                  (p / "model.safetensors").is_file())


def shipped_for(target) -> Path | None:
    """The shipped drafter directory whose recorded target matches `target` (shapes and weights), or None."""
    from .dspark import _transformer

    model = _transformer(target)
    for path in shipped_dirs():
        saved = json.loads((path / "config.json").read_text()).get("target", {})
        try:
            check_target(saved, model, str(path))
        except DrafterError:
            continue
        return path
    return None


@register_drafter("dspark")
def shipped_dspark(target=None, gamma: int | None = None, **options):
    from .dspark import load_dspark

    path = shipped_for(target)
    if path is None:
        names = [p.name for p in shipped_dirs()] or ["none"]
        raise DrafterError(f"no shipped DSpark drafter matches this target (shipped: {', '.join(names)}); train "
                           f"one with `dspark train` and pass its directory as the drafter")
    return load_dspark(path, target, gamma, **options)


@register_drafter("auto")
def auto_drafter(target=None, gamma: int | None = None, scheduled: bool = False, **options):
    from .dspark import load_dspark
    from .ngram import NGramDrafter

    path = shipped_for(target)
    if path is not None and auto_allowed(path, scheduled):
        return load_dspark(path, target, gamma, **options)
    return NGramDrafter(target=target, **({} if gamma is None else {"gamma": gamma}))
