"""Incremental detokenisation and stop strings, which may span tokens (even inside one accepted block)."""
from __future__ import annotations

from .request import Request


def update_text(request: Request, tokenizer, new_count: int) -> tuple[str, bool]:
    """After `new_count` tokens were appended to request.output: returns (new text, a stop string matched).

    On a match the output is cut to the fewest tokens whose text contains the stop string (so usage counts
    are exact) and the text is cut before the stop string, as the OpenAI API does.
    """
    full = tokenizer.decode(request.output, skip_special_tokens=True)
    if request.stop_strings:
        longest = max(len(s) for s in request.stop_strings)
        start = max(0, len(request.text) - longest + 1)  # a match may begin in text already streamed
        hits = [(full.find(s, start), s) for s in request.stop_strings]
        hits = [(pos, s) for pos, s in hits if pos >= 0]
        if hits:
            pos, stop = min(hits)
            _cut_tokens(request, tokenizer, new_count, pos + len(stop))
            piece = full[len(request.text): pos] if pos > len(request.text) else ""
            request.text = full[:pos]
            return piece, True
    if full.endswith("\ufffd"):
        return "", False  # a character split across tokens: wait for its remaining bytes
    piece = full[len(request.text):]
    request.text = full
    return piece, False


def _cut_tokens(request: Request, tokenizer, new_count: int, text_end: int) -> None:
    first_new = len(request.output) - new_count
    for keep in range(max(first_new, 1), len(request.output) + 1):
        if len(tokenizer.decode(request.output[:keep], skip_special_tokens=True)) >= text_end:
            del request.output[keep:]
            return
