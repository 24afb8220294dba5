"""Verification of a ragged batch whose requests each carry their own sampling parameters and generator."""
from __future__ import annotations

import torch

from .sampling import SamplingParams, greedy_tokens, target_logits, to_probs
from .verify import DraftVocab, VerifyResult, accept_greedy, draw_uniforms, verify, verify_rows


def verify_requests(logits: list[torch.Tensor], drafts: torch.Tensor, num_draft: torch.Tensor,
                    draft_probs: torch.Tensor | None, params: list[SamplingParams],
                    generators: list[torch.Generator], stop_mask: torch.Tensor,
                    table: tuple[torch.Tensor, list[int]] | None = None,
                    histories: list | None = None, stop_ids: list | None = None,
                    prompts: list | None = None, draft_rows: list[int] | None = None,
                    draft_vocab: DraftVocab | None = None) -> VerifyResult:
    """logits[r]: [ℓ_r+1, V] target rows of request r; drafts: [R, γ]; num_draft: [R]; draft_probs: [R, γ, V]
    or None; stop_mask: [R, γ] bool (draft k of request r is one of r's stop tokens); table: (all rows [M, V],
    the first row of each request) when every logits[r] is a run of rows of one tensor, as in the engine's
    forward: greedy requests then take one batched argmax. histories[r]: the tokens request r generated so far (its
    anchor last), which its penalties count (decoding/sampling.target_logits); stop_ids[r]: its stop token ids,
    masked before its min_tokens; prompts[r]: its prompt, which a repetition penalty also counts; draft_rows: the
    requests draft_probs' rows belong to when only some were drafted (a probe; None: every request, in order) —
    the others must verify nothing; draft_vocab: draft_probs' last dimension is that draft vocabulary, not V.

    Greedy requests take the argmax fast path; the rest are processed with their own parameters (the same
    ones their drafts were processed with). Given a table, sampled requests that all process alike with no top-p
    and no logits adjusted (the engine's usual step) are verified where their rows lie (`_verify_table`). Otherwise
    they are batched over requests that process alike into padded buffers, the reference path. Buffers are only as
    wide as the longest verified block of the group, not γ + 1: at 32 requests with nothing
    drafted, a [R, γ + 1, V] buffer was zeroed and scanned for every step (~9 % of a step on the dev CPU with a
    49,152-token vocabulary). For the same reason sampled requests that verify drafts and those that verify none
    are verified apart: a probe drafts two requests of sixteen, and the other fourteen need one row each, not a
    padded block as wide as the two. A request's tokens do not depend on the split: its rows, its uniforms and its
    draft distributions are its own.
    """
    R = drafts.shape[0]
    accepted = torch.zeros(R, dtype=torch.long)
    next_token = torch.zeros(R, dtype=torch.long)
    stopped = torch.zeros(R, dtype=torch.bool)

    def generated(r: int) -> int:
        return len(histories[r]) if histories else 0

    def adjusted(r: int) -> torch.Tensor:  # logit_bias, penalties, min_tokens: the target as request r samples it
        return target_logits(logits[r], params[r], histories[r] if histories else (), drafts[r],
                             stop_ids[r] if stop_ids else (), prompts[r] if prompts else ())

    greedy = [r for r in range(R) if params[r].greedy]
    sampled = [r for r in range(R) if not params[r].greedy]
    counts = num_draft.tolist()  # once: indexing the tensor per request is a per-step cost that grows with R
    if sampled and table is not None and _one_softmax(sampled, params, generated):
        res = _verify_table(table, sampled, counts, drafts, draft_probs, draft_rows, params[sampled[0]],
                            [generators[r] for r in sampled], stop_mask, draft_vocab)
        idx = slice(None) if len(sampled) == R else torch.tensor(sampled)
        accepted[idx], next_token[idx], stopped[idx] = res.accepted, res.next_token, res.stopped
        sampled = []
    drafting = [r for r in sampled if counts[r] > 0]
    undrafted = [r for r in sampled if counts[r] == 0]
    groups = ((greedy, True), (sampled, False)) if not drafting or not undrafted else (
        (greedy, True), (drafting, False), (undrafted, False))
    for group, is_greedy in groups:
        if not group:
            continue
        # every request of the batch in order (the usual case): a slice, so draft_probs [R, γ, V] is not copied
        idx = slice(None) if len(group) == R else torch.tensor(group)
        width = int(num_draft[idx].max())  # drafts any request of the group verifies; slots beyond are unused
        draft, stops = drafts[idx, :width], stop_mask[idx, :width]
        plain = not any(params[r].adjusts_logits_after(generated(r)) for r in group)  # target_logits is the identity
        if is_greedy:
            best = (_argmax_tokens(logits, group, width, table) if plain
                    else _argmax_tokens({r: adjusted(r) for r in group}, group, width, None))
            res = accept_greedy(draft, best, num_draft[idx], stops)
        else:
            rows = _sampled_rows([adjusted(r) for r in group], [params[r] for r in group], width)
            uniforms = draw_uniforms([generators[r] for r in group], num_draft[idx], width)
            q = None if draft_probs is None or width == 0 else _draft_block(draft_probs, draft_rows, group, idx, width)
            res = verify(draft, q, rows, num_draft[idx], uniforms, stops, draft_vocab)
        accepted[idx], next_token[idx], stopped[idx] = res.accepted, res.next_token, res.stopped
    return VerifyResult(accepted=accepted, next_token=next_token, stopped=stopped)


