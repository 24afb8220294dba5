"""The Markov head's block of draws in one C call (drafters/markov_draws.py) against the torch loop it replaces:
the same drafts and distributions, the same randomness spent, each slot drawn from exactly the distribution handed
to verification, and lossless greedy decoding through it."""
import pytest
import torch
from scipy.stats import chisquare

from dspark.decoding import SamplingParams, make_generator
from dspark.drafters import markov_draws
from dspark.drafters.base import DraftRequest
from dspark.drafters.draft_kernels import BF16_C_ROWS, bf16_c_rows
from dspark.models import native
from dspark.models.transformer import Segment

from dspark_testlib import speculative, tiny_drafter, tiny_target

pytestmark = pytest.mark.skipif(markov_draws.kernel() is None, reason="the C draws did not build here")
VOCAB = 4096  # the smallest vocabulary the two-level draw splits into blocks (sampling.by_blocks)


@pytest.fixture(scope="module")
def target():
    return tiny_target(vocab=VOCAB, hidden=64, layers=2, seed=3, scale=4.0)


def observed(target, drafter, params: list[SamplingParams], seed: int = 0) -> list[DraftRequest]:
    """Requests whose prompts the target has prefilled and the drafter observed, the first token appended."""
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(0, VOCAB - 1, (5 + i,), generator=g).tolist() for i in range(len(params))]
    requests = [DraftRequest(tokens=list(p), params=q, generator=make_generator(10 + i))
                for i, (p, q) in enumerate(zip(prompts, params))]
    for r in requests:
        cache = target.new_cache(capacity=32)
        out = target.forward(torch.tensor(r.tokens), [Segment(cache, 0, len(r.tokens))],
                             hidden_layers=drafter.needs_layers)
        drafter.observe_batch([r], out.hidden, [0], [len(r.tokens)])
        r.tokens.append(int(out.logits[-1].argmax()))
    return requests


def propose_both(drafter, requests):
    """(fused, torch loop) proposals from the same generator states; also the generators' states after each."""
    states = [r.generator.get_state() for r in requests]
    with torch.inference_mode():  # as in propose
        assert markov_draws.applies(drafter.model, torch.zeros(1, 1, VOCAB), requests)
    fused = drafter.propose(requests)
    after = [r.generator.get_state() for r in requests]
    for r, s in zip(requests, states):
        r.generator.set_state(s)
    applies = markov_draws.applies
    markov_draws.applies = lambda *args: False
    try:
        loop = drafter.propose(requests)
    finally:
        markov_draws.applies = applies
    return fused, loop, after, [r.generator.get_state() for r in requests]


@pytest.mark.parametrize("bf16,requests", [(False, 6), (True, 6), (True, BF16_C_ROWS + 2)])
def test_fused_draws_equal_the_torch_loop(target, bf16, requests):
    """Greedy and sampled requests in one batch (6 rows: the kernel's rows run in parallel from 4), a Markov head
    that matters: the same drafted tokens, distributions within float rounding (the kernel's softmax), the same
    uniforms consumed; the W2 product is the torch path's own C kernel, so greedy logits are the same bits. Where
    the bf16 C kernel serves only a few rows (AVX2), more requests than that take the fp32 one, in both paths."""
    if bf16 and native.kernel_bf16() is None:
        pytest.skip("no bf16 C kernel on this CPU")
    if requests > 6 and bf16_c_rows() is None:
        pytest.skip("bf16 serves every row count on this CPU: the 6-request case covers it")
    drafter = tiny_drafter(target, rank=8, block=4, head_scale=0.5, bf16=bf16)
    params = [SamplingParams(temperature=t) for t in (0.0, 1.0, 0.7, 1.0, 0.0, 1.3, 1.0, 0.0, 0.9, 1.0)[:requests]]
    for seed in range(3):
        fused, loop, after_fused, after_loop = propose_both(drafter, observed(target, drafter, params, seed))
        assert torch.equal(fused.tokens, loop.tokens)
        torch.testing.assert_close(fused.probs, loop.probs, rtol=0, atol=2e-6)
        assert all(torch.equal(a, b) for a, b in zip(after_fused, after_loop))
        assert torch.equal(fused.confidence_logits, loop.confidence_logits)
    greedy = [SamplingParams(temperature=0.0)] * 5
    fused, loop, _, _ = propose_both(drafter, observed(target, drafter, greedy))
    assert fused.probs is None and loop.probs is None and torch.equal(fused.tokens, loop.tokens)


