"""Unit tests of logits processing and verification (the pure functions under the loop)."""
import pytest
import torch
from scipy.stats import chisquare

from dspark.decoding import SamplingError, SamplingParams, draw_uniforms, sample_from, to_probs, verify, verify_greedy


@pytest.mark.parametrize("kwargs,match", [
    (dict(temperature=-0.1), "temperature"), (dict(temperature=float("nan")), "temperature"),
    (dict(top_p=0.0), "top_p"), (dict(top_p=1.5), "top_p"), (dict(top_k=-1), "top_k"),
    (dict(top_k=2.5), "top_k"), (dict(max_new_tokens=0), "max_new_tokens"),
])
def test_invalid_sampling_params_are_rejected(kwargs, match):
    with pytest.raises(SamplingError, match=match):
        SamplingParams(**kwargs)


def test_processing_top_k_top_p_and_greedy():
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0]])
    assert to_probs(logits, SamplingParams(temperature=0)).tolist() == [[1.0, 0, 0, 0, 0]]
    p = to_probs(logits, SamplingParams(top_k=2))
    assert (p[0, 2:] == 0).all() and torch.isclose(p.sum(), torch.tensor(1.0))
    full = torch.softmax(logits, -1)[0]
    p = to_probs(logits, SamplingParams(top_p=float(full[0] + 1e-3)))  # needs the top two tokens
    assert (p[0] > 0).tolist() == [True, True, False, False, False]
    assert to_probs(logits, SamplingParams(top_p=0.01))[0].tolist() == [1.0, 0, 0, 0, 0]


def test_sampling_never_picks_zero_mass():
    probs = torch.tensor([[0.0, 0.5, 0.0, 0.5, 0.0]]).expand(10_000, 5)
    tokens = sample_from(probs, torch.rand(10_000, dtype=torch.float64))
    assert set(tokens.tolist()) == {1, 3}
    edge = sample_from(probs[:2], torch.tensor([0.0, 1.0 - 2 ** -53], dtype=torch.float64))
    assert edge.tolist() == [1, 3]


def _first_emitted(res, drafts):
    return torch.where(res.accepted > 0, drafts[:, 0], res.next_token)


@pytest.mark.parametrize("q_kind", ["uniform", "peaked", "point"])
def test_verify_slot_law_is_target(q_kind):
    """Vectorised over 200k rows: the first emitted token is distributed as p_1 for any draft law q_1."""
    g = torch.Generator().manual_seed(0)
    R, V, gamma = 200_000, 6, 2
    p = torch.softmax(torch.randn(gamma + 1, V, generator=g) * 1.5, -1)
    q = {"uniform": torch.full((gamma, V), 1 / V),
         "peaked": torch.softmax(torch.randn(gamma, V, generator=g) * 4, -1),
         "point": torch.eye(V)[[int(p[0].argmin()), 0]]}[q_kind]
    drafts = torch.stack([sample_from(q[k].expand(R, V), torch.rand(R, generator=g, dtype=torch.float64))
                          for k in range(gamma)], 1)
    res = verify(drafts, None if q_kind == "point" else q.expand(R, gamma, V), p.expand(R, gamma + 1, V),
                 torch.full((R,), gamma), torch.rand(R, gamma + 1, generator=g, dtype=torch.float64))
    counts = torch.bincount(_first_emitted(res, drafts), minlength=V).double()
    expected = p[0].double() / p[0].double().sum() * R
    assert chisquare(counts.numpy(), expected.numpy()).pvalue > 1e-3


def test_verify_greedy_equals_verify_on_point_masses():
    g = torch.Generator().manual_seed(1)
    R, V, gamma = 64, 10, 5
    logits = torch.randn(R, gamma + 1, V, generator=g)
    best = logits.argmax(-1)
    drafts = torch.where(torch.rand(R, gamma, generator=g) < 0.7, best[:, :gamma], (best[:, :gamma] + 1) % V)
    num = torch.randint(0, gamma + 1, (R,), generator=g)
    stops = torch.tensor([3])
    a = verify_greedy(drafts, logits, num, stops)
    greedy = SamplingParams(temperature=0)
    b = verify(drafts, to_probs(logits[:, :gamma], greedy), to_probs(logits, greedy), num,
               torch.rand(R, gamma + 1, generator=g, dtype=torch.float64), stops)
    for field in ("accepted", "next_token", "stopped"):
        assert torch.equal(getattr(a, field), getattr(b, field)), field


