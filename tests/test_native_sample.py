"""The C two-level draw (decoding/native_sample.c) against the full fp64 CDF search and torch's two-level path:
the same tokens on awkward rows, never a token of zero mass, and a row's token whatever shares its call."""
import pytest
import torch

from dspark.decoding import native_sample
from dspark.decoding.sampling import CDF_BLOCK, SamplingParams, _sample_by_blocks, sample_from, to_probs

pytestmark = pytest.mark.skipif(native_sample.kernel() is None,
                                reason="the sampling kernel did not build here (no C compiler or DSPARK_NATIVE=0)")


def full_cdf(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    cdf = probs.double().cumsum(-1)
    return torch.searchsorted(cdf, (u * cdf[:, -1]).unsqueeze(-1), right=True).squeeze(-1)


def awkward_rows(rows: int = 64, vocab: int = 64 * CDF_BLOCK, seed: int = 0):
    """Spread, top-p-truncated (mostly zeros) and one-token rows (the mass on a block's last token), with
    uniforms next to 1 on every fourth row."""
    g = torch.Generator().manual_seed(seed)
    probs = torch.softmax(torch.randn(rows, vocab, generator=g) * 4, -1)
    probs[rows // 2:] = to_probs(torch.log(probs[rows // 2:]), SamplingParams(top_p=0.8))
    probs[-4:] = 0.0
    probs[-4:, 3 * CDF_BLOCK - 1] = 1.0
    u = torch.rand(rows, generator=g, dtype=torch.float64)
    u[::4] = 1.0 - 2 ** -53
    return probs, u


def test_kernel_draws_the_full_cdf_and_torch_tokens_on_awkward_rows():
    probs, u = awkward_rows()
    got = native_sample.sample_blocks(probs, u)
    assert torch.equal(got, full_cdf(probs, u)) and torch.equal(got, _sample_by_blocks(probs, u))
    assert bool((probs.gather(-1, got.unsqueeze(-1)) > 0).all())


def test_kernel_agrees_with_torch_over_many_real_width_draws():
    g = torch.Generator().manual_seed(1)
    probs = torch.softmax(torch.randn(2000, 192 * CDF_BLOCK, generator=g) * 3, -1)  # SmolLM2's 49,152 tokens
    u = torch.rand(2000, generator=g, dtype=torch.float64)
    assert torch.equal(native_sample.sample_blocks(probs, u), _sample_by_blocks(probs, u))


def test_kernel_never_draws_a_token_of_zero_mass():
    probs, _ = awkward_rows()
    row = probs[40:41].expand(20_000, -1).contiguous()  # top-p truncated: most tokens have no mass
    u = torch.rand(20_000, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    assert bool((probs[40, native_sample.sample_blocks(row, u)] > 0).all())


@pytest.mark.parametrize("threads", [1, 2])
def test_a_rows_token_does_not_depend_on_its_call(threads):
    probs, u = awkward_rows(rows=24)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        batch = native_sample.sample_blocks(probs, u)
        alone = torch.cat([native_sample.sample_blocks(probs[i:i + 1], u[i:i + 1]) for i in range(24)])
    finally:
        torch.set_num_threads(before)
    assert torch.equal(batch, alone)


def test_sample_from_takes_the_kernel_only_where_it_applies(monkeypatch):
    probs, u = awkward_rows(rows=8)
    calls = []
    monkeypatch.setattr(native_sample, "sample_blocks", lambda p, v: calls.append(p.shape) or _sample_by_blocks(p, v))
    assert torch.equal(sample_from(probs, u), full_cdf(probs, u)) and calls == [probs.shape]
    assert not native_sample.usable(probs.double()) and not native_sample.usable(probs[:, :-1])  # fp64, part block
    assert not native_sample.usable(probs.t().contiguous().t())  # rows not contiguous
    small = torch.softmax(torch.randn(3, 1000), -1)  # under 16 blocks: one fp64 cumsum, no kernel
    sample_from(small, torch.rand(3, dtype=torch.float64))
    assert calls == [probs.shape]


def test_rows_apart_in_memory_draw_what_their_contiguous_copy_draws():
    """The drafter samples slot k of its [R, γ, V] buffer: rows a γ·V stride apart go through the kernel as they
    are (no copy) and draw the tokens of the same rows made contiguous."""
    probs, u = awkward_rows(rows=12)
    block = probs.view(4, 3, -1)  # [R, γ, V]
    for k in range(3):
        view = block[:, k]
        assert not view.is_contiguous() and native_sample.usable(view)
        assert torch.equal(native_sample.sample_blocks(view, u[:4]), full_cdf(view.contiguous(), u[:4]))
        assert torch.equal(sample_from(view, u[:4]), native_sample.sample_blocks(view.contiguous(), u[:4]))


def test_seeded_draws_through_the_kernel_repeat_and_equal_torchs():
    """A request's generator drives its draws: the same seed gives the same tokens through the kernel, and the
    tokens the torch path draws from those uniforms."""
    probs, _ = awkward_rows(rows=16)
    draws = []
    for _ in range(2):
        g = torch.Generator().manual_seed(11)
        u = torch.rand(16, generator=g, dtype=torch.float64)
        draws.append((sample_from(probs, u), _sample_by_blocks(probs, u)))
    assert torch.equal(draws[0][0], draws[1][0]) and torch.equal(draws[0][0], draws[0][1])


def test_kernel_draws_follow_the_distribution_chi_square():
    """60,000 draws from one row of 4,096 tokens (16 blocks: the kernel's smallest vocabulary) whose mass sits
    on 24 tokens spread over the blocks, the rest a sliver: the counts fit the probabilities (chi-square, 24
    cells plus the sliver pooled, p > 0.001)."""
    from scipy.stats import chisquare

    g = torch.Generator().manual_seed(0)
    vocab, n = 16 * CDF_BLOCK, 60_000
    probs = torch.full((vocab,), 1e-5)  # ~4 % of the mass, spread thin
    heavy = torch.randperm(vocab, generator=g)[:24]
    probs[heavy] = torch.rand(24, generator=g) + 0.2
    probs /= probs.sum()
    tokens = native_sample.sample_blocks(probs.expand(n, vocab).contiguous(),
                                         torch.rand(n, generator=g, dtype=torch.float64))
    counts = torch.bincount(tokens, minlength=vocab).double()
    rest = torch.ones(vocab, dtype=torch.bool)
    rest[heavy] = False
    observed = torch.cat([counts[heavy], counts[rest].sum().view(1)])
    expected = torch.cat([probs[heavy].double(), probs[rest].double().sum().view(1)]) * n
    assert chisquare(observed.numpy(), expected.numpy() * observed.sum().item() / expected.sum().item()).pvalue > 1e-3


def next_token_case(seed: int, q_kind: str, vocab: int = 64 * CDF_BLOCK, R: int = 24, gamma: int = 4):
    """A verified step's tensors as verify hands them to draw_next: target rows [R, γ+1, V] (spread, top-p-truncated
    and one-token rows), draft rows [R, γ, V] ("dist"; a few equal to the target's row at their slot, which leaves no
    residual mass) or point masses on the drafts ("point"; some on a token the target gives all its mass), accepted
    and rejected per row, uniforms next to 1 on some rows."""
    g = torch.Generator().manual_seed(seed)
    rows, u = awkward_rows(rows=R * (gamma + 1), vocab=vocab, seed=seed)
    target = rows[torch.randperm(len(rows), generator=g)].view(R, gamma + 1, vocab)
    accepted = torch.randint(0, gamma + 1, (R,), generator=g)
    rejected = (accepted < gamma) & (torch.rand(R, generator=g) < 0.7)
    drafts = torch.randint(0, vocab, (R, gamma), generator=g)
    q = None
    if q_kind == "dist":
        q = torch.softmax(torch.randn(R, gamma, vocab, generator=g) * 3, -1)
        for r in range(0, R, 5):
            k = min(int(accepted[r]), gamma - 1)
            q[r, k] = target[r, k]  # p == q: the rejection had probability 0
    else:
        for r in range(0, R, 3):
            k = min(int(accepted[r]), gamma - 1)
            drafts[r, k] = int(target[r, k].argmax())
        k = min(int(accepted[0]), gamma - 1)
        target[0, k] = 0.0
        target[0, k, 7] = 1.0
        drafts[0, k], rejected[0] = 7, bool(accepted[0] < gamma)  # the target's only token: p - 1 leaves nothing
    return drafts, q, target, accepted, rejected, u[:R]


@pytest.mark.parametrize("q_kind", ["dist", "point"])
def test_next_token_draw_equals_the_torch_reference(q_kind):
    """verify's draw after the accepted drafts (residual where a draft was rejected, else the bonus) in one C call
    gives the tokens of the torch reference — the residual rows gathered, computed and drawn by sample_from — on
    contiguous, sliced and broadcast tensors, and a row's token whatever shares its call."""
    import importlib

    verify_module = importlib.import_module("dspark.decoding.verify")  # the module; the package exports its function
    assert verify_module.native_sample.next_kernel() is not None
    threads = torch.get_num_threads()
    torch.set_num_threads(2)  # 24 rows: the kernel splits them across threads
    try:
        check_next_token_draws(verify_module, q_kind)
    finally:
        torch.set_num_threads(threads)


def check_next_token_draws(verify_module, q_kind):
    for seed in range(3):
        drafts, q, target, accepted, rejected, u = next_token_case(seed, q_kind)
        want = verify_module._draw_next_reference(drafts, q, target, accepted, rejected, u)
        got = verify_module.draw_next(drafts, q, target, accepted, rejected, u)
        assert torch.equal(got, want)
        alone = torch.cat([verify_module.draw_next(drafts[r:r + 1], None if q is None else q[r:r + 1],
                                                   target[r:r + 1], accepted[r:r + 1], rejected[r:r + 1], u[r:r + 1])
                           for r in range(len(u))])
        assert torch.equal(got, alone)
        width = 2  # views of a wider buffer, as verify_requests hands them over
        keep = accepted <= width
        narrow = [t[keep] for t in (drafts, accepted, rejected & (accepted < width), u)]
        args = (narrow[0][:, :width], None if q is None else q[keep][:, :width], target[keep][:, :width + 1],
                narrow[1], narrow[2], narrow[3])
        assert torch.equal(verify_module.draw_next(*args), verify_module._draw_next_reference(*args))
    p = target[0].expand(8, *target.shape[1:])  # stride 0 over requests, as tests broadcast one law
    args = (drafts[:8], None if q is None else q[0].expand(8, *q.shape[1:]), p, accepted[:8], rejected[:8], u[:8])
    assert torch.equal(verify_module.draw_next(*args), verify_module._draw_next_reference(*args))


@pytest.mark.parametrize("q_kind", ["dist", "point"])
def test_verification_through_the_kernel_emits_the_target_law(q_kind):
    """verify over 4,096 tokens (the C next-token draw serves it): 60,000 one-draft blocks whose draft law q differs
    from the target's p, point masses included; the first emitted token follows p (chi-square over the 12 tokens
    holding p's and q's mass, the rest pooled, p > 0.001)."""
    from scipy.stats import chisquare

    from dspark.decoding import verify

    g = torch.Generator().manual_seed(4)
    R, vocab = 60_000, 16 * CDF_BLOCK
    heavy = torch.randperm(vocab, generator=g)[:12]
    p, q = torch.full((2, vocab), 1e-7), torch.full((vocab,), 1e-7)
    p[:, heavy] = torch.rand(2, 12, generator=g) + 0.1
    q[heavy[::2]] = torch.rand(6, generator=g) + 0.1  # q puts no mass on half of p's tokens: the residual must
    p, q = p / p.sum(-1, keepdim=True), q / q.sum()
    drafts = torch.multinomial(q, R, replacement=True, generator=g).view(R, 1)  # skewed, so a wrong residual shows
    law = None if q_kind == "point" else q.view(1, 1, vocab).expand(R, 1, vocab)  # point: each row's own draft
    res = verify(drafts, law, p.view(1, 2, vocab).expand(R, 2, vocab), torch.ones(R, dtype=torch.long),
                 torch.rand(R, 2, generator=g, dtype=torch.float64))
    first = torch.where(res.accepted > 0, drafts[:, 0], res.next_token)
    counts = torch.bincount(first, minlength=vocab).double()
    rest = torch.ones(vocab, dtype=torch.bool)
    rest[heavy] = False
    observed = torch.cat([counts[heavy], counts[rest].sum().view(1)])
    expected = torch.cat([p[0, heavy].double(), p[0, rest].double().sum().view(1)])
    expected = expected / expected.sum() * R
    assert chisquare(observed.numpy(), expected.numpy()).pvalue > 1e-3
