"""Text in, streamed text out, for one request: the layer under `dspark generate`."""
from __future__ import annotations

from typing import Iterator

from .decoding import SamplingParams
from .drafters import make_drafter
from .engine.speculative import Generation, GenerationStats, TransformerTarget
from .models import load_model


def prompt_ids(tokenizer, prompt: str, chat: bool) -> list[int]:
    if not chat:
        return list(tokenizer(prompt).input_ids)
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("this tokenizer has no chat template; pass --no-chat to use the raw prompt")
    ids = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                        tokenize=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


class TextStream:
    """Iterates over text pieces; holds back bytes that do not yet form a whole character."""

    def __init__(self, generation: Generation, tokenizer):
        self.generation, self.tokenizer = generation, tokenizer
        self.tokens: list[int] = []
        self.text = ""

    @property
    def stats(self) -> GenerationStats:
        return self.generation.stats

    def __iter__(self) -> Iterator[str]:
        for chunk in self.generation:
            self.tokens.extend(chunk)
            text = self.tokenizer.decode(self.tokens, skip_special_tokens=True)
            if text.endswith("\ufffd"):
                continue  # a multi-byte character split across tokens: wait for the rest
            piece, self.text = text[len(self.text):], text
            if piece:
                yield piece
        final = self.tokenizer.decode(self.tokens, skip_special_tokens=True)
        if final != self.text:
            piece, self.text = final[len(self.text):], final
            yield piece


class TextGenerator:
    def __init__(self, model: str, drafter: str | None = "auto", gamma: int = 7, dtype: str = "float32"):
        self.loaded = load_model(model, dtype=dtype)
        self.drafter = make_drafter(drafter, target=self.loaded.model, gamma=gamma)
        layers = self.drafter.needs_layers if self.drafter is not None else ()
        self.target = TransformerTarget(self.loaded.model, hidden_layers=layers)

    def stream(self, prompt: str, params: SamplingParams, chat: bool = True) -> TextStream:
        ids = prompt_ids(self.loaded.tokenizer, prompt, chat)
        generation = Generation(self.target, self.drafter, ids, params, self.loaded.eos_ids)
        return TextStream(generation, self.loaded.tokenizer)
