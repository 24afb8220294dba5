"""Prompt-prefix reuse: a new request copies the KV of the longest prompt prefix it shares with a running or a
recently finished request, instead of prefilling it.

Shared system prompts, n choices of one prompt and the next turn of a chat (the last prompt plus its answer
plus a new message) all start with tokens some request has already run through the target. Each request owns
one contiguous KV buffer (rollback stays a length change, models/kv_cache.py), so a prefix is copied, not
shared: a memcpy of m positions in place of a forward over them.

Donors: running requests — a position below a request's committed length never changes (verification only
writes, and rolls back, after it) — and finished ones, kept least-recently-used first within the engine's KV
budget (admission evicts them before it makes a request wait) and at most `max_entries` of them.

A request whose best donor is still prefilling the shared part waits for it (one step per prompt chunk)
rather than computing the same positions beside it; a waiting request is never a donor, so no request can wait
on itself. The last prompt token is always computed: its logits give the first output token.

Running donors are at most a batch, and are scanned. Kept ones can be hundreds, and under a shared system prompt
every one of them is a candidate (session 30 measured 6.6 ms a lookup over 512 such donors), so they are indexed
like vLLM's prefix blocks: each whole block of `min_tokens` tokens gets a key hashed over every block before it,
so a key names a whole prefix. A lookup walks its prompt's keys to the deepest one a kept donor holds, compares
only the next block's tokens of the donors there (and of shallower ones while one of them could still give more),
and checks the whole prefix of a donor before it takes it: a hash collision costs a comparison, never a wrong copy.

A model drafter needs the target states of the prefix too: it hands over the context it built from them
(Drafter.share_context) and the engine's feed the states it had not fed yet (DraftFeed.share), so the
new request's drafter context is the one prefilling would have built.

Lossless: the copied KV is the target's KV of the same tokens at the same positions; it differs from
recomputing it only by float rounding of a different batch shape, as batching other requests already does.
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from .request import Request, Status


@dataclass(frozen=True)
class Match:
    donor: Request
    length: int  # prompt positions to copy from the donor
    wait: bool  # the donor is still prefilling them: look again next step


def common_prefix(a: list[int], b: list[int]) -> int:
    """Length of the common prefix, by list comparisons (C speed, no copy into arrays: converting two 1,000-token
    prompts to numpy cost more than comparing them)."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    at = 0  # a mismatch lies below n: skip whole equal blocks, then step to it
    while a[at: at + 64] == b[at: at + 64]:
        at += 64
    while a[at] == b[at]:
        at += 1
    return at


def block_keys(tokens: list[int], block: int) -> Iterator[int]:
    """One key per whole block of `tokens`; block i's key hashes blocks 0..i, so it names the whole prefix."""
    key = 0
    for i in range(len(tokens) // block):
        key = hash((key, tuple(tokens[i * block: (i + 1) * block])))
        yield key


class PrefixCache:
    def __init__(self, min_tokens: int = 16, max_entries: int = 256):
        if min_tokens < 1 or max_entries < 0:
            raise ValueError("prefix_min_tokens must be >= 1 and prefix_cache_entries >= 0")
        self.min_tokens, self.max_entries = min_tokens, max_entries
        self.kept: OrderedDict[str, Request] = OrderedDict()  # finished donors, least recently used first
        self.kept_positions = 0  # KV positions the kept donors hold (they count against the engine's budget)
        # block key -> the kept donors holding that prefix (a dict, not a set: ties resolve in a fixed order)
        self.index: dict[int, dict[str, Request]] = {}
        self.committed: dict[str, tuple[list[int], list[int]]] = {}  # kept donor -> (its tokens with KV, keys)

    def find(self, req: Request, running: list[Request], coverage: Callable[[Request], int]) -> Match | None:
        """The donor sharing the longest prefix of req's prompt (at least min_tokens); coverage(donor) caps what
        a donor can give (the positions its drafter context and pending states cover). None for a request that
        scores its prompt (prompt_logprobs): a copied position has no logits to read them from. Among donors that
        give as much, a running one wins, then a kept one met first."""
        wanted = req.prompt[: len(req.prompt) - 1]
        if len(wanted) < self.min_tokens or req.params.prompt_logprobs is not None:
            return None
        head, best = wanted[: self.min_tokens], None
        for donor in running:
            if donor is req or donor.cache is None or donor.prefix_state != "done":
                continue
            tokens = donor.prompt if len(donor.prompt) >= len(wanted) else donor.prompt + donor.output
            if tokens[: self.min_tokens] == head:
                best = self._better(best, donor, common_prefix(wanted, tokens), coverage)
                if best is not None and best[0] == (len(wanted), True):  # the whole prompt, ready: none beats it
                    return best[1]
        return self._find_kept(wanted, best, coverage)

    def _find_kept(self, wanted: list[int], best, coverage) -> Match | None:
        b = self.min_tokens
        levels = []  # levels[i]: the kept donors whose keys say they share blocks 0..i of the wanted prompt
        for key in block_keys(wanted, b):
            if key not in self.index:
                break
            levels.append(self.index[key])
        for depth in range(len(levels) - 1, -1, -1):
            known = (depth + 1) * b
            nearer = levels[depth + 1] if depth + 1 < len(levels) else {}  # met already
            # donors first met here share fewer than known + b tokens, and a kept donor never waits
            most = (min(known + b - 1, len(wanted)), True)
            if best is not None and best[0] >= most:
                break
            tail = wanted[known: known + b]
            for rid, donor in levels[depth].items():
                if rid in nearer or donor.cache is None:
                    continue
                tokens = self.committed[rid][0]
                shared = known + common_prefix(tail, tokens[known: known + b])
                if best is not None and (shared, True) <= best[0]:
                    continue
                if wanted[:known] != tokens[:known]:  # a hash collision: the keys misled, count it all
                    shared = common_prefix(wanted, tokens)
                best = self._better(best, donor, shared, coverage)
                if best is not None and best[0] >= most:
                    break
        return None if best is None else best[1]

    def _better(self, best, donor: Request, shared: int, coverage):
        """(key, Match) for `donor`, sharing `shared` tokens, if it gives more than `best` (more positions, then
        no wait), else `best`."""
        ready = min(shared, donor.cache.length, donor.num_tokens, coverage(donor))
        waits = ready < shared and donor.status is Status.PREFILL  # it is computing the rest right now
        key = (shared if waits else ready, not waits)
        if key[0] >= self.min_tokens and (best is None or key > best[0]):
            return key, Match(donor, key[0], waits)
        return best

    def keep(self, req: Request) -> list[Request]:
        """Keep a finished request as a donor; returns the donors this pushes out (least recently used)."""
        self.kept[req.request_id] = req
        self.kept_positions += req.reserved
        tokens = (req.prompt + req.output)[: req.cache.length]  # the positions it holds KV for
        keys = list(block_keys(tokens, self.min_tokens))
        self.committed[req.request_id] = tokens, keys
        for key in keys:
            self.index.setdefault(key, {})[req.request_id] = req
        return [self.pop_oldest() for _ in range(len(self.kept) - self.max_entries)]

    def touch(self, donor: Request) -> None:
        if donor.request_id in self.kept:
            self.kept.move_to_end(donor.request_id)

    def pop_oldest(self) -> Request:
        return self.discard(next(iter(self.kept.values())))

    def discard(self, req: Request) -> Request:
        del self.kept[req.request_id]
        self.kept_positions -= req.reserved
        for key in self.committed.pop(req.request_id)[1]:
            holders = self.index[key]
            del holders[req.request_id]
            if not holders:
                del self.index[key]
        return req
