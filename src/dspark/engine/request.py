"""The object that flows through the engine: one request, from waiting to finished."""
from __future__ import annotations

import enum
import itertools
import time
from dataclasses import dataclass, field

from ..decoding import SamplingParams, make_generator
from ..drafters.base import DraftRequest
from ..models.kv_cache import KVCache

_ids = itertools.count()


class Status(enum.Enum):
    WAITING = "waiting"  # admitted to the queue, no KV yet
    PREFILL = "prefill"  # holds KV, prompt partly processed
    DECODE = "decode"  # has an anchor token; drafts and verifies each step
    FINISHED = "finished"


@dataclass(eq=False)  # a request is an entity: `in` and `remove` on the queues compare identities, not prompts
class Request:
    prompt: list[int]
    params: SamplingParams
    stop_strings: tuple[str, ...] = ()
    request_id: str = field(default_factory=lambda: f"req-{next(_ids)}")
    status: Status = Status.WAITING
    output: list[int] = field(default_factory=list)  # emitted tokens (the last is the anchor while decoding)
    cache: KVCache | None = None
    prefilled: int = 0  # prompt tokens already in the cache
    cached_tokens: int = 0  # of those, copied from another request's cache (engine/prefix_cache.py)
    prefix_state: str = "new"  # "new" → "done" once its prefix is looked up, or "waiting" for a donor's prefill
    reserved: int = 0  # KV positions reserved against the engine budget
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    error: str | None = None
    text: str = ""  # decoded output, cut before a matched stop string
    text_tokens: int = 0  # output[:text_tokens] is what `text` decodes (detok.py)
    text_window: int = 0  # where the next step's decode window starts (<= text_tokens)
    logprobs: list = field(default_factory=list)  # TokenLogprob per output token, when params.logprobs is set
    prompt_logprobs: list = field(default_factory=list)  # TokenLogprob per prompt token after the first, if asked
    # statistics
    rounds: int = 0
    drafted: int = 0
    accepted: int = 0
    accepted_hist: list[int] = field(default_factory=list)
    verified_hist: list[int] = field(default_factory=list)  # drafts verified per round (ℓ)
    confidence_hist: list = field(default_factory=list)  # raw confidence logits [γ] per round, when recorded
    arrival: float = field(default_factory=time.perf_counter)
    first_token_at: float | None = None
    finished_at: float | None = None

    def __post_init__(self) -> None:
        self.generator = make_generator(self.params.seed)
        self.draft = DraftRequest(tokens=list(self.prompt), params=self.params, generator=self.generator)
        self.aborted = False

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED

    @property
    def num_tokens(self) -> int:
        return len(self.prompt) + len(self.output)

    @property
    def tau(self) -> float:
        return (self.accepted + self.rounds) / self.rounds if self.rounds else 0.0

    def needed_positions(self, gamma: int) -> int:
        """KV positions this request can ever occupy: prompt, all new tokens, and one verify block of slack."""
        return len(self.prompt) + self.params.max_new_tokens + gamma + 1

    def finish(self, reason: str, error: str | None = None, keep_cache: bool = False) -> None:
        """keep_cache: the engine keeps the KV as a prefix donor (and drops it when it evicts the request)."""
        if self.finished:
            return
        self.status, self.finish_reason, self.error = Status.FINISHED, reason, error
        self.finished_at = time.perf_counter()
        if not keep_cache:
            self.cache = None  # frees the KV memory at once

    def usage(self) -> dict:
        return {"prompt_tokens": len(self.prompt), "completion_tokens": len(self.output),
                "total_tokens": len(self.prompt) + len(self.output),
                "prompt_tokens_details": {"cached_tokens": self.cached_tokens}}

    def spec_stats(self) -> dict:
        return {"rounds": self.rounds, "drafted": self.drafted, "accepted": self.accepted,
                "mean_accepted_length": round(self.tau, 4)}


@dataclass
class RequestOutput:
    """What one engine step produced for one request."""

    request_id: str
    new_tokens: list[int]
    new_text: str
    finished: bool
    finish_reason: str | None
    request: Request
    new_logprobs: list | None = None  # TokenLogprob per new token, when the request asked for them
