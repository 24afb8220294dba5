"""The batched engine: exact against the single-request path, lossless at batch > 1 under every policy."""
import itertools

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from dspark.decoding import SamplingError, SamplingParams, sample_from, to_probs
from dspark.decoding.sampling import target_logits
from dspark.drafters import make_drafter
from dspark.drafters.base import Drafter, Proposal
from dspark.engine import Generation, TransformerTarget
from dspark.engine.engine import Engine, EngineConfig, RequestRejected
from dspark.models import Segment
from dspark.scheduling.registry import make_policy
from helpers import TINY, bench_prompts, chat_ids, hf_model, ours_from_hf

V, GAMMA = 8, 3


def run_engine(engine, prompts, params):
    reqs = [engine.add_request(p, sp) for p, sp in zip(prompts, params)]
    while engine.has_unfinished():
        engine.step()
    return reqs


def test_greedy_engine_equals_single_request_plain_decoding(smollm2, bench_data):
    """16 mixed prompts in one batch (prefill chunked and fused with verification) vs one-at-a-time."""
    model, tok, eos = smollm2.model, smollm2.tokenizer, smollm2.eos_ids
    prompts = [chat_ids(tok, t) for t in bench_prompts(4)][:16]
    greedy = SamplingParams(temperature=0, max_new_tokens=24)
    engine = Engine(model, tok, make_drafter("ngram", gamma=5), make_policy("fixed-5"), eos,
                    EngineConfig(gamma=5, prefill_chunk=300))
    reqs = run_engine(engine, prompts, [greedy] * len(prompts))
    assert sum(r.accepted for r in reqs) > 0
    for req, ids in zip(reqs, prompts):
        single = [t for c in Generation(TransformerTarget(model), None, ids, greedy, eos) for t in c]
        assert req.output == single, req.request_id
    assert engine.kv_reserved == 0 and not engine.running


class ConfidentDrafter(Drafter):
    """A stochastic drafter with a confidence per slot that depends on the token drafted before it."""

    name = "test-confident"
    has_confidence = True

    def __init__(self, gamma=GAMMA):
        super().__init__(gamma)
        g = torch.Generator().manual_seed(5)
        self.table = torch.randn(V, V, generator=g) * 2
        self.conf = torch.rand(V, generator=g) * 0.8 + 0.1

    def propose(self, requests, depth=None):  # always γ drafts: more than `depth` is allowed
        R = len(requests)
        tokens, probs = torch.zeros(R, self.gamma, dtype=torch.long), torch.zeros(R, self.gamma, V)
        conf = torch.zeros(R, self.gamma)
        # Batched over requests (one loop per request took 18 of a 47 s chi-square test at batch 512): each
        # request's slots read its own processed table rows and its own generator's uniforms.
        u = torch.stack([torch.rand(self.gamma, generator=req.generator, dtype=torch.float64) for req in requests])
        groups: dict = {}
        for i, req in enumerate(requests):
            groups.setdefault(req.params.processing, []).append(i)
        q_table = torch.empty(R, V, V)  # [R, prev, V]: to_probs of every table row under each request's settings
        for rows in groups.values():
            q_table[rows] = to_probs(self.table, requests[rows[0]].params)
        prev, every = torch.tensor([req.tokens[-1] for req in requests]), torch.arange(R)
        for k in range(self.gamma):
            q = q_table[every, prev]  # [R, V]
            conf[:, k] = self.conf[prev]  # depends on the token sampled at slot k-1
            prev = sample_from(q, u[:, k])
            tokens[:, k], probs[:, k] = prev, q
        return Proposal(tokens=tokens, num_tokens=torch.full((R,), self.gamma), probs=probs, confidences=conf)


def tiny_target():
    raw = dict(TINY["llama"], vocab_size=V)
    TINY["_v8"] = raw
    return ours_from_hf(hf_model("_v8", seed=3))


def exact_distribution(model, prompt, params, depth=3, stops=()):
    """P(first `depth` tokens) under the target as `params` samples it (its logit_bias and, with the stop tokens
    given, min_tokens included)."""
    out = {}
    for seq in itertools.product(range(V), repeat=depth):
        ids = torch.tensor(prompt + list(seq[:-1]))
        logits = model.forward(ids, [Segment(model.new_cache(), 0, len(ids))]).logits[len(prompt) - 1:]
        probs = to_probs(target_logits(logits, params, stops=stops), params)
        out[seq] = float(np.prod([float(probs[i, t]) for i, t in enumerate(seq)]))
    return out


