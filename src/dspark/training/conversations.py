"""Prompt files in, chat-formatted token sequences out.

Prompt lines: {"turns": [user, ...]} (the benchmark/DeepSpec layout), {"messages": [{role, content}, ...]}
(assistant messages are dropped: the target regenerates them) or {"prompt": "..."}; "id" and "system" are
optional. Training sequences are rendered with the target's chat template; the loss mask marks the tokens the
assistant produced (its content and the end-of-turn token that closes it).
"""
from __future__ import annotations

import gzip
import json
import lzma
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

_OPENERS = {".xz": lzma.open, ".gz": gzip.open}


class PromptFileError(ValueError):
    pass


@dataclass(frozen=True)
class PromptRecord:
    line: int  # 1-based line number in the prompt file
    id: str
    turns: tuple[str, ...]  # user turns, replayed one by one
    system: str | None = None
    source: str | None = None

    def first_messages(self) -> list[dict]:
        head = [{"role": "system", "content": self.system}] if self.system else []
        return head + [{"role": "user", "content": self.turns[0]}]


def _parse(obj) -> tuple[list[str], str | None]:
    if not isinstance(obj, dict):
        raise ValueError(f"expected a JSON object, got {type(obj).__name__}")
    system = obj.get("system")
    if "turns" in obj:
        turns = obj["turns"]
    elif "messages" in obj:
        msgs = obj["messages"]
        if not isinstance(msgs, list) or not all(isinstance(m, dict) for m in msgs):
            raise ValueError("'messages' must be a list of {role, content} objects")
        turns = [m.get("content") for m in msgs if m.get("role") == "user"]
        system = system or next((m.get("content") for m in msgs if m.get("role") == "system"), None)
    elif "prompt" in obj:
        turns = [obj["prompt"]]
    else:
        raise ValueError("no 'turns', 'messages' or 'prompt' field")
    if not isinstance(turns, list) or not turns:
        raise ValueError("no user turn")
    if not all(isinstance(t, str) and t.strip() for t in turns):
        raise ValueError("every user turn must be a non-empty string")
    if system is not None and not isinstance(system, str):
        raise ValueError("'system' must be a string")
    return turns, system


def jsonl_lines(path: str | Path) -> Iterator[tuple[int, str]]:
    """(1-based line number, text) of a JSONL file, plain or compressed (.xz, .gz: committed datasets stay
    compressed on disk). A truncated or corrupt archive is an error that names the file, not a silent short read."""
    path = Path(path)
    try:
        with _OPENERS.get(path.suffix, open)(path, "rt", encoding="utf-8") as f:
            yield from enumerate(f, start=1)
    except (EOFError, lzma.LZMAError, gzip.BadGzipFile, zlib.error) as exc:
        raise ValueError(f"{path}: the compressed file is truncated or corrupt ({exc})") from None


def read_prompts(path: str | Path, skip_bad: bool = False, limit: int = 0) -> tuple[list[PromptRecord], list[str]]:
    """-> (records, problems). Malformed lines raise PromptFileError naming their line numbers, unless
    skip_bad, in which case they are skipped and described in `problems`."""
    records, problems, seen = [], [], set()
    for number, text in jsonl_lines(path):
        if not text.strip():
            continue
        try:
            obj = json.loads(text)
            turns, system = _parse(obj)
            rid = str(obj.get("id", f"line-{number}"))
            if rid in seen:
                raise ValueError(f"duplicate id {rid!r}")
        except ValueError as exc:  # JSONDecodeError is a ValueError
            problems.append(f"line {number}: {exc}")
            continue
        seen.add(rid)
        records.append(PromptRecord(number, rid, tuple(turns), system, obj.get("source")))
        if limit and len(records) >= limit:
            break
    if problems and not skip_bad:
        shown = "; ".join(problems[:10]) + (f"; ... ({len(problems)} in all)" if len(problems) > 10 else "")
        raise PromptFileError(f"{path}: {len(problems)} malformed prompt line(s): {shown} "
                              f"(use --skip-bad to skip them)")
    return records, problems


def render(tokenizer, messages: list[dict], generation_prompt: bool) -> str:
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)


def prompt_ids(tokenizer, messages: list[dict]) -> list[int]:
    """Token ids of the chat-formatted conversation followed by the assistant generation prompt."""
    return tokenizer(render(tokenizer, messages, True), add_special_tokens=False)["input_ids"]


def encode_conversation(tokenizer, messages: list[dict], max_len: int = 0) -> tuple[list[int], list[int]]:
    """-> (token ids, loss mask) of a whole conversation; mask = 1 on assistant-produced tokens."""
    text = render(tokenizer, messages, False)
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    ids, offsets = list(enc["input_ids"]), list(enc["offset_mapping"])
    mask = [0] * len(ids)
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        prefix = render(tokenizer, messages[:i], True)
        if not text.startswith(prefix):
            raise ValueError("the chat template does not render a conversation's prefix as its prefix; "
                             "cannot locate assistant tokens")
        c0 = text.find(m["content"], len(prefix))
        if c0 < 0:
            raise ValueError("assistant content not found in the rendered conversation")
        c1 = c0 + len(m["content"])
        closing = True  # the first token after the content closes the turn (e.g. <|im_end|>): the model emits it
        for t, (a, b) in enumerate(offsets):
            if a < c1 and b > c0 and b > a:
                mask[t] = 1
            elif a >= c1 and closing and b > a:
                mask[t], closing = 1, False
    if max_len:
        ids, mask = ids[:max_len], mask[:max_len]
    return ids, mask
