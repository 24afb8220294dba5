"""The C greedy draw (native_sample.c's dspark_argmax_rows) against torch.argmax, its slow reference: the same
token on ties, NaN, infinities, signed zeros and every tail length, whatever shares its call; and greedy_tokens
routes only what it may to the kernel."""
import pytest
import torch

from dspark.decoding import native_sample
from dspark.decoding.sampling import SamplingParams, greedy_tokens, to_probs
from dspark.decoding.verify import verify, verify_greedy

pytestmark = pytest.mark.skipif(native_sample.argmax_kernel() is None,
                                reason="the sampling kernel did not build here (no C compiler or DSPARK_NATIVE=0)")


def awkward_logits(rows: int = 40, vocab: int = 4099, seed: int = 0) -> torch.Tensor:
    """Random rows, then rows with exact ties (near the start, across lanes and chains, in the tail), a NaN, all
    -inf, +inf twice, signed zeros, rounded values that tie often, and the maximum in the very last slot."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, vocab, generator=g) * 5
    x[1, 3] = x[1, vocab // 2] = 40.0
    x[2, 31] = x[2, 32] = 40.0  # the last lane of one 32-wide block and the first of the next
    x[3, vocab - 2] = x[3, vocab - 1] = 40.0  # both in the tail past the whole blocks
    x[4, 17] = float("nan")
    x[5, vocab // 4] = 40.0
    x[5, vocab // 2] = float("nan")  # a NaN after the maximum still wins, as in torch
    x[6] = float("-inf")
    x[7, 10] = x[7, 11] = float("inf")
    x[8] = 0.0
    x[8, :5] = -0.0
    x[9] = torch.round(x[9] / 5)  # many exact ties at the top
    x[10, vocab - 1] = 99.0
    return x


def test_kernel_gives_torchs_argmax_on_awkward_rows():
    x = awkward_logits()
    assert torch.equal(native_sample.argmax(x), x.argmax(-1))


@pytest.mark.parametrize("vocab", [1024, 1025, 1031, 1055, 1056, 16384, 49152])
def test_every_tail_length_and_real_vocabularies(vocab):
    x = awkward_logits(rows=12, vocab=vocab, seed=vocab)
    x[11, -1] = 1e9  # the maximum in the last slot, whatever the tail
    assert torch.equal(native_sample.argmax(x), x.argmax(-1))


@pytest.mark.parametrize("threads", [1, 2])
def test_a_rows_token_does_not_depend_on_its_call(threads):
    x = awkward_logits(rows=24)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        batch = native_sample.argmax(x)
        alone = torch.cat([native_sample.argmax(x[i:i + 1]) for i in range(24)])
    finally:
        torch.set_num_threads(before)
    assert torch.equal(batch, alone) and torch.equal(batch, x.argmax(-1))


def test_shapes_views_and_what_stays_with_torch(monkeypatch):
    x = awkward_logits(rows=12)
    block = x.view(3, 4, -1)  # [R, γ+1, V] as verification holds them
    assert torch.equal(greedy_tokens(block), block.argmax(-1)) and greedy_tokens(block).shape == (3, 4)
    strided = x[:, ::2]  # rows not contiguous: copied once, same tokens
    assert torch.equal(greedy_tokens(strided), strided.argmax(-1))
    calls = []
    monkeypatch.setattr(native_sample, "_argmax_call", lambda fn, rows: calls.append(rows.shape) or rows.argmax(-1))
    for other in (x.double(), x.bfloat16(), x[:, :100], x.clone().requires_grad_()):  # not fp32 / a short row
        assert torch.equal(greedy_tokens(other), other.argmax(-1))
    assert calls == []
    greedy_tokens(x)
    assert calls == [x.shape]


def test_greedy_paths_through_the_kernel_equal_their_torch_forms():
    """to_probs's one-hot and greedy verification: the same tokens as torch's argmax, ties included."""
    x = awkward_logits(rows=12, vocab=2048)
    x = x[torch.isfinite(x).all(-1)]  # verification's logits are finite
    x[0, 5] = x[0, 6] = 1e3
    one_hot = to_probs(x, SamplingParams(temperature=0))
    assert torch.equal(one_hot.argmax(-1), x.argmax(-1)) and torch.equal(one_hot.sum(-1), torch.ones(len(x)))
    logits = x[:6].view(2, 3, -1)  # two requests verifying two drafts each
    best = logits.argmax(-1)  # [2, 3]
    drafts = best[:, :2].clone()
    drafts[1, 1] += 1  # request 1's second draft is wrong
    num = torch.tensor([2, 2])
    fast = verify_greedy(drafts, logits, num)
    p = torch.zeros_like(logits).scatter_(-1, best.unsqueeze(-1), 1.0)
    q = torch.zeros(2, 2, logits.shape[-1]).scatter_(-1, drafts.unsqueeze(-1), 1.0)
    slow = verify(drafts, q, p, num, torch.full((2, 3), 0.5))
    assert fast.accepted.tolist() == slow.accepted.tolist() == [2, 1]
    assert torch.equal(fast.next_token, slow.next_token)
