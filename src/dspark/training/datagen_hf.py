"""Answer regeneration through `transformers`' batched `generate`, for a GPU.

Our runtime runs attention per request, which suits a CPU's few concurrent conversations; on a GPU a padded
batch of hundreds of conversations per forward is what pays. This backend renders prompts with the same chat
template, generates every conversation of a chunk together (turn by turn for multi-turn prompts) and writes the
same records as the other backends, so training does not know which one made its data. The answers are samples
of the same target distribution (same weights, same sampling settings); they are reproducible for a given seed,
chunk size and device, not bitwise equal to the runtime backend's per-conversation seeded answers.
"""
from __future__ import annotations

from typing import Callable

import torch

from .conversations import PromptRecord, prompt_ids

WINDOW_CHUNKS = 4


def load_hf_model(loaded, device: torch.device):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(loaded.hf_dir), dtype=torch.float32)
    return model.to(device).eval()


def generate_transformers(loaded, records: list[PromptRecord], settings, emit: Callable[[dict], None],
                          device: str = "auto") -> None:
    from ..models.loader import resolve_device

    dev = resolve_device(device)
    model, tok = load_hf_model(loaded, dev), loaded.tokenizer
    max_context = min(settings.max_context or loaded.model.config.max_position, loaded.model.config.max_position)
    # Similar prompt lengths share a chunk (less padding, and its rows finish at similar times), sorted within
    # windows of a few chunks in file order, so a run cut short by a time box has not kept only short prompts.
    window = WINDOW_CHUNKS * settings.batch_size
    order = [r for w in range(0, len(records), window)
             for r in sorted(records[w: w + window], key=lambda r: len(r.turns[0]))]
    for c, start in enumerate(range(0, len(order), settings.batch_size)):
        torch.manual_seed(settings.seed * 1_000_003 + c)  # reproducible per (seed, chunk) on one device
        convs = [_Conv(r) for r in order[start: start + settings.batch_size]]
        while convs:
            live = [cv for cv in convs if cv.start_turn(tok, max_context)]
            for cv in convs:
                if cv.done:
                    emit(cv.record_out())
            if not live:
                break
            for group in token_groups(live, settings.batch_tokens, settings.max_new_tokens):
                _generate_turn(model, tok, group, settings, loaded.eos_ids, dev)
            convs = live


def token_groups(convs: list["_Conv"], batch_tokens: int, max_new: int) -> list[list["_Conv"]]:
    """Split one turn's conversations so rows x (longest prompt + max_new) stays within batch_tokens: the
    padded KV cache of a generate call, which a chunk of long (or replayed multi-turn) prompts would blow up."""
    if batch_tokens <= 0:
        return [convs]
    groups: list[list[_Conv]] = [[]]
    width = 0
    for c in sorted(convs, key=lambda c: len(c.ids)):
        width = max(width, len(c.ids))
        if groups[-1] and (len(groups[-1]) + 1) * (width + max_new) > batch_tokens:
            groups.append([])
            width = len(c.ids)
        groups[-1].append(c)
    return groups


class _Conv:
    def __init__(self, record: PromptRecord):
        self.record, self.messages = record, record.first_messages()
        self.answer_tokens: list[int] = []
        self.finish_reasons: list[str] = []
        self.ids: list[int] = []
        self.done, self.status, self.reason = False, "ok", None

    def start_turn(self, tok, max_context: int) -> bool:
        """Render the next turn's prompt; False (and done) when the conversation has no turn left to answer."""
        if self.done:
            return False
        turn = sum(m["role"] == "assistant" for m in self.messages)
        if turn >= len(self.record.turns):
            self.done = True
            return False
        if turn:
            self.messages.append({"role": "user", "content": self.record.turns[turn]})
        self.ids = prompt_ids(tok, self.messages)
        if len(self.ids) < max_context - 1:
            return True
        self.done = True
        if turn:
            self.messages.pop()
            self.finish_reasons.append("context")  # the replayed conversation no longer fits: keep what we have
        else:
            self.status, self.reason = "skipped", f"prompt does not fit the {max_context}-token context"
        return False

    def finish_turn(self, tok, tokens: list[int], stopped: bool) -> None:
        answer = tokens[:-1] if stopped else tokens  # the end-of-turn token is the template's job
        self.messages.append({"role": "assistant", "content": tok.decode(answer, skip_special_tokens=True)})
        self.answer_tokens.append(len(tokens))
        self.finish_reasons.append("stop" if stopped else "length")

    def record_out(self) -> dict:
        r = self.record
        out = {"id": r.id, "line": r.line, "source": r.source, "status": self.status, "messages": self.messages,
               "answer_tokens": self.answer_tokens, "finish_reasons": self.finish_reasons}
        if self.reason:
            out["reason"] = self.reason
        return out


@torch.inference_mode()
def _generate_turn(model, tok, convs: list[_Conv], settings, eos_ids, dev) -> None:
    width = max(len(c.ids) for c in convs)
    pad = tok.pad_token_id if tok.pad_token_id is not None else eos_ids[0]
    ids = torch.full((len(convs), width), pad, dtype=torch.long)
    attn = torch.zeros(len(convs), width, dtype=torch.long)
    for i, c in enumerate(convs):  # left padding: every row's next token is at the same column
        ids[i, width - len(c.ids):] = torch.tensor(c.ids)
        attn[i, width - len(c.ids):] = 1
    sample = settings.temperature > 0
    # top_k=0 explicitly: transformers' generation defaults would otherwise add a top-50 filter.
    kwargs = {"temperature": settings.temperature, "top_p": settings.top_p, "top_k": settings.top_k} if sample else {}
    max_new = min(settings.max_new_tokens, model.config.max_position_embeddings - width)
    out = model.generate(input_ids=ids.to(dev), attention_mask=attn.to(dev), do_sample=sample,
                         max_new_tokens=max_new, eos_token_id=list(eos_ids), pad_token_id=pad, **kwargs)
    eos = set(eos_ids)
    for c, row in zip(convs, out[:, width:].tolist()):
        cut = next((j + 1 for j, t in enumerate(row) if t in eos), None)
        c.finish_turn(tok, row[:cut] if cut else row, stopped=cut is not None)
