"""Text in, streamed text out, for one request: the layer under `dspark generate`."""
from __future__ import annotations

import time
from typing import Iterator

from .decoding import SamplingParams
from .engine.engine import Engine
from .engine.llm import LLM
from .engine.request import Request
from .engine.speculative import GenerationStats


def prompt_ids(tokenizer, prompt: str, chat: bool) -> list[int]:
    if not chat:
        return list(tokenizer(prompt).input_ids)
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("this tokenizer has no chat template; pass --no-chat to use the raw prompt")
    ids = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                        tokenize=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


class TextStream:
    """Steps the engine until its one request finishes, yielding each step's new text (held back while a
    multi-byte character is split across tokens); `stats` fills in as it runs."""

    def __init__(self, engine: Engine, request: Request):
        self.engine, self.request = engine, request
        self.text = ""

    @property
    def tokens(self) -> list[int]:
        return self.request.output

    @property
    def stats(self) -> GenerationStats:
        r = self.request
        end = r.finished_at or time.perf_counter()
        return GenerationStats(prompt_tokens=len(r.prompt), new_tokens=len(r.output), rounds=r.rounds,
                               drafted=r.drafted, accepted=r.accepted,
                               ttft_s=(r.first_token_at or end) - r.arrival, total_s=end - r.arrival,
                               finish_reason=r.finish_reason or "", accepted_per_round=list(r.accepted_hist))

    def __iter__(self) -> Iterator[str]:
        # Reads the request's own text rather than the step's outputs: another stream on the same engine may have
        # run the step that advanced (or finished) this request.
        try:
            while True:
                new = self.request.text[len(self.text):]
                if new:
                    self.text += new
                    yield new
                if self.request.finished:
                    break
                self.engine.step()
        finally:
            if not self.request.finished:  # the consumer stopped early (or Ctrl-C): free the request's KV
                self.engine.abort(self.request.request_id)
                self.engine.step()
        if self.request.finish_reason == "error":
            raise RuntimeError(f"generation failed: {self.request.error}")


class TextGenerator:
    """One prompt at a time through the batched engine, so the verification policy (by default the async
    scheduler where the drafter has a confidence head) decides each step how many drafts are worth verifying."""

    def __init__(self, model: str, drafter: str | None = "auto", gamma: int = 7, dtype: str = "float32",
                 policy: str = "auto"):
        self.llm = LLM(model=model, drafter=drafter, policy=policy, gamma=gamma, dtype=dtype)
        self.drafter, self.policy = self.llm.drafter, self.llm.policy
        self.drafter_name = "none" if self.drafter is None else self.drafter.name
        self.policy_name = self.policy.name

    def stream(self, prompt: str, params: SamplingParams, chat: bool = True) -> TextStream:
        request = self.llm.engine.add_request(prompt_ids(self.llm.tokenizer, prompt, chat), params)
        return TextStream(self.llm.engine, request)
