"""The drafter interface and its registry.

A drafter sees each request's token history (and, for model drafters, the target hidden states it asked
for) and proposes up to γ tokens per request. It must return the exact fp32 distribution each token was
drawn from (invariant 1), or None when it proposes deterministically (a point mass, as n-gram lookup does).
"""
from __future__ import annotations

import inspect
import json
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

from ..decoding.sampling import SamplingParams
from ..decoding.verify import DraftVocab


class DrafterError(ValueError):
    pass


@dataclass
class DraftRequest:
    """What a drafter may look at for one request. `state` is the drafter's own per-request memory."""

    tokens: list[int]  # prompt + emitted tokens; the last one is the anchor (not yet in the target cache)
    params: SamplingParams
    generator: torch.Generator
    state: dict = field(default_factory=dict)


@dataclass
class Proposal:
    tokens: torch.Tensor  # [R, γ] long (padding beyond num_tokens is arbitrary)
    num_tokens: torch.Tensor  # [R] how many leading tokens are real drafts
    probs: torch.Tensor | None = None  # [R, γ, V] fp32 sampling distributions; None = point masses
    confidences: torch.Tensor | None = None  # [R, γ] P(slot k accepted | slots < k accepted), if known
    vocab: DraftVocab | None = None  # set: probs is [R, γ, Vd] over this draft vocabulary (verify reads it so)

    def full_probs(self) -> torch.Tensor | None:
        """probs over the target's whole vocabulary [R, γ, V] (zeros outside a draft vocabulary)."""
        return self.probs if self.vocab is None or self.probs is None else self.vocab.full(self.probs)


class Drafter(ABC):
    name: str = "?"
    needs_layers: tuple[int, ...] = ()  # target layers whose hidden states the drafter consumes
    has_confidence: bool = False
    shares_context: bool = False  # a model drafter that implements observed() and share_context()

    def __init__(self, gamma: int):
        if gamma < 1:
            raise DrafterError(f"block size gamma must be >= 1, got {gamma}")
        self.gamma = gamma

    @property
    def profile_id(self) -> str:
        """What distinguishes this drafter's cost in a cached speed profile (name and block size by default)."""
        return f"{self.name}-g{self.gamma}"

    @abstractmethod
    def propose(self, requests: list[DraftRequest], depth: int | None = None) -> Proposal:
        """Draft up to γ tokens for every request — up to `depth` when given (a policy that never verifies
        more than `depth` drafts, e.g. MTP-1, need not pay for drafting the rest)."""

    def slots(self, depth: int | None) -> int:
        """How many slots a proposal drafts: γ, or `depth` clipped to 1..γ."""
        return self.gamma if depth is None else max(1, min(int(depth), self.gamma))

    def observe(self, request: DraftRequest, hidden: dict[int, torch.Tensor], n_committed: int,
                start: int | None = None) -> None:
        """Rows 0..n_committed-1 of hidden[layer] ([n, d]) are the target states of the tokens just committed
        to the target cache, in position order (prompt chunks, then each round's anchor + accepted drafts).
        Model-free drafters ignore them."""

    def require_layers(self, hidden: dict) -> None:
        """observe() needs the states of every layer this drafter reads: say which are missing and how to ask."""
        missing = [i for i in self.needs_layers if i not in hidden]
        if missing:
            raise DrafterError(f"observe() got no hidden states for target layers {missing}; run the target "
                               f"forward with hidden_layers={self.needs_layers}")

    def observe_batch(self, requests: list[DraftRequest], hidden: dict[int, torch.Tensor], offsets: list[int],
                      counts: list[int]) -> None:
        """Flattened-batch form: request r owns rows offsets[r] .. offsets[r] + counts[r] - 1."""
        for req, first, n in zip(requests, offsets, counts):
            self.observe(req, {layer: h[first: first + n] for layer, h in hidden.items()}, n)

    @property
    def can_share_prefixes(self) -> bool:
        """Can a request start from another's prompt prefix? A model-free drafter needs no target states; a model
        drafter must be able to hand over the context it built from them."""
        return not self.needs_layers or self.shares_context

    def observed(self, request: DraftRequest) -> int:
        """Leading positions whose target states this drafter has taken in for the request (model drafters)."""
        return 0

    def share_context(self, source: DraftRequest, request: DraftRequest, length: int) -> None:
        """Give `request`, which has observed nothing yet, `source`'s context for its first `length` positions
        (length <= observed(source); the two requests' tokens agree there). Model-free drafters keep none."""
        if length and self.needs_layers:
            raise DrafterError(f"drafter {self.name!r} cannot share a request's context")

    def release(self, request: DraftRequest) -> None:
        """Free per-request resources (the default drafter keeps none)."""
        request.state.clear()


_REGISTRY: dict[str, Callable[..., Drafter]] = {}


