"""Counters the engine keeps for /metrics and benchmarks (names follow vLLM's spec_decode_* where they overlap)."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class EngineStats:
    gamma: int
    steps: int = 0
    step_seconds_total: float = 0.0
    last_step_seconds: float = 0.0
    forward_seconds_total: float = 0.0  # the target forward
    drafter_seconds_total: float = 0.0  # the drafter's propose and observe (its model forwards)
    prompt_tokens: int = 0  # prompt tokens the target computed
    cached_prompt_tokens: int = 0  # prompt tokens copied from another request's KV instead
    prefix_hits: int = 0  # requests that copied a prompt prefix
    generation_tokens: int = 0
    num_drafts: int = 0  # verification rounds that carried at least one draft
    num_draft_tokens: int = 0  # drafted tokens sent to verification
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)  # [γ] times slot k was accepted
    verified_per_position: list[int] = field(default_factory=list)  # [γ] times slot k was verified
    accepted_length_counts: list[int] = field(default_factory=list)  # [γ+2] rounds emitting n tokens
    verify_budget_total: int = 0  # Σ over steps of drafted tokens verified
    decode_requests_total: int = 0  # Σ over steps of requests decoding
    finished: dict[str, int] = field(default_factory=dict)  # finish reason -> count

    def __post_init__(self) -> None:
        self.accepted_per_position = [0] * self.gamma
        self.verified_per_position = [0] * self.gamma
        self.accepted_length_counts = [0] * (self.gamma + 2)

    def record_round(self, verified: int, accepted: int) -> None:
        self.num_draft_tokens += verified
        self.num_accepted_tokens += accepted
        self.num_drafts += verified > 0
        for k in range(verified):
            self.verified_per_position[k] += 1
            self.accepted_per_position[k] += k < accepted
        self.accepted_length_counts[min(accepted + 1, self.gamma + 1)] += 1

    def record_step(self, seconds: float, decoding: int, verified: int, forward_s: float = 0.0,
                    drafter_s: float = 0.0) -> None:
        self.steps += 1
        self.step_seconds_total += seconds
        self.forward_seconds_total += forward_s
        self.drafter_seconds_total += drafter_s
        self.last_step_seconds = seconds
        self.decode_requests_total += decoding
        self.verify_budget_total += verified

    def record_finish(self, reason: str) -> None:
        self.finished[reason] = self.finished.get(reason, 0) + 1

    @property
    def overhead_fraction(self) -> float:
        """Share of step time spent outside model forwards (scheduling, verification, bookkeeping, streaming)."""
        if not self.step_seconds_total:
            return 0.0
        models = self.forward_seconds_total + self.drafter_seconds_total
        return max(0.0, 1.0 - models / self.step_seconds_total)

    @property
    def mean_verify_budget(self) -> float:
        """Mean drafted tokens verified per decoding request per step."""
        return self.verify_budget_total / self.decode_requests_total if self.decode_requests_total else 0.0
