"""vLLM's repetition_penalty (transformers' rule, on the prompt and the generated tokens): the engine samples
exactly from the penalized target, against a naive reference written here — one full forward per token, every
token seen in prompt + generated divided (positive logit) or multiplied (negative) by the penalty — whatever the
drafter drafts (unpenalized) and however many drafts a step verifies (each verified row sees the drafts before
it)."""
import pytest
import torch

from dspark.decoding import SamplingError, SamplingParams, to_probs
from dspark.models import Segment
from test_engine import V, run_engine, tiny_target
from test_penalties import assert_greedy_equals_naive, assert_samples_the_naive_law, engine

REP = 1.8


def naive_logits(model, prompt: list[int], generated: list[int], params: SamplingParams) -> torch.Tensor:
    """[V] the next token's logits after prompt + generated, penalized on every token seen in either."""
    ids = torch.tensor(prompt + generated)
    logits = model.forward(ids, [Segment(model.new_cache(), 0, len(ids))]).logits[-1].clone()
    for t in set(prompt + generated):
        logits[t] = logits[t] / params.repetition_penalty if logits[t] > 0 else logits[t] * params.repetition_penalty
    return logits


def naive_distribution(model, prompt, params, depth=3) -> dict:
    frontier = [((), 1.0)]
    for _ in range(depth):
        grown = []
        for seq, p in frontier:
            q = to_probs(naive_logits(model, prompt, list(seq), params)[None], params)[0]
            grown += [(seq + (t,), p * float(q[t])) for t in range(V)]
        frontier = grown
    return dict(frontier)


def test_greedy_engine_and_plain_loop_equal_the_naive_penalized_decoding():
    assert_greedy_equals_naive(SamplingParams(temperature=0, max_new_tokens=20, ignore_eos=True,
                                              repetition_penalty=REP), naive_logits)


def test_the_prompt_counts_from_the_first_token():
    """The first token (sampled at the end of prefill) already sees the prompt's tokens penalized."""
    model = tiny_target()
    prompt = [1, 4, 2]
    top = int(naive_logits(model, prompt, [], SamplingParams(repetition_penalty=1.0)).argmax())
    prompt = prompt + [top]  # the unpenalized favourite is now in the prompt
    params = SamplingParams(temperature=0, max_new_tokens=1, ignore_eos=True, repetition_penalty=50.0)
    first = run_engine(engine(model), [prompt], [params])[0].output[0]
    assert first == int(naive_logits(model, prompt, [], params).argmax())
    assert first != int(naive_logits(model, prompt, [], SamplingParams(repetition_penalty=1.0)).argmax())


def test_seeded_penalized_sampling_repeats():
    model = tiny_target()
    params = [SamplingParams(temperature=1.0, max_new_tokens=10, ignore_eos=True, seed=i, repetition_penalty=REP)
              for i in range(6)]
    a = run_engine(engine(model, "async"), [[1, 4, 2]] * 6, params)
    b = run_engine(engine(model, "async"), [[1, 4, 2]] * 6, params)
    assert [r.output for r in a] == [r.output for r in b]


def test_penalized_output_distribution_at_batch_512():
    assert_samples_the_naive_law(SamplingParams(temperature=1.0, top_k=6, max_new_tokens=3, ignore_eos=True,
                                                repetition_penalty=REP), "fixed-2", naive_distribution)


@pytest.mark.parametrize("bad", [0.0, -1.0, 101.0, "2", True, float("nan")])
def test_invalid_repetition_penalties_are_refused(bad):
    with pytest.raises(SamplingError, match="repetition_penalty"):
        SamplingParams(repetition_penalty=bad)
