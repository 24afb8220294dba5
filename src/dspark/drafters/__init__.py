"""Drafters behind one interface; `make_drafter` resolves a name or a checkpoint path."""
from . import ngram  # noqa: F401  (registers "ngram")
from .base import DraftRequest, Drafter, DrafterError, Proposal, drafter_names, make_drafter, register_drafter

__all__ = ["DraftRequest", "Drafter", "DrafterError", "Proposal", "drafter_names", "make_drafter",
           "register_drafter"]