def chi_square_p(reqs, exact: dict) -> float:
    """Chi-square p-value of the requests' outputs against the exact distribution (cells expecting < 5 pooled)."""
    n, counts = len(reqs), {}
    for r in reqs:
        counts[tuple(r.output)] = counts.get(tuple(r.output), 0) + 1
    keys = [k for k in exact if exact[k] * n >= 5]
    obs = np.array([counts.get(k, 0) for k in keys] + [n - sum(counts.get(k, 0) for k in keys)], dtype=float)
    exp = np.array([exact[k] * n for k in keys] + [n - sum(exact[k] * n for k in keys)])
    return chisquare(obs, exp * obs.sum() / exp.sum()).pvalue


SPS = lambda b: 1.0 / (0.010 + 1e-5 * np.maximum(np.asarray(b, dtype=float) - 64, 0))  # noqa: E731


@pytest.mark.parametrize("policy", ["fixed-2", "sync", "async", "async-online", "threshold"])
def test_engine_output_distribution_at_batch_512(policy):
    model = tiny_target()
    params = SamplingParams(temperature=1.0, top_k=6, max_new_tokens=3, ignore_eos=True)
    kwargs = ({"sps": SPS} if policy == "sync" or policy.startswith("async")
              else {"threshold": 0.4} if policy == "threshold" else {})
    engine = Engine(model, None, ConfidentDrafter(), make_policy(policy, **kwargs), (),
                    EngineConfig(gamma=GAMMA, max_running=512))
    prompt, n = [1, 4, 2], 20_000
    reqs = run_engine(engine, [prompt] * n, [SamplingParams(**{**params.__dict__, "seed": i}) for i in range(n)])
    p = chi_square_p(reqs, exact_distribution(model, prompt, params))
    print(f"{policy}: chi-square p = {p:.3f}, mean accepted {np.mean([r.accepted / r.rounds for r in reqs]):.2f}")
    assert p > 1e-3


def test_engine_output_distribution_through_the_in_place_verification():
    """The path that verifies sampled requests where their rows lie in the forward's logits (batch._verify_table:
    one to_probs call, ragged blocks, no padded copy) carries plain sampled decoding at batch 512, and the output
    still follows the target's law (with drafts it carries the chi-square tests above, ragged blocks included). It
    is compared with the padded path bit for bit in test_decoding.py."""
    from unittest import mock

    from dspark.decoding import batch

    model = tiny_target()
    params = SamplingParams(temperature=1.0, top_k=6, max_new_tokens=3, ignore_eos=True)
    policy = "none"
    engine = Engine(model, None, None, make_policy(policy), (), EngineConfig(gamma=GAMMA, max_running=512))
    prompt, n = [1, 4, 2], 20_000
    with mock.patch.object(batch, "_verify_table", wraps=batch._verify_table) as spy:
        reqs = run_engine(engine, [prompt] * n, [SamplingParams(**{**params.__dict__, "seed": i}) for i in range(n)])
    assert spy.call_count > 10
    p = chi_square_p(reqs, exact_distribution(model, prompt, params))
    print(f"{policy}: chi-square p = {p:.3f}, {spy.call_count} steps verified in place")
    assert p > 1e-3


def test_engine_reports_verify_steps_to_a_live_priced_policy_but_not_prefill():
    """What scheduling/live_profile.py corrects the profile with: (B, R) of each forward that had no prefill in it,
    its time and its commit's, and the proposal's requests, depth and time, with its feeding's apart."""
    base, seen = make_policy("fixed-2"), []
    spy = type("Spy", (), {"prepare": lambda self, r: base.prepare(r), "draft_depth": lambda self, g: base.draft_depth(g),
                           "select": lambda self, c=None, **kw: base.select(c, **kw),
                           "observes_steps": True, "observe_step": lambda self, *a, **kw: seen.append((*a, kw))})()
    engine = Engine(tiny_target(), None, ConfidentDrafter(), spy, (), EngineConfig(gamma=GAMMA, max_running=2,
                                                                                    prefill_chunk=2))
    reqs = [engine.add_request(p, SamplingParams(max_new_tokens=6, ignore_eos=True)) for p in ([3, 4, 5], [6, 2])]
    plans = []
    while engine.has_unfinished():
        engine.step()
        plans.append(engine.last_plan)
    reported = [p for p in plans if p.decoding and not p.prefilling]
    assert len(seen) == len(reported) > 0 and any(p.prefilling and p.decoding for p in plans)
    for (n_tokens, n_requests, forward_s, drafted, depth, draft_s, kw), plan in zip(seen, reported):
        assert (n_tokens, n_requests, drafted, depth) == (plan.verified_tokens, len(plan.decoding), n_requests, 2)
        assert forward_s > 0 and draft_s > 0 and kw["commit_s"] > 0  # the commit's time is reported apart
        assert kw["feed_s"] == plan.propose_seconds - plan.draft_call_seconds >= 0
    assert all(len(r.output) == 6 for r in reqs)


