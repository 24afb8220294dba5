"""Incremental detokenisation and stop strings, which may span tokens (even inside one accepted block)."""
from __future__ import annotations

from .request import Request


def update_text(request: Request, tokenizer, new_count: int, final: bool = False) -> tuple[str, bool]:
    """After `new_count` tokens were appended to request.output: returns (new text, a stop string matched).

    On a match the output is cut to the fewest tokens whose text contains the stop string (so usage counts
    are exact) and the text is cut before the stop string, as the OpenAI API does. A character split across
    tokens is held back until its last byte comes, unless this is the request's last text (``final``: it ends
    here without a stop string, by EOS or length): then it shows as U+FFFD, as the whole output's decode does;
    held back for good it left the streamed text short of ``tokenizer.decode(output)``.
    """
    full = tokenizer.decode(request.output, skip_special_tokens=True)
    if request.stop_strings:
        longest = max(len(s) for s in request.stop_strings)
        start = max(0, len(request.text) - longest + 1)  # a match may begin in text already streamed
        hits = [(full.find(s, start), s) for s in request.stop_strings]
        hits = [(pos, s) for pos, s in hits if pos >= 0]
        if hits:
            pos, stop = min(hits)
            _cut_tokens(request, tokenizer, new_count, full[:pos + len(stop)])
            piece = full[len(request.text): pos] if pos > len(request.text) else ""
            request.text = full[:pos]
            return piece, True
    if full.endswith("\ufffd") and not final:
        return "", False  # a character split across tokens: wait for its remaining bytes
    piece = full[len(request.text):]
    request.text = full
    return piece, False


def _cut_tokens(request: Request, tokenizer, new_count: int, through: str) -> None:
    """Keep the fewest output tokens whose text starts with ``through`` (the text up to the stop string's end).
    Comparing text, not length: a prefix ending inside a split character decodes with a U+FFFD in its place,
    as long as the full text but without the stop string. Should a tokenizer decode a prefix differently from
    the same stretch of the whole (space clean-up), length decides, as before."""
    first_new, long_enough = len(request.output) - new_count, None
    for keep in range(max(first_new, 1), len(request.output) + 1):
        text = tokenizer.decode(request.output[:keep], skip_special_tokens=True)
        if text.startswith(through):
            break
        if long_enough is None and len(text) >= len(through):
            long_enough = keep
    else:
        keep = long_enough or len(request.output)
    del request.output[keep:]

