"""Log-probabilities of emitted tokens: read off the verify forward's rows, equal to one plain forward over the
finished sequence, and read-only (the same tokens with and without them)."""
import pytest
import torch

from dspark.decoding import SamplingError, SamplingParams
from dspark.decoding.logprobs import token_logprobs
from dspark.engine.engine import Engine, EngineConfig
from dspark.models import Segment
from dspark.scheduling.registry import make_policy
from test_engine import GAMMA, ConfidentDrafter, run_engine, tiny_target

PROMPTS = [[1, 4, 2], [3, 3], [5, 0, 6, 7, 1], [2]]


def reference_logprobs(model, prompt, output):
    """log-softmax of one forward over prompt + output: row len(prompt) - 1 + j predicted output[j]."""
    ids = torch.tensor(prompt + output[:-1])
    logits = model.forward(ids, [Segment(model.new_cache(), 0, len(ids))]).logits[len(prompt) - 1:]
    return torch.log_softmax(logits.float(), -1)  # [len(output), V]


def engine_run(model, policy, params, prompts=PROMPTS, stops=()):
    engine = Engine(model, None, ConfidentDrafter(), make_policy(policy), (), EngineConfig(gamma=GAMMA, max_running=8))
    return run_engine(engine, prompts, [SamplingParams(**{**params.__dict__, "seed": i, "stop_token_ids": stops})
                                        for i in range(len(prompts))])


@pytest.mark.parametrize("policy,temperature", [("none", 1.0), ("fixed-3", 1.0), ("fixed-3", 0.0), ("mtp1", 0.7)])
def test_engine_logprobs_equal_one_plain_forward(policy, temperature):
    """Speculative rounds (accepted drafts + bonus), the prefill's first token and max-token cuts, at batch 4."""
    model = tiny_target()
    params = SamplingParams(temperature=temperature, max_new_tokens=11, ignore_eos=True, logprobs=3)
    reqs = engine_run(model, policy, params)
    if policy != "none":
        assert sum(r.accepted for r in reqs) > 0  # drafts were accepted: rows of verify blocks are read
    for req in reqs:
        assert len(req.logprobs) == len(req.output) == 11
        ref = reference_logprobs(model, req.prompt, req.output)
        for j, entry in enumerate(req.logprobs):
            assert entry.token == req.output[j]
            assert entry.logprob == pytest.approx(float(ref[j, entry.token]), abs=1e-4)
            values, ids = ref[j].topk(3)
            assert torch.allclose(torch.tensor([lp for _, lp in entry.top]), values, atol=1e-4)
            for (t, lp), i in zip(entry.top, ids.tolist()):  # a near-tie (gap < 1e-4) may swap two ids
                assert t == i or abs(float(ref[j, t]) - float(ref[j, i])) < 1e-4
            assert [lp for _, lp in entry.top] == sorted((lp for _, lp in entry.top), reverse=True)


def test_logprobs_change_no_token_and_stop_tokens_keep_theirs():
    model = tiny_target()
    base = SamplingParams(temperature=1.0, max_new_tokens=9, ignore_eos=True)
    plain = engine_run(model, "fixed-3", base, stops=(5,))
    asked = engine_run(model, "fixed-3", SamplingParams(**{**base.__dict__, "logprobs": 0}), stops=(5,))
    assert [r.output for r in plain] == [r.output for r in asked]
    assert any(r.finish_reason == "stop" for r in asked)  # a stop token cut a block: its entries are cut too
    for req in asked:
        assert len(req.logprobs) == len(req.output) and all(e.top == () for e in req.logprobs)
    assert all(r.logprobs == [] for r in plain)


def test_token_logprobs_reference_and_empty():
    logits = torch.tensor([[0.0, 1.0, 2.0], [3.0, 0.0, 0.0]])
    out = token_logprobs(logits, [2, 1], top=2)
    ref = torch.log_softmax(logits, -1)
    assert out[0].logprob == pytest.approx(float(ref[0, 2])) and out[1].logprob == pytest.approx(float(ref[1, 1]))
    assert [t for t, _ in out[0].top] == [2, 1] and out[1].top[0][0] == 0
    assert token_logprobs(logits, [], top=2) == []


@pytest.mark.parametrize("bad", [-1, 21, 1.5, True])
def test_invalid_logprobs_are_refused(bad):
    with pytest.raises(SamplingError, match="logprobs"):
        SamplingParams(logprobs=bad)


def test_python_api_completion_carries_the_entries():
    from dspark.engine.llm import completion_of
    model = tiny_target()
    asked, plain = engine_run(model, "fixed-3", SamplingParams(max_new_tokens=5, ignore_eos=True, logprobs=1),
                              prompts=[[1, 2]] * 2), engine_run(model, "none", SamplingParams(max_new_tokens=5),
                                                                prompts=[[1, 2]])
    done = completion_of(asked[0])
    assert done.logprobs == asked[0].logprobs and len(done.logprobs) == len(done.token_ids) == 5
    assert completion_of(plain[0]).logprobs is None
