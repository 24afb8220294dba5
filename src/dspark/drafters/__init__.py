"""Drafters behind one interface; `make_drafter` resolves a name or a checkpoint path."""
from . import dflash, dspark, eagle3, ngram, shipped  # noqa: F401  (register the names and the checkpoint loaders)
from .base import DraftRequest, Drafter, DrafterError, Proposal, drafter_names, make_drafter, register_drafter

__all__ = ["DraftRequest", "Drafter", "DrafterError", "Proposal", "drafter_names", "make_drafter",
           "register_drafter"]