class BatchFirstDrafter(Drafter):
    """A drafter whose work is batched (model drafters): single-request observe is the batch call with one row
    range, so there is one code path to keep exact."""

    def observe(self, request: DraftRequest, hidden: dict[int, torch.Tensor], n_committed: int,
                start: int | None = None) -> None:
        self.observe_batch([request], hidden, [0], [n_committed], None if start is None else [start])

    @abstractmethod
    def observe_batch(self, requests: list[DraftRequest], hidden: dict[int, torch.Tensor], offsets: list[int],
                      counts: list[int], starts: list[int] | None = None) -> None:
        """As Drafter.observe_batch; `starts` rolls each request's context back to that position first."""


def register_drafter(name: str):
    def wrap(factory):
        _REGISTRY[name] = factory
        return factory
    return wrap


def drafter_names() -> list[str]:
    return ["none", *sorted(n for n in _REGISTRY if ":" not in n)]


PRECISIONS = {"auto": None, "bf16": True, "fp32": False}  # a DSpark/DFlash drafter's `bf16` option


def split_precision(spec: str) -> tuple[str, dict]:
    """``dspark@fp32`` -> ("dspark", {"bf16": False}): a model drafter's product precision, set from the spec so
    that one command can compare both (`--drafters dspark@fp32,dspark@bf16`). No suffix: the drafter's default."""
    name, at, suffix = spec.rpartition("@")
    if not at or suffix not in PRECISIONS:
        return spec, {}
    return name, {"bf16": PRECISIONS[suffix]}


def unknown_options(spec: str, options) -> list[str]:
    """Which of ``options`` (names) the drafter ``spec`` does not take: a registered drafter's factory says by its
    signature; a checkpoint's loader, or a factory that hands its options on, checks them itself (none here)."""
    factory = _REGISTRY.get(split_precision(spec)[0]) if spec else None
    if factory is None:
        return []
    params = inspect.signature(factory).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return []
    return sorted(set(options) - set(params))


def make_drafter(spec: str, target=None, gamma: int | None = None, **options) -> Drafter | None:
    """`none`, a registered name, or a directory holding a trained drafter (config.json names its type); either
    may end in ``@fp32``, ``@bf16`` or ``@auto`` for a DSpark/DFlash drafter's product precision."""
    if spec in (None, "none", ""):
        return None
    spec, precision = split_precision(spec)
    if precision:
        if "bf16" in options:
            raise DrafterError(f"the drafter's precision is given twice: {spec!r} with bf16={options['bf16']}")
        if spec in _REGISTRY and spec not in ("dspark", "auto"):
            raise DrafterError(f"a precision suffix (@fp32/@bf16/@auto) applies to DSpark/DFlash drafters, "
                               f"not {spec!r}")
        options = {**options, **precision}
    if spec in _REGISTRY:
        kwargs = dict(options) if gamma is None else {**options, "gamma": gamma}
        unknown = unknown_options(spec, kwargs)
        if unknown:  # bad input, not a TypeError from deep inside the drafter's constructor
            takes = [n for n in inspect.signature(_REGISTRY[spec]).parameters if n != "target"]
            raise DrafterError(f"the {spec!r} drafter takes no option {', '.join(map(repr, unknown))}; it takes "
                               f"{', '.join(takes) or 'none'}")
        return _REGISTRY[spec](target=target, **kwargs)
    path = Path(spec).expanduser()
    if not path.exists():
        raise DrafterError(f"unknown drafter {spec!r}: valid names are {', '.join(drafter_names())}, "
                           f"or the path of a trained drafter directory")
    config_file = path / "config.json" if path.is_dir() else path
    try:
        config = json.loads(config_file.read_text())
        # A Hugging Face config (architectures, no drafter_type) is DeepSpec's layout; its loader checks the rest.
        hf_layout = isinstance(config, dict) and "drafter_type" not in config and "architectures" in config
        kind = "deepspec" if hf_layout else config["drafter_type"]
    except (OSError, json.JSONDecodeError, KeyError, TypeError) as exc:
        raise DrafterError(f"{path} is not a drafter checkpoint: expected config.json with a 'drafter_type' "
                           f"field (ours) or DeepSpec's Hugging Face layout ('architectures': "
                           f"['Qwen3DSparkModel'], ...) ({type(exc).__name__}: {exc})") from None
    if kind == "deepspec":
        from . import deepspec_layout  # noqa: F401  (registers checkpoint:deepspec; imported late: it needs dspark)
    loader = _REGISTRY.get(f"checkpoint:{kind}")
    if loader is None:
        known = [k.split(":", 1)[1] for k in _REGISTRY if k.startswith("checkpoint:")]
        raise DrafterError(f"{path}: drafter type {kind!r} has no loader; known types: {known or 'none yet'}")
    return loader(path=path, target=target, gamma=gamma, **options)