def test_the_torch_loop_runs_where_the_kernel_does_not_apply(target):
    drafter, rnn = tiny_drafter(target, rank=8, block=4), tiny_drafter(target, head="rnn", rank=8, block=4)
    base = torch.zeros(2, 4, VOCAB)
    processed = [observed(target, drafter, [SamplingParams(), params])
                 for params in (SamplingParams(top_p=0.9), SamplingParams(top_k=5), SamplingParams(min_p=0.1))]
    plain = observed(target, drafter, [SamplingParams()] * 2)
    with torch.inference_mode():  # as in propose
        assert not any(markov_draws.applies(drafter.model, base, r) for r in processed)  # torch's to_probs
        assert markov_draws.applies(drafter.model, base, plain)
        assert not markov_draws.applies(drafter.model, torch.zeros(2, 4, 96), plain)  # no blocks to split
        assert not markov_draws.applies(rnn.model, base, plain)


@pytest.mark.parametrize("bf16", [False, True])
def test_each_slot_is_drawn_from_the_distribution_it_hands_to_verification(target, bf16):
    """8,000 draws of slot 1 for one context (rows alike, uniforms apart): the counts fit the stored row
    (invariant 1; chi-square over its 24 likeliest tokens and the rest pooled, p > 0.001). bf16: calls of
    BF16_C_ROWS requests, so that where only the bf16 C kernel is fast (AVX2) its W2 product is the one drawn."""
    if bf16 and native.kernel_bf16() is None:
        pytest.skip("no bf16 C kernel on this CPU")
    drafter = tiny_drafter(target, rank=8, block=4, head_scale=0.5, bf16=bf16)
    request = observed(target, drafter, [SamplingParams(temperature=1.0)])[0]
    model = drafter.model
    assert model.vocab_ids is None
    counts, row = torch.zeros(VOCAB, dtype=torch.float64), None
    size = BF16_C_ROWS if bf16 else 1000
    for chunk in range(8000 // size):
        reqs = [DraftRequest(tokens=request.tokens, params=request.params, generator=make_generator(size * chunk + i),
                             state=request.state) for i in range(size)]
        base = torch.randn(1, 1, VOCAB, generator=torch.Generator().manual_seed(0)).expand(size, 1, VOCAB)
        probs = torch.empty(size, 1, VOCAB)
        with torch.inference_mode():
            tokens = markov_draws.draw_block(model, base.contiguous(), torch.full((size,), 7), reqs, probs)
        assert torch.equal(probs[0, 0].expand(size, VOCAB), probs[:, 0])  # the same row each time
        row = probs[0, 0].double()
        counts += torch.bincount(tokens[:, 0], minlength=VOCAB).double()  # no draft vocabulary: ids are rows
    top = row.topk(24).indices
    rest = torch.ones(VOCAB, dtype=torch.bool)
    rest[top] = False
    observed_counts = torch.cat([counts[top], counts[rest].sum().view(1)])
    expected = torch.cat([row[top], row[rest].sum().view(1)])
    expected = expected / expected.sum() * counts.sum()  # the fp32 row sums to 1 within rounding
    assert chisquare(observed_counts.numpy(), expected.numpy()).pvalue > 1e-3


@pytest.mark.parametrize("bf16", [False, True])
def test_greedy_speculation_through_the_kernel_equals_plain_decoding(target, bf16):
    if bf16 and native.kernel_bf16() is None:
        pytest.skip("no bf16 C kernel on this CPU")
    drafter = tiny_drafter(target, rank=8, block=4, head_scale=0.5, bf16=bf16)
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, VOCAB - 1, (6,), generator=g).tolist() for _ in range(3)]
    if bf16:  # seeded sampling repeats with the same seeds, one request at a time (the bf16 C kernel's rows)
        sampled = [speculative(target, drafter, prompts[:1], SamplingParams(temperature=1.0), 12, seeds=[s])
                   for s in (4, 4, 5)]
        assert sampled[0] == sampled[1] != sampled[2]
    got = speculative(target, drafter, prompts, SamplingParams(temperature=0.0), 12, seeds=[0, 1, 2])
    for prompt, tokens in zip(prompts, got):
        cache, seq = target.new_cache(capacity=32), list(prompt)
        logits = target.forward(torch.tensor(seq), [Segment(cache, 0, len(seq))]).logits[-1]
        want = []
        for _ in range(12):
            want.append(int(logits.argmax()))
            logits = target.forward(torch.tensor(want[-1:]), [Segment(cache, len(seq) + len(want) - 1, 1)]).logits[-1]
        assert tokens == want