def _one_softmax(group: list[int], params: list[SamplingParams], generated) -> bool:
    """Whether the group's rows can take one to_probs call over the step's table: the same processing, no top-p
    (whose per-call work `_sampled_rows` shares out in chunks) and no logits adjusted per request."""
    first = params[group[0]]
    return (first.top_p >= 1 and all(params[r].processing == first.processing for r in group)
            and not any(params[r].adjusts_logits_after(generated(r)) for r in group))


def _verify_table(table: tuple[torch.Tensor, list[int]], group: list[int], counts: list[int], drafts: torch.Tensor,
                  draft_probs: torch.Tensor | None, draft_rows: list[int] | None, params: SamplingParams,
                  generators: list[torch.Generator], stop_mask: torch.Tensor,
                  vocab: DraftVocab | None = None) -> VerifyResult:
    """The sampled requests of ``group`` verified over the step's rows of logits as they lie in ``table``: one
    to_probs call over them (a slice when they are consecutive, as in the engine's forward without greedy requests
    between them, else one gather) and `verify_rows`, which reads each request's ℓ_r + 1 rows where they are.
    Ragged lengths (the async scheduler's top-K, a probe's few drafted requests among many) then cost no padded
    [G, width + 1, V] buffer, no zeroing and no second call for the requests that verify nothing; the uniforms, rows
    and draft distributions are each request's own, so its tokens are those of the padded path (tested)."""
    rows, starts = table
    sizes = [counts[r] + 1 for r in group]
    firsts, end = [], starts[group[0]]
    for r, n in zip(group, sizes):
        firsts.append(starts[r] - starts[group[0]])
        end = end + n if starts[r] == end else -1  # -1: not consecutive
    if end >= 0:
        block = rows[starts[group[0]]: end]
    else:
        block = rows.index_select(0, torch.cat([torch.arange(starts[r], starts[r] + n) for r, n in zip(group, sizes)]))
        firsts = [sum(sizes[:i]) for i in range(len(group))]
    probs = to_probs(block, params)  # [Σ (ℓ_r + 1), V]
    width = max(counts[r] for r in group)
    whole = len(group) == drafts.shape[0]
    draft = drafts[:, :width] if whole else drafts[group, :width]
    stops = stop_mask[:, :width] if whole else stop_mask[group, :width]
    q_rows = None
    if draft_rows is not None:
        position = {r: i for i, r in enumerate(draft_rows)}
        missing = [r for r in group if counts[r] and r not in position]
        if missing:
            raise ValueError(f"requests {missing} verify drafts but have no draft distributions (draft_rows)")
        q_rows = [position.get(r, 0) for r in group]  # 0: a request verifying nothing never reads its row
    elif not whole:
        q_rows = group
    num = [counts[r] for r in group]
    uniforms = draw_uniforms(generators, torch.tensor(num), width)
    return verify_rows(draft, None if width == 0 else draft_probs, probs, firsts, num, uniforms, stops, q_rows, vocab)


