"""Incremental detokenisation and stop strings, which may span tokens (even inside one accepted block).

Decoding the whole output every step costs O(n) per step, O(n²) per request (0.39 ms a step at 2,048 tokens on
the dev CPU, against 14 µs windowed: scripts/detok_cost.py).
Instead each step decodes a short window: from ``text_window`` (the first token of the last text streamed) to
the end, and subtracts the window's already-streamed part (up to ``text_tokens``). Starting the window at
streamed tokens, not at ``text_tokens``, keeps a tokenizer that treats a decode's first token specially (the
SentencePiece leading space) exact: both decodes start at the same token. The invariant, checked by the
tests against ``tokenizer.decode(output)``: ``request.text`` is the text of ``output[:text_tokens]``, and
both offsets sit on character boundaries (they only move after a decode that did not end inside a character).
That holds for decodes where each prefix's text extends the one before (byte-level BPE, SentencePiece); where
it cannot (clean-up that rewrites streamed text), the streamed text is still exactly ``request.text``.
"""
from __future__ import annotations

import os

from .request import Request

SPLIT = "\ufffd"  # what a decode shows for a character whose bytes have not all arrived


def _text_through(request: Request, tokenizer, end: int) -> str:
    """The whole text of output[:end] (a character split at end shows as U+FFFD): the streamed text plus what the
    window adds. Should a tokenizer's decode of the window not extend its decode of the window's streamed part
    (space clean-up rewriting text already streamed: " " then "." decoding as "."), the whole output is decoded
    and what it has after the streamed text's longest common prefix is added: streamed text cannot be taken back,
    so the text stays what was streamed and loses no character of the decode."""
    seen = tokenizer.decode(request.output[request.text_window:request.text_tokens], skip_special_tokens=True)
    window = tokenizer.decode(request.output[request.text_window:end], skip_special_tokens=True)
    if window.startswith(seen):
        return request.text + window[len(seen):]
    whole = tokenizer.decode(request.output[:end], skip_special_tokens=True)
    return request.text + whole[len(os.path.commonprefix([request.text, whole])):]


def update_text(request: Request, tokenizer, new_count: int, final: bool = False) -> tuple[str, bool]:
    """After `new_count` tokens were appended to request.output: returns (new text, a stop string matched).

    Stop strings are matched once min_tokens tokens are out, and only where they end in token min_tokens or
    later. On a match the output is cut to the fewest tokens whose text contains the stop string (so usage counts
    are exact) and the text is cut before the stop string, as the OpenAI API does. A character split across
    tokens is held back until its last byte comes, unless this is the request's last text (``final``: it ends
    here without a stop string, by EOS or length): then it shows as U+FFFD, as the whole output's decode does;
    held back for good it left the streamed text short of ``tokenizer.decode(output)``.
    """
    full = _text_through(request, tokenizer, len(request.output))
    least = request.params.min_tokens
    if request.stop_strings and len(request.output) >= least:
        longest = max(len(s) for s in request.stop_strings)
        start = max(0, len(request.text) - longest + 1)  # a match may begin in text already streamed
        # ... but, as where each token is checked on its own (vLLM), end no sooner than in token min_tokens
        floor = len(_text_through(request, tokenizer, least - 1)) if len(request.output) - new_count < least else 0
        hits = [(full.find(s, max(start, floor - len(s) + 1)), s) for s in request.stop_strings]
        hits = [(pos, s) for pos, s in hits if pos >= 0]
        if hits:
            pos, stop = min(hits)
            _cut_tokens(request, tokenizer, new_count, full[:pos + len(stop)])
            piece = full[len(request.text): pos] if pos > len(request.text) else ""
            request.text = full[:pos]
            return piece, True
    if full.endswith(SPLIT) and not final:
        return "", False  # a character split across tokens: wait for its remaining bytes
    piece = full[len(request.text):]
    request.text = full
    if len(request.output) > request.text_tokens:  # the window keeps one emitted token before the new ones
        request.text_window, request.text_tokens = request.text_tokens, len(request.output)
    return piece, False


def _cut_tokens(request: Request, tokenizer, new_count: int, through: str) -> None:
    """Keep the fewest output tokens whose text starts with ``through`` (the text up to the stop string's end).
    Comparing text, not length: a prefix ending inside a split character decodes with a U+FFFD in its place,
    as long as the full text but without the stop string. Should a tokenizer decode a prefix differently from
    the same stretch of the whole (space clean-up), length decides, as before."""
    first_new, long_enough = len(request.output) - new_count, None
    for keep in range(max(first_new, request.text_tokens, 1), len(request.output) + 1):
        text = _text_through(request, tokenizer, keep)
        if text.startswith(through):
            break
        if long_enough is None and len(text) >= len(through):
            long_enough = keep
    else:
        keep = long_enough or len(request.output)
    del request.output[keep:]
