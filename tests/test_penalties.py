"""Presence and frequency penalties (OpenAI's, on generated tokens): the engine samples exactly from the penalized
target, against a naive reference written here — one full forward per token, the penalty applied from the tokens
generated before it — whatever the drafter drafts (unpenalized) and however many drafts a step verifies (each
verified row counts the drafts before it)."""
import itertools

import numpy as np
import pytest
import torch

from dspark.decoding import SamplingError, SamplingParams, to_probs
from dspark.drafters import make_drafter
from dspark.engine import Generation, TransformerTarget
from dspark.engine.engine import Engine, EngineConfig
from dspark.models import Segment
from dspark.scheduling.registry import make_policy
from test_engine import GAMMA, SPS, V, ConfidentDrafter, chi_square_p, run_engine, tiny_target

PENALTIES = dict(frequency_penalty=1.5, presence_penalty=0.7)


def naive_logits(model, prompt: list[int], generated: list[int], params: SamplingParams) -> torch.Tensor:
    """[V] the next token's logits after prompt + generated, penalized from `generated` alone."""
    ids = torch.tensor(prompt + generated)
    logits = model.forward(ids, [Segment(model.new_cache(), 0, len(ids))]).logits[-1].clone()
    for t in set(generated):
        logits[t] -= params.frequency_penalty * generated.count(t) + params.presence_penalty
    return logits


def engine(model, policy="fixed-3", drafter=None, max_running=8):
    kwargs = {"sps": SPS} if policy.startswith("async") else {}
    return Engine(model, None, drafter or ConfidentDrafter(), make_policy(policy, **kwargs), (),
                  EngineConfig(gamma=GAMMA, max_running=max_running))


def assert_greedy_equals_naive(params: SamplingParams, naive_logits, steps: int = 20) -> None:
    """Greedy engine output (n-gram drafts verified) = the single-request loop = a naive decoding by
    ``naive_logits(model, prompt, generated, params)``, and differs from the unadjusted greedy output."""
    model = tiny_target()
    prompts = [[1, 4, 2], [3, 3], [5, 0, 6, 7, 1]]
    reqs = run_engine(engine(model, drafter=make_drafter("ngram", gamma=GAMMA)), prompts, [params] * 3)
    free = run_engine(engine(model, drafter=make_drafter("ngram", gamma=GAMMA)), prompts,
                      [SamplingParams(temperature=0, max_new_tokens=steps, ignore_eos=True)] * 3)
    assert sum(r.drafted for r in reqs) > 0 and [r.output for r in reqs] != [r.output for r in free]
    for req, prompt in zip(reqs, prompts):
        naive = []
        for _ in range(steps):
            naive.append(int(naive_logits(model, prompt, naive, params).argmax()))
        plain = [t for c in Generation(TransformerTarget(model), None, prompt, params) for t in c]
        assert req.output == plain == naive


def test_greedy_engine_and_plain_loop_equal_the_naive_penalized_decoding():
    assert_greedy_equals_naive(SamplingParams(temperature=0, max_new_tokens=20, ignore_eos=True, **PENALTIES),
                               naive_logits)


def test_seeded_penalized_sampling_repeats():
    model = tiny_target()
    params = [SamplingParams(temperature=1.0, max_new_tokens=10, ignore_eos=True, seed=i, **PENALTIES)
              for i in range(6)]
    a = run_engine(engine(model), [[1, 4, 2]] * 6, params)
    b = run_engine(engine(model), [[1, 4, 2]] * 6, params)
    assert [r.output for r in a] == [r.output for r in b]


def naive_distribution(model, prompt, params, depth=3) -> dict:
    out = {}
    for seq in itertools.product(range(V), repeat=depth):
        p = 1.0
        for j in range(depth):
            probs = to_probs(naive_logits(model, prompt, list(seq[:j]), params)[None], params)[0]
            p *= float(probs[seq[j]])
        out[seq] = p
    return out


def assert_samples_the_naive_law(params: SamplingParams, policy: str, naive_distribution, n: int = 20_000) -> None:
    """n seeded requests at batch 512: chi-square of their three tokens against ``naive_distribution(model,
    prompt, params)``, which lies > 0.1 in total variation from the unadjusted law (ignoring the adjustment fails)."""
    model, prompt = tiny_target(), [1, 4, 2]
    reqs = run_engine(engine(model, policy, max_running=512), [prompt] * n,
                      [SamplingParams(**{**params.__dict__, "seed": i}) for i in range(n)])
    assert sum(r.accepted for r in reqs) > 0  # verified rows after accepted drafts: in-block counting is exercised
    exact = naive_distribution(model, prompt, params)
    p = chi_square_p(reqs, exact)
    print(f"{policy}: chi-square p = {p:.3f}")
    assert p > 1e-3
    plain = naive_distribution(model, prompt, SamplingParams(temperature=params.temperature, top_k=params.top_k,
                                                             max_new_tokens=params.max_new_tokens))
    assert sum(abs(exact[k] - plain[k]) for k in exact) / 2 > 0.1


@pytest.mark.parametrize("policy", ["fixed-2", "async"])
def test_penalized_output_distribution_at_batch_512(policy):
    assert_samples_the_naive_law(SamplingParams(temperature=1.0, top_k=6, max_new_tokens=3, ignore_eos=True,
                                                **PENALTIES), policy, naive_distribution)


@pytest.mark.parametrize("bad", [dict(presence_penalty=2.5), dict(frequency_penalty=-3), dict(presence_penalty="1")])
def test_invalid_penalties_are_refused(bad):
    with pytest.raises(SamplingError, match="penalty"):
        SamplingParams(**bad)