def test_accepted_stop_token_ends_without_bonus():
    logits = torch.full((1, 4, 5), -5.0)
    for slot, tok in enumerate([1, 2, 4, 0]):
        logits[0, slot, tok] = 5.0
    drafts = torch.tensor([[1, 2, 4]])
    res = verify_greedy(drafts, logits, torch.tensor([3]), stop_ids=torch.tensor([2]))
    assert res.emitted(drafts, 0) == [1, 2] and bool(res.stopped[0])
    res = verify_greedy(drafts, logits, torch.tensor([3]))
    assert res.emitted(drafts, 0) == [1, 2, 4, 0]


def test_rejection_draws_replacement_from_residual():
    p = torch.tensor([[[0.5, 0.5, 0.0], [1.0, 0.0, 0.0]]])
    q = torch.tensor([[[0.0, 1.0, 0.0]]])
    # u·q = 0.6 >= p = 0.5 rejects token 1; the residual max(0, p − q) is all on token 0.
    res = verify(torch.tensor([[1]]), q, p, torch.tensor([1]), torch.tensor([[0.6, 0.99]], dtype=torch.float64))
    assert res.accepted.tolist() == [0] and res.next_token.tolist() == [0]


def test_batched_verification_equals_per_request_reference():
    """verify_requests (buffers as wide as the longest block, greedy by per-request argmax, or by one batched
    argmax over the rows of a shared table) against each request verified alone with full γ + 1 buffers, the
    slow reference: same tokens, same generator states after."""
    from dspark.decoding.batch import verify_requests

    gamma, vocab, g = 5, 11, torch.Generator().manual_seed(0)
    lengths = torch.tensor([0, 3, 1, 0, 2, 3])
    params = [SamplingParams(temperature=0 if r % 3 == 0 else 0.8, top_k=0 if r % 2 else 6) for r in range(6)]
    logits = [torch.randn(int(n) + 1, vocab, generator=g) * 3 for n in lengths]
    drafts = torch.randint(0, vocab, (6, gamma), generator=g)
    for r, n in enumerate(lengths):  # make some drafts the target's argmax, so greedy rows accept a few
        drafts[r, : int(n) // 2 + 1] = logits[r][: int(n) // 2 + 1].argmax(-1)[: gamma]
    q = torch.softmax(torch.randn(6, gamma, vocab, generator=g), -1)
    stop = torch.zeros(6, gamma, dtype=torch.bool)
    stop[4, 0] = True
    gens = [torch.Generator().manual_seed(10 + r) for r in range(6)]
    got = verify_requests(logits, drafts, lengths, q, params, gens, stop)
    table = torch.cat([torch.randn(2, vocab, generator=g), *logits])  # the requests' rows after two others
    starts = [2 + int((lengths[:r] + 1).sum()) for r in range(6)]
    views = [table[s: s + int(n) + 1] for s, n in zip(starts, lengths)]
    gens_b = [torch.Generator().manual_seed(10 + r) for r in range(6)]
    batched = verify_requests(views, drafts, lengths, q, params, gens_b, stop, table=(table, starts))
    assert all(torch.equal(getattr(got, f), getattr(batched, f)) for f in ("accepted", "next_token", "stopped"))
    for r in range(6):
        full = torch.zeros(1, gamma + 1, vocab)
        n = int(lengths[r])
        if params[r].greedy:
            full[0, : n + 1] = logits[r]
            want = verify_greedy(drafts[r:r + 1], full, lengths[r:r + 1], stop[r:r + 1])
        else:
            full[0, : n + 1] = to_probs(logits[r], params[r])
            ref_gen = torch.Generator().manual_seed(10 + r)
            u = draw_uniforms([ref_gen], lengths[r:r + 1], gamma)
            want = verify(drafts[r:r + 1], q[r:r + 1], full, lengths[r:r + 1], u, stop[r:r + 1])
            assert torch.equal(gens[r].get_state(), ref_gen.get_state())
        assert (int(got.accepted[r]), int(got.next_token[r]), bool(got.stopped[r])) == \
            (int(want.accepted[0]), int(want.next_token[0]), bool(want.stopped[0])), r
    assert int(got.accepted.sum()) > 0 and bool(got.stopped[4])


def test_a_probe_verifies_its_drafted_rows_apart_with_only_their_draft_distributions():
    """A probe drafts a few requests of the batch: sampled requests that verify drafts and those that verify none
    are verified apart, the drafted ones from draft distributions of their rows only (``draft_rows``), the others
    from one gather of their rows. Each request's tokens and generator are those of it verified alone."""
    from dspark.decoding.batch import verify_requests

    gamma, vocab, g = 5, 11, torch.Generator().manual_seed(3)
    lengths = torch.tensor([0, 3, 0, 0, 2, 0])
    params = [SamplingParams(temperature=0.8)] * 6
    table = torch.randn(int((lengths + 1).sum()), vocab, generator=g) * 3
    starts = [int((lengths[:r] + 1).sum()) for r in range(6)]
    views = [table[s: s + int(n) + 1] for s, n in zip(starts, lengths)]
    drafts = torch.randint(0, vocab, (6, gamma), generator=g)
    drafts[1, 0], drafts[4, 0] = views[1][0].argmax(), views[4][0].argmax()  # likely accepted: both paths tested
    q = torch.softmax(torch.randn(6, gamma, vocab, generator=g), -1)
    stop = torch.zeros(6, gamma, dtype=torch.bool)

    def run(probs, rows, seed=20):
        gens = [torch.Generator().manual_seed(seed + r) for r in range(6)]
        return verify_requests(views, drafts, lengths, probs, params, gens, stop, table=(table, starts),
                               draft_rows=rows), gens

    (whole, _), (probe, gens) = run(q, None), run(q[[1, 4]], [1, 4])
    assert all(torch.equal(getattr(whole, f), getattr(probe, f)) for f in ("accepted", "next_token", "stopped"))
    for r in range(6):
        n = int(lengths[r])
        full = torch.zeros(1, gamma + 1, vocab)
        full[0, : n + 1] = to_probs(views[r], params[r])
        ref_gen = torch.Generator().manual_seed(20 + r)
        u = draw_uniforms([ref_gen], lengths[r:r + 1], gamma)
        want = verify(drafts[r:r + 1], q[r:r + 1], full, lengths[r:r + 1], u, stop[r:r + 1])
        assert (int(probe.accepted[r]), int(probe.next_token[r])) == (int(want.accepted[0]), int(want.next_token[0]))
        assert torch.equal(gens[r].get_state(), ref_gen.get_state())
    assert int(probe.accepted.sum()) > 0
    with pytest.raises(ValueError, match=r"requests \[4\] verify drafts"):
        run(q[[1]], [1])


def full_sort_top_p(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """The reference: sort the whole row, drop every token with top_p of mass before it."""
    sorted_p, order = probs.sort(dim=-1, descending=True)
    kept = sorted_p.masked_fill(sorted_p.cumsum(-1) - sorted_p >= top_p, 0.0)
    return torch.zeros_like(probs).scatter_(-1, order, kept / kept.cumsum(-1)[..., -1:])


@pytest.mark.parametrize("top_p", [0.5, 0.9, 0.999])
def test_top_p_from_candidates_equals_a_full_sort(top_p):
    """_top_p ranks only the most likely 256 (then 4,096) tokens of a row, and sorts the row only when they hold
    less than top_p: peaked rows (first candidates), flat rows (a full sort), a batch mixing both (each row
    escalates alone), a [R, γ, V] block, and a vocabulary smaller than the candidates."""
    from dspark.decoding.sampling import _top_p

    g = torch.Generator().manual_seed(0)
    vocab = 20_000
    peaked = torch.randn(6, vocab, generator=g) * 6
    flat = torch.randn(3, vocab, generator=g) * 0.5
    middle = torch.randn(3, vocab, generator=g) * 2.5  # top 256 short of top_p, top 4,096 enough (for most p)
    for logits in (peaked, flat, torch.cat([flat[:1], peaked, middle, flat[1:]]), peaked.reshape(2, 3, vocab),
                   torch.randn(4, 100, generator=g)):
        probs = torch.softmax(logits, -1)
        assert torch.equal(_top_p(probs, top_p), full_sort_top_p(probs, top_p))
    def top_mass(logits, k):
        return torch.softmax(logits, -1).topk(k, -1).values.sum(-1)

    assert bool((top_mass(peaked, 256) > 0.99).all())  # the three kinds of row take the three paths
    assert bool((top_mass(middle, 256) < 0.9).all()) and bool((top_mass(middle, 4096) > 0.9).all())
    assert bool((top_mass(flat, 4096) < 0.5).all())


def test_two_level_sampling_equals_the_full_cdf():
    """sample_from over large batches searches the block masses, then one block (_sample_by_blocks): the tokens
    of a full fp64 CDF search, peaked and top-p-truncated rows, and never a token or block of zero mass — even at
    uniforms next to 1 and on rows whose mass sits in one token at a block's end."""
    from dspark.decoding.sampling import CDF_BLOCK, _sample_by_blocks

    g, vocab = torch.Generator().manual_seed(0), 64 * CDF_BLOCK
    probs = torch.softmax(torch.randn(64, vocab, generator=g) * 4, -1)
    probs[32:] = to_probs(torch.log(probs[32:]), SamplingParams(top_p=0.8))  # mostly zeros
    probs[60:, :] = 0.0
    probs[60:, 3 * CDF_BLOCK - 1] = 1.0  # one token, the last of its block
    u = torch.rand(64, generator=g, dtype=torch.float64)
    u[::4] = 1.0 - 2 ** -53
    cdf = probs.double().cumsum(-1)
    full = torch.searchsorted(cdf, (u * cdf[:, -1]).unsqueeze(-1), right=True).squeeze(-1)
    got = _sample_by_blocks(probs, u)
    assert torch.equal(got, full) and torch.equal(sample_from(probs, u), got)
    assert bool((probs.gather(-1, got.unsqueeze(-1)) > 0).all())
    many = _sample_by_blocks(probs[32:33].expand(20_000, vocab).contiguous(), torch.rand(20_000, generator=g,
                                                                                     dtype=torch.float64))
    assert bool((probs[32, many] > 0).all())


@pytest.fixture
def two_threads():
    """A sum over a row of the real vocabulary's width is split across threads when a call holds fewer rows than
    threads: with two, that shows on any machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(threads)


@pytest.mark.parametrize("params", [SamplingParams(temperature=1.0, top_p=0.9), SamplingParams(temperature=0.7),
                                    SamplingParams(temperature=1.3, top_k=50, top_p=0.95, min_p=0.01)],
                         ids=["top-p", "temperature", "all"])
def test_each_row_is_processed_alike_whatever_shares_its_call(params, two_threads):
    """to_probs gives a row the same bits in a call of one row as in a call of many: a seeded request's tokens must
    not depend on how many rows its call held (its ℓ, or the requests batched with it). The split sum of
    two_threads is what broke this for top-p's normalisation."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(12, 49_152, generator=g) * torch.tensor([0.5, 2.0, 6.0]).repeat(4).unsqueeze(-1)
    together = to_probs(logits, params)
    for i in range(len(logits)):
        assert torch.equal(to_probs(logits[i:i + 1], params)[0], together[i]), i
    assert torch.equal(to_probs(logits.view(3, 4, -1), params).view(12, -1), together)


def test_shared_to_probs_calls_give_each_request_its_own_bits(two_threads):
    """Verification processes the rows of requests that process alike in shared calls (seeds and ℓ differing):
    every request's target distributions must be bit for bit those of its own call."""
    from dspark.decoding.batch import _sampled_rows

    g = torch.Generator().manual_seed(1)
    lengths = [0, 3, 1, 0, 2, 0, 0, 1]
    blocks = [torch.randn(n + 1, 49_152, generator=g) * (0.5 + r % 3 * 2) for r, n in enumerate(lengths)]
    params = [SamplingParams(temperature=1.0, top_p=0.9 if r % 4 else 1.0, seed=r) for r in range(8)]
    rows = _sampled_rows(blocks, params, max(lengths))
    for r, (block, p) in enumerate(zip(blocks, params)):
        assert torch.equal(rows[r, : len(block)], to_probs(block, p)), r
        assert not rows[r, len(block):].any()


@pytest.mark.parametrize("params", [SamplingParams(temperature=1.0), SamplingParams(temperature=0.7, top_k=50),
                                    SamplingParams(temperature=1.3, min_p=0.05)])
@pytest.mark.parametrize("vocab", [49_152, 11])  # the C next-token draw, and the torch reference below a block
def test_rows_where_they_lie_verify_as_the_padded_buffers(two_threads, params, vocab):
    """The engine's case: the sampled requests' rows lie in the forward's logits tensor (`table`), ragged (the async
    scheduler's top-K lengths), some verifying nothing, greedy requests between them, or only a probe's few
    drafted (`draft_rows`), with point-mass drafts or draft distributions and stop tokens. `_verify_table` (one
    to_probs call over the rows where they lie, `verify_rows`) must give the padded path's tokens and leave every
    generator in the same state: the same rows, uniforms and tests, so the same bits."""
    from unittest import mock

    from dspark.decoding import batch
    from dspark.decoding.batch import verify_requests

    g = torch.Generator().manual_seed(2)
    R, gamma = 7, 4
    cases = 0
    for trial in range(6):
        lengths = torch.randint(0, gamma + 1, (R,), generator=g)
        lengths[trial % R] = 0
        kinds = [params if (r + trial) % 4 else SamplingParams(temperature=0) for r in range(R)] if trial % 2 \
            else [params] * R  # greedy rows between the sampled ones on odd trials: a gather, not a slice
        starts = [3 + int((lengths[:r] + 1).sum()) for r in range(R)]
        table = torch.randn(starts[-1] + int(lengths[-1]) + 1, vocab, generator=g) * 3
        blocks = [table[s: s + int(n) + 1] for s, n in zip(starts, lengths)]
        drafts = torch.randint(0, vocab, (R, gamma), generator=g)
        for r, n in enumerate(lengths.tolist()):  # likely under the target, so that runs of drafts are accepted
            drafts[r, :n] = blocks[r][:n].argmax(-1)
            boosted = torch.arange(0, n, 2)  # slots 0, 2: all but sure; slots 1, 3 keep their odds (rejections)
            blocks[r][boosted, drafts[r, boosted]] += 8.0  # in place: the rows of the table
        stop = torch.rand(R, gamma, generator=g) < 0.1
        q = torch.randn(R, gamma, vocab, generator=g) * 3
        q.scatter_add_(-1, drafts.unsqueeze(-1), torch.full((R, gamma, 1), 10.0))  # drafted where q is high
        q = torch.softmax(q, -1)
        drafted = [r for r in range(R) if lengths[r]]
        for probs, rows in ((q, None), (None, None), (q[drafted], drafted)):

            def verified(seed=trial):
                gens = [torch.Generator().manual_seed(seed * 100 + r) for r in range(R)]
                out = verify_requests(blocks, drafts, lengths, probs, kinds, gens, stop, table=(table, starts),
                                      draft_rows=rows)
                return out, [gen.get_state() for gen in gens]

            with mock.patch.object(batch, "_verify_table", wraps=batch._verify_table) as spy:
                fast, fast_states = verified()
            assert spy.call_count == 1
            with mock.patch.object(batch, "_one_softmax", lambda *args: False):
                slow, slow_states = verified()
            for field in ("accepted", "next_token", "stopped"):
                assert torch.equal(getattr(fast, field), getattr(slow, field)), (trial, field)
            assert all(torch.equal(a, b) for a, b in zip(fast_states, slow_states))
            cases += 1
            assert int(fast.accepted.sum()) > 0 and bool((fast.accepted < lengths).any())  # accepts and rejects
    assert cases == 18


def test_accepted_runs_equal_the_tensor_rule():
    """verify's accepted-run loop against the rule in tensor form (leading run of accepts among the first ℓ_r,
    cut after the first accepted stop token), on random acceptances, lengths and stop masks."""
    from dspark.decoding.verify import _accepted_runs

    g = torch.Generator().manual_seed(3)
    for gamma in (0, 1, 4, 7):
        R = 50
        ok = torch.rand(R, gamma, generator=g) < 0.7
        num = torch.randint(0, gamma + 1, (R,), generator=g)
        stop = torch.rand(R, gamma, generator=g) < 0.15
        slots = torch.arange(gamma)
        want = (ok & (slots < num.unsqueeze(1))).long().cumprod(-1).sum(-1)
        hit = stop & (slots < want.unsqueeze(1))
        want_stopped = hit.any(-1)
        want = torch.where(want_stopped, (~hit).long().cumprod(-1).sum(-1) + 1, want)
        for stops in (stop, None):
            accepted, stopped = _accepted_runs(ok.tolist(), num.tolist(), None if stops is None else stops.tolist())
            if stops is None:
                plain = (ok & (slots < num.unsqueeze(1))).long().cumprod(-1).sum(-1)
                assert torch.equal(accepted, plain) and not stopped.any()
            else:
                assert torch.equal(accepted, want) and torch.equal(stopped, want_stopped)


@pytest.mark.parametrize("vocab_size", [49_152, 12])  # the C next-token draw, and the torch reference
def test_draft_distributions_in_a_draft_vocabulary_verify_as_scattered_ones(two_threads, vocab_size):
    """A drafter with a draft vocabulary hands verification q over that vocabulary (verify.DraftVocab) instead of
    scattering it into [R, γ, V]: the acceptance tests read q at each draft's draft position, and the residual row
    max(0, p − q) is written from the compact row (p itself elsewhere, p − 0 bit for bit). Same tokens as the
    scattered q, through `verify` and `verify_rows`, with rejections and acceptances both."""
    from dspark.decoding.verify import DraftVocab, verify_rows

    g = torch.Generator().manual_seed(5)
    R, gamma = 6, 4
    ids = torch.randperm(vocab_size, generator=g)[: vocab_size // 3 if vocab_size > 100 else 8].sort().values
    vocab = DraftVocab.of(ids, vocab_size)
    assert torch.equal(vocab.local(ids), torch.arange(len(ids)))
    local = torch.randint(0, len(ids), (R, gamma), generator=g)
    drafts = ids[local]
    q = torch.randn(R, gamma, len(ids), generator=g) * 3
    q.scatter_add_(-1, local.unsqueeze(-1), torch.full((R, gamma, 1), 6.0))
    q = torch.softmax(q, -1)
    full = vocab.full(q)
    assert full.shape == (R, gamma, vocab_size) and torch.equal(full[..., ids], q)
    logits = torch.randn(R, gamma + 1, vocab_size, generator=g) * 3
    logits[:, :gamma].scatter_add_(-1, drafts.unsqueeze(-1), torch.full((R, gamma, 1), 5.0))  # often accepted
    p = torch.softmax(logits, -1)
    num = torch.tensor([0, 1, 2, 3, 4, 4])
    seen = torch.zeros(2, dtype=torch.long)
    for trial in range(5):
        u = torch.rand(R, gamma + 1, generator=g, dtype=torch.float64)
        a = verify(drafts, full, p, num, u)
        b = verify(drafts, q, p, num, u, vocab=vocab)
        first = [r * (gamma + 1) for r in range(R)]
        c = verify_rows(drafts, q, p.view(-1, vocab_size), first, num.tolist(), u, vocab=vocab)
        for res in (b, c):
            for f in ("accepted", "next_token", "stopped"):
                assert torch.equal(getattr(a, f), getattr(res, f)), (trial, f)
        seen += torch.stack([(a.accepted < num).sum(), a.accepted.sum()])
    assert int(seen[0]) > 0 and int(seen[1]) > 0  # rejections (residual draws) and acceptances
