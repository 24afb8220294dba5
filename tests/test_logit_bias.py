"""logit_bias: added to the target's logits before temperature, top-k and top-p; the engine's output is exactly
the biased target's, greedy, seeded and in distribution, whatever the drafter (which samples unbiased here)."""
import pytest

from dspark.decoding import SamplingError, SamplingParams
from dspark.drafters import make_drafter
from dspark.engine import Generation, TransformerTarget
from dspark.engine.engine import Engine, EngineConfig, RequestRejected
from dspark.scheduling.registry import make_policy
from test_engine import GAMMA, SPS, V, ConfidentDrafter, chi_square_p, exact_distribution, run_engine, tiny_target

BIAS = ((3, 2.5), (0, -4.0), (6, 1.0))


def engine(model, policy="fixed-3", max_running=8, drafter=None):
    kwargs = {"sps": SPS} if policy.startswith("async") else {}
    return Engine(model, None, drafter or ConfidentDrafter(), make_policy(policy, **kwargs), (),
                  EngineConfig(gamma=GAMMA, max_running=max_running))


def test_greedy_engine_equals_the_biased_plain_loop():
    model = tiny_target()
    prompts = [[1, 4, 2], [3, 3], [5, 0, 6, 7, 1], [2]]
    biased = SamplingParams(temperature=0, max_new_tokens=24, ignore_eos=True, logit_bias=BIAS)
    lookup = make_drafter("ngram", gamma=GAMMA)  # greedy text of a tiny model repeats: drafts that get accepted
    reqs = run_engine(engine(model, drafter=lookup), prompts, [biased] * len(prompts))
    assert sum(r.accepted for r in reqs) > 0
    for req, prompt in zip(reqs, prompts):
        plain = [t for c in Generation(TransformerTarget(model), None, prompt, biased) for t in c]
        assert req.output == plain
    unbiased = run_engine(engine(model), prompts, [SamplingParams(temperature=0, max_new_tokens=24,
                                                                  ignore_eos=True)] * len(prompts))
    assert [r.output for r in unbiased] != [r.output for r in reqs]  # the bias changed the answers
    forced = run_engine(engine(model), [[1, 2]], [SamplingParams(temperature=0, max_new_tokens=8, ignore_eos=True,
                                                                 logit_bias=((5, 100.0),))])
    assert forced[0].output == [5] * 8


def test_seeded_biased_sampling_repeats():
    model = tiny_target()
    params = [SamplingParams(temperature=0.9, max_new_tokens=10, ignore_eos=True, seed=i, logit_bias=BIAS)
              for i in range(6)]
    a = run_engine(engine(model), [[1, 4, 2]] * 6, params)
    b = run_engine(engine(model), [[1, 4, 2]] * 6, params)
    assert [r.output for r in a] == [r.output for r in b]


@pytest.mark.parametrize("policy", ["fixed-2", "async"])
def test_biased_output_distribution_at_batch_512(policy):
    model = tiny_target()
    params = SamplingParams(temperature=1.0, top_k=6, max_new_tokens=3, ignore_eos=True, logit_bias=BIAS)
    prompt, n = [1, 4, 2], 20_000
    reqs = run_engine(engine(model, policy, 512), [prompt] * n,
                      [SamplingParams(**{**params.__dict__, "seed": i}) for i in range(n)])
    exact = exact_distribution(model, prompt, params)
    p = chi_square_p(reqs, exact)
    print(f"{policy}: chi-square p = {p:.3f}")
    assert p > 1e-3
    plain = exact_distribution(model, prompt, SamplingParams(**{**params.__dict__, "logit_bias": ()}))
    assert sum(abs(exact[k] - plain[k]) for k in exact) / 2 > 0.2  # ignoring the bias would fail the test


@pytest.mark.parametrize("bad", [((1, 101.0),), ((-1, 1.0),), ((1, float("nan")),), ((True, 1.0),), ((1,),)])
def test_invalid_logit_bias_is_refused(bad):
    with pytest.raises(SamplingError, match="logit_bias"):
        SamplingParams(logit_bias=bad)


def test_a_bias_beyond_the_vocabulary_is_refused_at_admission():
    e = engine(tiny_target())
    with pytest.raises(RequestRejected, match="vocabulary"):
        e.add_request([1, 2], SamplingParams(logit_bias=((V, 1.0),)))
    assert not e.waiting and not e.requests
