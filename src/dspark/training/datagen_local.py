"""Answer regeneration through our own runtime: continuous batching over the ragged forward.

Each step runs ONE forward over every active conversation: prompts that just joined contribute their whole
(uncached part of the) prompt, running ones their last sampled token. A finished conversation frees its slot
for the next prompt at once, so the batch stays full. For the next user turn of a multi-turn prompt the KV cache
is kept up to the longest common prefix with the re-rendered conversation, so only the new turn is prefilled.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Iterator

import torch

from ..decoding.sampling import SamplingParams, make_generator, sample_from, to_probs
from ..models.kv_cache import KVCache
from ..models.transformer import Segment
from .conversations import PromptRecord, prompt_ids


@dataclass
class _Conversation:
    record: PromptRecord
    messages: list[dict]
    cache: KVCache
    generator: torch.Generator
    cached: list[int] = field(default_factory=list)  # tokens whose K/V are in the cache
    pending: list[int] = field(default_factory=list)  # tokens to feed at positions len(cached)..
    generated: list[int] = field(default_factory=list)  # this turn's answer so far
    answer_tokens: list[int] = field(default_factory=list)
    finish_reasons: list[str] = field(default_factory=list)

    def set_prompt(self, ids: list[int]) -> None:
        common = 0
        for a, b in zip(self.cached, ids):
            if a != b:
                break
            common += 1
        common = min(common, len(ids) - 1)  # at least one token must be fed to get the next logits
        self.cache.truncate(common)
        self.cached, self.pending, self.generated = self.cached[:common], ids[common:], []


def _record(conv: _Conversation, status: str = "ok", reason: str | None = None) -> dict:
    out = {"id": conv.record.id, "line": conv.record.line, "source": conv.record.source, "status": status,
           "messages": conv.messages, "answer_tokens": conv.answer_tokens, "finish_reasons": conv.finish_reasons}
    if reason:
        out["reason"] = reason
    return out


def generate_local(loaded, records: Iterator[PromptRecord], settings, emit: Callable[[dict], None]) -> None:
    from .datagen import record_seed

    model, tokenizer = loaded.model, loaded.tokenizer
    eos = set(loaded.eos_ids)
    params = SamplingParams(temperature=settings.temperature, top_p=settings.top_p, top_k=settings.top_k,
                            max_new_tokens=settings.max_new_tokens)
    max_context = min(settings.max_context or model.config.max_position, model.config.max_position)
    active: list[_Conversation] = []
    exhausted = False
    while True:
        while not exhausted and len(active) < settings.batch_size:
            record = next(records, None)
            if record is None:
                exhausted = True
                break
            conv = _Conversation(record, record.first_messages(), model.new_cache(),
                                 make_generator(record_seed(settings.seed, record.id)))
            if _start_turn(conv, tokenizer, max_context):
                active.append(conv)
            else:
                emit(_record(conv, "skipped", f"prompt does not fit the {max_context}-token context"))
        if not active:
            return
        next_tokens = _step(model, active, params)
        still = []
        for conv, token in zip(active, next_tokens):
            conv.generated.append(token)
            conv.pending = [token]
            stop = token in eos
            if stop or len(conv.generated) >= params.max_new_tokens or len(conv.cached) + 1 >= max_context:
                if not _finish_turn(conv, tokenizer, stop, max_context):
                    emit(_record(conv))
                    continue
            still.append(conv)
        active = still


def _step(model, active: list[_Conversation], params: SamplingParams) -> list[int]:
    """One ragged forward over all active conversations -> the next token of each."""
    tokens = torch.tensor([t for c in active for t in c.pending], dtype=torch.long)
    segments = [Segment(c.cache, len(c.cached), len(c.pending)) for c in active]
    last_rows = torch.tensor([len(c.pending) for c in active]).cumsum(0) - 1  # [R]
    logits = model.forward(tokens, segments, logit_rows=last_rows).logits  # [R, V]
    for c in active:
        c.cached += c.pending
    probs = to_probs(logits, params)
    if params.greedy:
        uniforms = torch.full((len(active),), 0.5, dtype=torch.float64)
    else:
        uniforms = torch.cat([torch.rand(1, generator=c.generator, dtype=torch.float64) for c in active])
    return sample_from(probs, uniforms).tolist()


def _start_turn(conv: _Conversation, tokenizer, max_context: int) -> bool:
    ids = prompt_ids(tokenizer, conv.messages)
    if len(ids) >= max_context - 1:
        return False
    conv.set_prompt(ids)
    return True


def _finish_turn(conv: _Conversation, tokenizer, stopped: bool, max_context: int) -> bool:
    """Close the current answer; start the next user turn if there is one. -> whether the conversation goes on."""
    answer = conv.generated[:-1] if stopped else conv.generated  # the end-of-turn token is the template's job
    conv.messages.append({"role": "assistant", "content": tokenizer.decode(answer, skip_special_tokens=True)})
    conv.answer_tokens.append(len(conv.generated))
    conv.finish_reasons.append("stop" if stopped else "length")
    turn = sum(m["role"] == "user" for m in conv.messages)
    if turn >= len(conv.record.turns):
        return False
    conv.messages.append({"role": "user", "content": conv.record.turns[turn]})
    if not _start_turn(conv, tokenizer, max_context):
        conv.finish_reasons.append("context")  # the replayed conversation no longer fits: keep what we have
        return False
    return True