def test_bad_requests_are_refused_without_disturbing_others(smollm2):
    model = smollm2.model
    engine = Engine(model, smollm2.tokenizer, None, make_policy("none"), smollm2.eos_ids,
                    EngineConfig(kv_budget_tokens=400))
    ok = engine.add_request([1, 2, 3], SamplingParams(temperature=0, max_new_tokens=5))
    with pytest.raises(RequestRejected, match="KV budget"):
        engine.add_request([1] * 100, SamplingParams(max_new_tokens=390))
    with pytest.raises(RequestRejected, match="context window"):
        engine.add_request([1] * 9000, SamplingParams())
    with pytest.raises(SamplingError):
        engine.add_request([1], SamplingParams(top_p=2))
    run_engine(engine, [], [])
    assert ok.finish_reason == "length" and len(ok.output) == 5


def test_admission_waits_for_kv_and_abort_frees_it(smollm2):
    engine = Engine(smollm2.model, smollm2.tokenizer, None, make_policy("none"), smollm2.eos_ids,
                    EngineConfig(kv_budget_tokens=120, gamma=7))
    a = engine.add_request([1] * 20, SamplingParams(temperature=0, max_new_tokens=60))
    b = engine.add_request([2] * 20, SamplingParams(temperature=0, max_new_tokens=60))
    engine.step()
    assert engine.running == [a] and list(engine.waiting) == [b]  # b must wait for a's KV
    engine.abort(a.request_id)
    engine.step()
    assert a.finish_reason == "abort" and a.cache is None and engine.running == [b]
    assert engine.kv_reserved == b.reserved


def test_stop_string_spanning_tokens_inside_a_block(smollm2):
    tok = smollm2.tokenizer
    ids = chat_ids(tok, "Count from 1 to 20 separated by commas.")
    greedy = SamplingParams(temperature=0, max_new_tokens=60)
    engine = Engine(smollm2.model, tok, make_drafter("ngram", gamma=7), make_policy("fixed-7"), smollm2.eos_ids)
    full = run_engine(engine, [ids], [greedy])[0]
    stop = full.text[14:19]  # a stop string in mid-output; greedy makes it reproducible
    assert len(full.output) > 8
    stopped = engine.add_request(ids, greedy, stop_strings=(stop,))
    while engine.has_unfinished():
        engine.step()
    cut = full.text.index(stop)
    assert stopped.finish_reason == "stop" and stopped.text == full.text[:cut]
    assert stopped.output == full.output[: len(stopped.output)]
    assert stop in tok.decode(stopped.output) and stop not in tok.decode(stopped.output[:-1])
    assert stopped.usage()["completion_tokens"] == len(stopped.output)


def test_engine_seeded_sampling_is_reproducible(smollm2):
    """Same seeds → same tokens at T > 0 through the batched engine with speculation; other seeds differ."""
    tok = smollm2.tokenizer
    prompts = [chat_ids(tok, t) for t in ("Write a limerick.", "Describe a cat.", "List some fruits.")]

    def batch(seed0):
        engine = Engine(smollm2.model, tok, make_drafter("ngram", gamma=4), make_policy("fixed-4"), smollm2.eos_ids)
        params = [SamplingParams(temperature=1.0, top_p=0.9, max_new_tokens=20, seed=seed0 + i) for i in range(3)]
        return [r.output for r in run_engine(engine, prompts, params)]

    first = batch(100)
    assert batch(100) == first
    assert batch(200) != first