def _draft_block(draft_probs: torch.Tensor, draft_rows: list[int] | None, group: list[int], idx, width: int
                 ) -> torch.Tensor:
    """[G, width, V] the group's draft distributions; draft_probs holds rows of the requests in draft_rows only
    (None: all, in order)."""
    if draft_rows is None:
        return draft_probs[idx, :width]
    position = {r: i for i, r in enumerate(draft_rows)}
    missing = [r for r in group if r not in position]
    if missing:
        raise ValueError(f"requests {missing} verify drafts but have no draft distributions (draft_rows)")
    return draft_probs[[position[r] for r in group], :width]


CHUNK_ELEMENTS = 4 * 49_152  # logits per shared to_probs call: a cache's worth (4 rows of SmolLM2's vocabulary)


def _sampled_rows(blocks: list[torch.Tensor], params: list[SamplingParams], width: int) -> torch.Tensor:
    """[G, width + 1, V] each request's target distributions (blocks[i]: its ℓ_i + 1 rows of logits), zero past
    its own rows: the padded path, for top-p, logits adjusted per request, requests that process differently, or
    no table (else `_verify_table`, which it is the reference of). Requests that process alike (seeds may differ)
    share to_probs calls of about CHUNK_ELEMENTS logits: one call per request pays top-p's per-call work R times,
    and one call over every row of a step streamed them all through memory, slower at 3 drafts a request
    (scripts/top_p_cost.py measures the path). Exact: to_probs gives a row the same bits whatever shares its call
    (tests/test_decoding.py), so a seeded request's tokens do not depend on its neighbours."""
    rows = torch.empty(len(blocks), width + 1, blocks[0].shape[-1])
    sizes = [block.shape[0] for block in blocks]
    for i, n in enumerate(sizes):  # zero only the slots past a request's own rows (none when ℓ = width)
        if n <= width:
            rows[i, n:] = 0
    kinds: dict = {}
    for i, p in enumerate(params):
        kinds.setdefault(p.processing, []).append(i)
    for members in kinds.values():
        for chunk in _chunks(members, [sizes[i] for i in members], CHUNK_ELEMENTS // rows.shape[-1]):
            probs = to_probs(torch.cat([blocks[i] for i in chunk]), params[chunk[0]])  # [Σ rows, V]
            for i, part in zip(chunk, probs.split([sizes[i] for i in chunk])):
                rows[i, : sizes[i]] = part
    return rows


def _chunks(members: list[int], sizes: list[int], rows: int) -> list[list[int]]:
    """members in runs of at least `rows` rows (the last run may hold fewer); sizes: each member's rows."""
    out, chunk, size = [], [], 0
    for i, n in zip(members, sizes):
        chunk.append(i)
        size += n
        if size >= rows:
            out.append(chunk)
            chunk, size = [], 0
    return out + ([chunk] if chunk else [])


def _argmax_tokens(logits, group: list[int], width: int,  # logits: indexable by request (list or dict)
                   table: tuple[torch.Tensor, list[int]] | None) -> torch.Tensor:
    """[G, width + 1] the target's argmax token at each verified position of the group's requests; past a
    request's ℓ_r + 1 rows the entries are filler that accept_greedy never reads."""
    if table is None:  # the slow reference: one argmax per request
        best = torch.zeros(len(group), width + 1, dtype=torch.long)
        for i, r in enumerate(group):
            best[i, : logits[r].shape[0]] = logits[r].argmax(-1)
        return best
    rows, starts = table
    first = torch.tensor([starts[r] for r in group])  # [G]
    last = first + torch.tensor([logits[r].shape[0] - 1 for r in group])
    lo, hi = int(first.min()), int(last.max()) + 1
    top = greedy_tokens(rows[lo:hi])  # one call over the span: 31 per-request calls cost twice as much at C = 32
    return top[torch.minimum(first.unsqueeze(1) + torch.arange(width + 1), last.unsqueeze(1)) - lo]
