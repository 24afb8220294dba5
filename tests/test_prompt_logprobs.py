"""Prompt log-probabilities (vLLM's prompt_logprobs; the server's echo): read off the prefill forward's rows,
equal to one plain forward over the prompt whatever the chunking and the batch, read-only, and never taken from a
copied prompt prefix (a copied position has no logits)."""
import pytest
import torch

from dspark.decoding import SamplingError, SamplingParams
from dspark.engine.engine import Engine, EngineConfig
from dspark.models import Segment
from dspark.scheduling.registry import make_policy
from test_engine import GAMMA, ConfidentDrafter, run_engine, tiny_target

PROMPTS = [[1, 4, 2, 6, 6, 3, 7, 0, 5, 2, 1], [3, 3], [5, 0, 6, 7, 1, 2, 2, 4], [2]]


def reference(model, prompt):
    """log-softmax of one forward over the prompt: row j predicted prompt[j + 1]."""
    ids = torch.tensor(prompt)
    logits = model.forward(ids, [Segment(model.new_cache(), 0, len(ids))]).logits[:-1]
    return torch.log_softmax(logits.float(), -1)  # [len(prompt) - 1, V]


def check(model, req, top):
    ref = reference(model, req.prompt)
    assert len(req.prompt_logprobs) == len(req.prompt) - 1
    for j, entry in enumerate(req.prompt_logprobs):
        assert entry.token == req.prompt[j + 1]
        assert entry.logprob == pytest.approx(float(ref[j, entry.token]), abs=1e-4)
        values, _ = ref[j].topk(top)
        assert torch.allclose(torch.tensor([lp for _, lp in entry.top], dtype=torch.float32), values, atol=1e-4)


@pytest.mark.parametrize("chunk,policy", [(512, "none"), (3, "fixed-3"), (4, "mtp1")])
def test_prompt_logprobs_equal_one_plain_forward_at_batch_4(chunk, policy):
    """Whole prompts and prompts cut into chunks of 3 or 4 tokens, fused with other requests' verify blocks."""
    model = tiny_target()
    engine = Engine(model, None, ConfidentDrafter(), make_policy(policy), (),
                    EngineConfig(gamma=GAMMA, max_running=8, prefill_chunk=chunk))
    params = [SamplingParams(temperature=1.0, max_new_tokens=6, ignore_eos=True, seed=i,
                             prompt_logprobs=2 if i % 2 == 0 else None) for i in range(len(PROMPTS))]
    reqs = run_engine(engine, PROMPTS, params)
    for req in reqs:
        if req.params.prompt_logprobs is None:
            assert req.prompt_logprobs == []
        else:
            check(model, req, 2)
    assert reqs[2].prompt_logprobs and reqs[3].prompt_logprobs == []  # a one-token prompt has none


def test_prompt_logprobs_change_no_token():
    model = tiny_target()
    base = dict(temperature=1.0, max_new_tokens=9, ignore_eos=True)

    def run(**extra):
        engine = Engine(model, None, ConfidentDrafter(), make_policy("fixed-3"), (),
                        EngineConfig(gamma=GAMMA, prefill_chunk=4))
        return run_engine(engine, PROMPTS, [SamplingParams(**base, seed=i, **extra) for i in range(len(PROMPTS))])

    assert [r.output for r in run()] == [r.output for r in run(prompt_logprobs=0)]


def test_a_request_asking_for_them_computes_its_whole_prompt_and_still_lends_it():
    """Prefix reuse skips it (its copied positions would have no logits), but others may copy from it."""
    target = tiny_target()
    engine = Engine(target, None, None, make_policy("none"), (),
                    EngineConfig(gamma=GAMMA, prefill_chunk=8, prefix_min_tokens=4))
    prompt = [3, 4, 5, 3, 4, 5, 3, 4, 1, 0, 7, 6]
    greedy = dict(temperature=0, max_new_tokens=8, ignore_eos=True)
    first = run_engine(engine, [prompt], [SamplingParams(**greedy)])[0]
    scored, copier = run_engine(engine, [prompt + [1], prompt + [2]],
                                [SamplingParams(**greedy, prompt_logprobs=1), SamplingParams(**greedy)])
    assert first.cached_tokens == 0 and scored.cached_tokens == 0
    assert copier.cached_tokens == len(prompt)  # from the finished donor or the scoring request
    check(target, scored, 1)


@pytest.mark.parametrize("bad", [-1, 21, 1.5, True])
def test_invalid_prompt_logprobs_are_refused(bad):
    with pytest.raises(SamplingError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=bad)


def test_python_api_completion_carries_them():
    from dspark.engine.llm import completion_of
    model = tiny_target()
    engine = Engine(model, None, None, make_policy("none"), (), EngineConfig(gamma=GAMMA))
    asked, plain = run_engine(engine, [[1, 2, 3], [1, 2, 3]],
                              [SamplingParams(max_new_tokens=2, prompt_logprobs=0), SamplingParams(max_new_tokens=2)])
    assert completion_of(asked).prompt_logprobs == asked.prompt_logprobs and len(asked.prompt_logprobs) == 2
    assert completion_of(plain).prompt_logprobs is None
