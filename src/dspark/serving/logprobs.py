"""OpenAI's two shapes of log-probabilities, built from the engine's TokenLogprob entries.

Chat: ``{"content": [{"token", "logprob", "bytes", "top_logprobs": [{"token", "logprob", "bytes"}]}]}``; legacy
completions: ``{"tokens", "token_logprobs", "top_logprobs": [{token: logprob}], "text_offset"}``. A token's string
is its own decoding (a byte-level token that splits a character decodes to U+FFFD, as in other servers; "bytes"
are that string's UTF-8). One entry per emitted token — the tokens ``usage.completion_tokens`` counts, a stop
string's own tokens included. Streamed chunks carry the entries of the tokens produced since the previous chunk,
so the concatenated stream holds the same entries as the plain answer.
"""
from __future__ import annotations

from ..decoding.logprobs import TokenLogprob


class LogprobFormatter:
    def __init__(self, tokenizer, chat: bool):
        self.tokenizer, self.chat = tokenizer, chat
        self.offset = 0  # completions' text_offset runs on across streamed chunks
        self._strings: dict[int, str] = {}

    def _text(self, token: int) -> str:
        s = self._strings.get(token)
        if s is None:
            s = self._strings[token] = self.tokenizer.decode([token])
        return s

    def _entry(self, token: int, logprob: float) -> dict:
        s = self._text(token)
        return {"token": s, "logprob": logprob, "bytes": list(s.encode("utf-8"))}

    def body(self, entries: list[TokenLogprob]) -> dict:
        if self.chat:
            return {"content": [{**self._entry(e.token, e.logprob),
                                 "top_logprobs": [self._entry(t, lp) for t, lp in e.top]} for e in entries]}
        tokens = [self._text(e.token) for e in entries]
        offsets = []
        for s in tokens:
            offsets.append(self.offset)
            self.offset += len(s)
        return {"tokens": tokens, "token_logprobs": [e.logprob for e in entries],
                "top_logprobs": [{self._text(t): lp for t, lp in e.top} for e in entries], "text_offset": offsets}

    def echoed(self, prompt: list[int], entries: list[TokenLogprob]) -> dict:
        """Completions with echo: the prompt's tokens, the first with no log-probability (null, as OpenAI gives
        it), entries[j] belonging to prompt[j + 1]. Build it before the completion's body: text_offset runs on."""
        head = {"tokens": [self._text(prompt[0])], "token_logprobs": [None], "top_logprobs": [None],
                "text_offset": [self.offset]}
        self.offset += len(head["tokens"][0])
        return joined(head, self.body(entries))


def joined(first: dict, then: dict | None) -> dict:
    """Two completions-shaped bodies as one (the prompt's, then the completion's)."""
    return first if then is None else {k: first[k] + then[k] for k in first}
