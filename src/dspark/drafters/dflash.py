"""DFlash: the DSpark backbone with no sequential head and no confidence head (the paper's baseline).

A DFlash checkpoint is a DSpark checkpoint with drafter_type "dflash", head "none" and confidence off; the same
inference class runs it (its slots are then independent given the context, and `confidences` is None).
"""
from __future__ import annotations

from dataclasses import replace

from .base import DrafterError, register_drafter
from .dspark import DSparkDrafter, load_dspark
from .dspark_model import DrafterArch


def dflash_arch(arch: DrafterArch) -> DrafterArch:
    """The DFlash counterpart of a DSpark architecture: same backbone, heads removed."""
    return replace(arch, drafter_type="dflash", head="none", rank=0, confidence=False)


@register_drafter("checkpoint:dflash")
def _load_dflash_checkpoint(path, target=None, gamma: int | None = None, **options) -> DSparkDrafter:
    drafter = load_dspark(path, target, gamma, **options)
    arch = drafter.model.arch
    if arch.head != "none" or arch.confidence:
        raise DrafterError(f"{path}: drafter_type 'dflash' must have no sequential or confidence head "
                           f"(config.json declares head={arch.head!r}, confidence={arch.confidence})")
    return drafter
