"""min_tokens (vLLM's): before that many tokens the stop tokens have probability 0 in the target's distribution
and stop strings are not matched; the engine's output is exactly that target's, greedy, seeded and in
distribution, whatever the drafter (which drafts without the mask)."""
import pytest
import torch

from dspark.decoding import SamplingError, SamplingParams
from dspark.drafters import make_drafter
from dspark.engine import Generation, TransformerTarget
from dspark.engine.engine import Engine, EngineConfig
from dspark.models import Segment
from dspark.scheduling.registry import make_policy
from test_engine import GAMMA, SPS, ConfidentDrafter, chi_square_p, exact_distribution, run_engine, tiny_target

PROMPT = [1, 4, 2]


def engine(model, eos, policy="fixed-3", drafter=None, max_running=8):
    kwargs = {"sps": SPS} if policy.startswith("async") else {}
    return Engine(model, None, drafter or ConfidentDrafter(), make_policy(policy, **kwargs), eos,
                  EngineConfig(gamma=GAMMA, max_running=max_running))


def naive(model, prompt, eos: int, min_tokens: int, max_new: int) -> list[int]:
    """One full forward per token; the stop token's logit is -inf while fewer than min_tokens are generated."""
    out = []
    while len(out) < max_new:
        ids = torch.tensor(prompt + out)
        logits = model.forward(ids, [Segment(model.new_cache(), 0, len(ids))]).logits[-1].clone()
        if len(out) < min_tokens:
            logits[eos] = float("-inf")
        out.append(int(logits.argmax()))
        if out[-1] == eos:
            break
    return out


def early_token(model) -> int:
    """The second token of the greedy continuation: as EOS it ends an answer after two tokens."""
    free = run_engine(engine(model, ()), [PROMPT], [SamplingParams(temperature=0, max_new_tokens=4)])[0].output
    return free[1]


@pytest.mark.parametrize("drafter,policy", [("ngram", "fixed-3"), ("confident", "async")])
def test_greedy_engine_equals_the_naive_masked_loop(drafter, policy):
    model = tiny_target()
    eos = early_token(model)
    lookup = make_drafter("ngram", gamma=GAMMA) if drafter == "ngram" else None
    free = run_engine(engine(model, (eos,), policy, lookup), [PROMPT], [SamplingParams(temperature=0,
                                                                                      max_new_tokens=24)])[0]
    assert free.output[-1] == eos and len(free.output) <= 2  # without min_tokens it stops at once
    for m in (0, 1, 5, 12):
        params = SamplingParams(temperature=0, max_new_tokens=24, min_tokens=m)
        req = run_engine(engine(model, (eos,), policy, lookup), [PROMPT], [params])[0]
        assert req.output == naive(model, PROMPT, eos, m, 24), m
        assert len(req.output) >= m and eos not in req.output[:m]
        plain = [t for c in Generation(TransformerTarget(model), None, PROMPT, params, (eos,)) for t in c]
        assert plain == req.output  # the single-request loop masks the same rows


def test_seeded_sampling_with_min_tokens_repeats():
    model = tiny_target()
    eos = early_token(model)
    params = [SamplingParams(temperature=0.9, max_new_tokens=12, min_tokens=6, seed=i) for i in range(8)]
    a = run_engine(engine(model, (eos,)), [PROMPT] * 8, params)
    b = run_engine(engine(model, (eos,)), [PROMPT] * 8, params)
    assert [r.output for r in a] == [r.output for r in b]
    assert all(len(r.output) >= 6 and eos not in r.output[:6] for r in a)


@pytest.mark.parametrize("policy", ["fixed-2", "async"])
def test_output_distribution_with_min_tokens_at_batch_512(policy):
    """The first three tokens with the most likely first token as a stop token and min_tokens = 2: the first two
    never stop, the third may (chi-square against the masked target's exact law)."""
    model = tiny_target()
    exact_free = exact_distribution(model, PROMPT, SamplingParams(temperature=1.0, max_new_tokens=3))
    stop = max(range(8), key=lambda t: sum(p for k, p in exact_free.items() if k[0] == t))
    params = SamplingParams(temperature=1.0, max_new_tokens=3, min_tokens=2, stop_token_ids=(stop,))
    n = 20_000
    reqs = run_engine(engine(model, (), policy, max_running=512), [PROMPT] * n,
                      [SamplingParams(**{**params.__dict__, "seed": i}) for i in range(n)])
    exact = exact_distribution(model, PROMPT, params, stops=(stop,))
    assert all(len(r.output) == 3 for r in reqs)
    p = chi_square_p(reqs, exact)
    print(f"{policy}: chi-square p = {p:.3f}")
    assert p > 1e-3
    assert chi_square_p(reqs, exact_free) < 1e-6  # ignoring the mask would fail the test


@pytest.mark.parametrize("bad", [-1, 13, True, 2.5])
def test_invalid_min_tokens_is_refused(bad):
    with pytest.raises(SamplingError, match="min_tokens"):
        SamplingParams(max_new_tokens=12, min_tokens=bad)
