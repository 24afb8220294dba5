"""vLLM's min_p: after temperature, tokens less likely than min_p × the most likely one are dropped, before top-k
and top-p. Like them it shapes the draft's q and the target's p alike (invariant 2), so the engine's output follows
the filtered target — checked here against a numpy reference, with a stochastic drafter whose drafts are accepted."""
import numpy as np
import pytest
import torch

from dspark.decoding import SamplingError, SamplingParams, to_probs
from dspark.models import Segment
from test_engine import ConfidentDrafter, V, chi_square_p, run_engine, tiny_target
from test_penalties import engine


def reference_probs(logits: np.ndarray, temperature: float, min_p: float, top_k: int = 0,
                    top_p: float = 1.0) -> np.ndarray:
    """[V] the sampled law, in vLLM's order: temperature, min_p on the probabilities, top-k, top-p."""
    x = logits.astype(np.float64) / temperature
    p = np.exp(x - x.max())
    p /= p.sum()
    keep = p >= min_p * p.max()
    if top_k:
        keep &= x >= np.sort(x[keep])[-min(top_k, keep.sum())]
    p = np.where(keep, p, 0.0)
    p /= p.sum()
    if top_p < 1:
        order = np.argsort(-p, kind="stable")
        before = np.cumsum(p[order]) - p[order]
        p[order[before >= top_p]] = 0.0
        p /= p.sum()
    return p


@pytest.mark.parametrize("temperature,min_p,top_k,top_p", [(1.0, 0.1, 0, 1.0), (0.5, 0.3, 0, 1.0),
                                                            (2.0, 0.05, 20, 0.9), (1.0, 1.0, 0, 1.0)])
def test_to_probs_applies_min_p_after_temperature_before_top_k_and_top_p(temperature, min_p, top_k, top_p):
    logits = torch.randn(4, 64, generator=torch.Generator().manual_seed(1)) * 3
    params = SamplingParams(temperature=temperature, min_p=min_p, top_k=top_k, top_p=top_p)
    ours = to_probs(logits, params).double().numpy()
    for row, got in zip(logits.numpy(), ours):
        np.testing.assert_allclose(got, reference_probs(row, temperature, min_p, top_k, top_p), atol=1e-6)
    assert (ours > 0).sum() < (to_probs(logits, SamplingParams(temperature=temperature)) > 0).sum()


def test_min_p_one_samples_the_argmax_exactly_as_greedy():
    """min_p = 1 keeps only the most likely token, so sampling at T = 1 through drafts must reproduce greedy
    decoding token for token."""
    model = tiny_target()
    prompts = [[1, 4, 2], [3, 3], [5, 0, 6, 7, 1]]
    sampled = run_engine(engine(model, "async", ConfidentDrafter()), prompts,
                         [SamplingParams(temperature=1.0, min_p=1.0, max_new_tokens=20, ignore_eos=True, seed=i)
                          for i in range(3)])
    greedy = run_engine(engine(model, "fixed-2", ConfidentDrafter()), prompts,
                        [SamplingParams(temperature=0, max_new_tokens=20, ignore_eos=True)] * 3)
    assert sum(r.accepted for r in sampled) > 0
    assert [r.output for r in sampled] == [r.output for r in greedy]


def test_seeded_min_p_sampling_repeats():
    model = tiny_target()
    params = [SamplingParams(temperature=1.0, min_p=0.2, max_new_tokens=10, ignore_eos=True, seed=i)
              for i in range(6)]
    a = run_engine(engine(model, "async", ConfidentDrafter()), [[1, 4, 2]] * 6, params)
    b = run_engine(engine(model, "async", ConfidentDrafter()), [[1, 4, 2]] * 6, params)
    assert [r.output for r in a] == [r.output for r in b]


def reference_distribution(model, prompt, params, depth=3) -> dict:
    frontier = [((), 1.0)]
    for _ in range(depth):
        grown = []
        for seq, p in frontier:
            ids = torch.tensor(prompt + list(seq))
            logits = model.forward(ids, [Segment(model.new_cache(), 0, len(ids))]).logits[-1].numpy()
            q = reference_probs(logits, params.temperature, params.min_p)
            grown += [(seq + (t,), p * q[t]) for t in range(V)]
        frontier = grown
    return dict(frontier)


def test_min_p_output_distribution_at_batch_512():
    model = tiny_target()
    params = SamplingParams(temperature=0.1, min_p=0.3, max_new_tokens=3, ignore_eos=True)  # tiny_target is flat
    prompt, n = [1, 4, 2], 20_000
    reqs = run_engine(engine(model, "async", ConfidentDrafter(), max_running=512), [prompt] * n,
                      [SamplingParams(**{**params.__dict__, "seed": i}) for i in range(n)])
    assert sum(r.accepted for r in reqs) > 0  # drafts (sampled under min_p) were verified and kept
    exact = reference_distribution(model, prompt, params)
    p = chi_square_p(reqs, exact)
    print(f"chi-square p = {p:.3f}")
    assert p > 1e-3
    free = reference_distribution(model, prompt, SamplingParams(temperature=0.1))
    assert sum(abs(exact[k] - free[k]) for k in exact) / 2 > 0.2  # ignoring min_p would fail the test


@pytest.mark.parametrize("bad", [-0.1, 1.5, "0.1", True])
def test_invalid_min_p_is_refused(bad):
    with pytest.raises(SamplingError, match="min_p"):
        SamplingParams(min_p=bad)
