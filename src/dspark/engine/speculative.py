"""The single-request speculative loop: prefill → draft → verify → accept → commit, streamed.

Plain decoding is the same loop with no drafter (ℓ = 0 every round), so "speculative equals plain" compares
two uses of one runtime, not two code paths. The batched engine builds on the same pieces.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Iterator, Protocol

import torch

from ..decoding import SamplingParams, draw_uniforms, make_generator, to_probs, verify, verify_greedy
from ..decoding.sampling import target_logits
from ..drafters.base import DraftRequest, Drafter
from ..models.transformer import Segment, Transformer


class PromptTooLongError(ValueError):
    pass


class Target(Protocol):
    """What the loop needs of a target model (a real Transformer, or a table model in tests)."""

    max_position: int

    def new_state(self): ...

    def forward(self, state, start: int, tokens: list[int]) -> torch.Tensor:
        """Run `tokens` at positions start.. (dropping anything cached at or after start) -> logits [n, V]."""

    def truncate(self, state, length: int) -> None: ...


class TransformerTarget:
    """Runs our Transformer; `hidden_layers` are captured into `last_hidden` for model drafters."""

    def __init__(self, model: Transformer, hidden_layers: tuple[int, ...] = ()):
        self.model = model
        self.max_position = model.config.max_position
        self.hidden_layers = tuple(hidden_layers)
        self.last_hidden: dict[int, torch.Tensor] = {}

    def new_state(self):
        return self.model.new_cache()

    def forward(self, state, start: int, tokens: list[int], last_only: bool = False) -> torch.Tensor:
        """-> logits [len(tokens), V], or [1, V] of the last token when last_only (a prompt: the LM head over
        every prompt row would cost as much as a decoding step)."""
        ids = torch.tensor(tokens, dtype=torch.long)
        rows = torch.tensor([len(tokens) - 1]) if last_only else None
        out = self.model.forward(ids, [Segment(state, start, len(tokens))], logit_rows=rows,
                                 hidden_layers=self.hidden_layers)
        self.last_hidden = out.hidden
        return out.logits

    def prefill(self, state, tokens: list[int]) -> torch.Tensor:
        """-> [1, V]. A subclass that hooks forward() (to record or tap) keeps seeing every call, unchanged."""
        if type(self).forward is not TransformerTarget.forward:
            return self.forward(state, 0, tokens)[-1:]
        return self.forward(state, 0, tokens, last_only=True)

    def truncate(self, state, length: int) -> None:
        state.truncate(length)


@dataclass
class GenerationStats:
    prompt_tokens: int = 0
    new_tokens: int = 0
    rounds: int = 0  # verification forwards after the prefill
    drafted: int = 0  # draft tokens sent to verification
    accepted: int = 0  # draft tokens kept
    ttft_s: float = 0.0
    total_s: float = 0.0
    finish_reason: str = ""
    accepted_per_round: list[int] = field(default_factory=list)
    # where the rounds' time went (seconds, summed over rounds): the drafter's proposal, the target's forward,
    # the acceptance rule, and feeding the drafter the committed tokens' states; the rest is bookkeeping
    propose_s: float = 0.0
    forward_s: float = 0.0
    verify_s: float = 0.0
    observe_s: float = 0.0

    @property
    def tau(self) -> float:
        """Mean tokens emitted per verification round, the bonus/replacement token included."""
        return (self.accepted + self.rounds) / self.rounds if self.rounds else 0.0

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.total_s if self.total_s > 0 else 0.0

    def to_dict(self) -> dict:
        return {"prompt_tokens": self.prompt_tokens, "new_tokens": self.new_tokens, "rounds": self.rounds,
                "drafted": self.drafted, "accepted": self.accepted, "tau": round(self.tau, 4),
                "tokens_per_s": round(self.tokens_per_s, 3), "ttft_s": round(self.ttft_s, 4),
                "total_s": round(self.total_s, 4), "finish_reason": self.finish_reason,
                "propose_s": round(self.propose_s, 4), "forward_s": round(self.forward_s, 4),
                "verify_s": round(self.verify_s, 4), "observe_s": round(self.observe_s, 4)}


class Generation:
    """Iterate to receive the tokens of each round as they are accepted; `stats` fills in as it runs."""

    def __init__(self, target: Target, drafter: Drafter | None, prompt: list[int], params: SamplingParams,
                 stop_ids: tuple[int, ...] = ()):
        if not prompt:
            raise ValueError("the prompt is empty")
        if len(prompt) >= target.max_position:
            raise PromptTooLongError(f"prompt has {len(prompt)} tokens; the context window is "
                                     f"{target.max_position} (at least one position must stay free)")
        self.target, self.drafter, self.params = target, drafter, params
        self.prompt = list(prompt)
        stops = set(params.stop_token_ids) | (set() if params.ignore_eos else set(stop_ids))
        self.stop_set = stops
        self.stop_ids = torch.tensor(sorted(stops), dtype=torch.long)
        self.generator = make_generator(params.seed)
        self.stats = GenerationStats(prompt_tokens=len(prompt))

    def __iter__(self) -> Iterator[list[int]]:
        t0 = time.perf_counter()
        state = self.target.new_state()
        request = DraftRequest(tokens=list(self.prompt), params=self.params, generator=self.generator)
        try:
            prefill = getattr(self.target, "prefill", None)
            logits = prefill(state, self.prompt) if prefill else self.target.forward(state, 0, self.prompt)[-1:]
            self._observe(request, len(self.prompt))
            anchor = self._first_token(logits)
            self.stats.ttft_s = time.perf_counter() - t0
            yield from self._emit([anchor], request)
            while not self.stats.finish_reason:
                emitted = self._round(state, request)
                yield from self._emit(emitted, request)
        finally:
            self.stats.total_s = time.perf_counter() - t0
            if self.drafter is not None:
                self.drafter.release(request)

    # ----------------------------------------------------------------------------------------------
    def _first_token(self, logits: torch.Tensor) -> int:
        empty = torch.zeros(1, 0, dtype=torch.long)
        return int(self._verify(empty, None, logits.unsqueeze(0), 0).next_token[0])

    def _round(self, state, request: DraftRequest) -> list[int]:
        start = len(request.tokens) - 1  # the anchor's position: everything before it is cached
        # A round adds its n accepted drafts and one more token: n + 1 ≤ both the tokens left to generate and the
        # positions left in the context (the engine's room, engine/step_plan.py).
        left = self.target.max_position - len(request.tokens)
        budget = min(self.params.max_new_tokens - self.stats.new_tokens, left) - 1
        drafts, probs, n, vocab = torch.zeros(1, 0, dtype=torch.long), None, 0, None
        t0 = time.perf_counter()
        if self.drafter is not None and budget > 0:
            proposal = self.drafter.propose([request])
            n = min(int(proposal.num_tokens[0]), budget)
            drafts = proposal.tokens[:, :n]
            probs = None if proposal.probs is None else proposal.probs[:, :n]
            vocab = proposal.vocab  # probs over a draft vocabulary (None: the whole one)
        t1 = time.perf_counter()
        logits = self.target.forward(state, start, [request.tokens[-1], *drafts[0].tolist()])  # [n+1, V]
        t2 = time.perf_counter()
        result = self._verify(drafts, probs, logits.unsqueeze(0), n, request.tokens[len(self.prompt):], vocab)
        accepted = int(result.accepted[0])
        t3 = time.perf_counter()
        self.target.truncate(state, start + accepted + 1)  # keep the anchor and the accepted drafts
        self._observe(request, accepted + 1)
        s = self.stats
        s.propose_s, s.forward_s, s.verify_s = s.propose_s + t1 - t0, s.forward_s + t2 - t1, s.verify_s + t3 - t2
        s.observe_s += time.perf_counter() - t3
        s.rounds, s.drafted, s.accepted = s.rounds + 1, s.drafted + n, s.accepted + accepted
        s.accepted_per_round.append(accepted)
        return result.emitted(drafts, 0)

    def _observe(self, request: DraftRequest, n_committed: int) -> None:
        hidden = getattr(self.target, "last_hidden", None)
        if self.drafter is not None and hidden:
            self.drafter.observe(request, hidden, n_committed)

    def _verify(self, drafts, probs, logits, n: int, history=(), vocab=None):
        """history: the tokens generated so far (the anchor last), which penalties and min_tokens count."""
        num = torch.tensor([n])
        logits = target_logits(logits[0], self.params, history, drafts[0], self.stop_set, self.prompt).unsqueeze(0)
        if self.params.greedy:
            return verify_greedy(drafts, logits, num, self.stop_ids)
        target_probs = to_probs(logits, self.params)  # [1, n+1, V]
        uniforms = draw_uniforms([self.generator], num, n)
        return verify(drafts, probs, target_probs, num, uniforms, self.stop_ids, vocab)

    def _emit(self, tokens: list[int], request: DraftRequest) -> Iterator[list[int]]:
        room = self.params.max_new_tokens - self.stats.new_tokens
        chunk = tokens[:room]
        for i, t in enumerate(chunk):
            if t in self.stop_set:
                chunk = chunk[: i + 1]
                self.stats.finish_reason = "stop"
                break
        request.tokens.extend(chunk)
        self.stats.new_tokens += len(chunk)
        if not self.stats.finish_reason and (self.stats.new_tokens >= self.params.max_new_tokens
                                             or len(request.tokens) >= self.target.max_position):
            self.stats.finish_reason = "length"
        if chunk:
            yield chunk
