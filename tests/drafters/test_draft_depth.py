"""Shallow drafting through the engine: a fixed-K policy below the block size makes the DSpark drafter draft
only K slots (`propose(depth=K)`); the output stays exactly the target's — greedy, seeded and in distribution."""
from dspark.decoding import SamplingParams
from dspark.engine.engine import Engine, EngineConfig
from dspark.scheduling.registry import make_policy
from dspark_testlib import tiny_drafter, tiny_target
from test_dspark_exactness import FIRST, PROMPT, V, assert_first_tokens_match_target, plain_greedy


def run(target, drafter, policy, prompts, params, max_running=64):
    engine = Engine(target, None, drafter, policy, (), EngineConfig(gamma=drafter.gamma, max_running=max_running))
    widths = []
    reqs = [engine.add_request(p, sp) for p, sp in zip(prompts, params)]
    while engine.has_unfinished():
        engine.step()
        if engine.last_plan.decoding and engine.last_plan.propose_seconds:
            widths.append(engine.last_plan.drafts.shape[1])
    assert all(r.error is None for r in reqs)
    return reqs, widths


def test_greedy_with_shallow_drafts_equals_plain():
    target = tiny_target(seed=4, scale=6.0)
    drafter = tiny_drafter(target, head="markov", block=4)
    prompts = [[3, 4, 5, 3, 4, 5, 3, 4], [5, 17, 33, 2, 9], [40, 41]]
    params = [SamplingParams(temperature=0, max_new_tokens=24, ignore_eos=True)] * 3
    reqs, widths = run(target, drafter, make_policy("fixed-2"), prompts, params)
    assert widths and set(widths) == {2}  # two slots drafted, not four
    for prompt, req in zip(prompts, reqs):
        assert req.output == plain_greedy(target, prompt, 24)
    assert sum(r.accepted for r in reqs) > 0


def test_seeded_and_t1_distribution_with_mtp1_drafting_one_slot():
    """MTP-1 with a 3-slot Markov drafter drafts one slot per round: the same seeds give the same outputs, and
    the first tokens follow the target's exact law (chi-square)."""
    target = tiny_target(vocab=V, hidden=32, layers=2, seed=11, scale=3.0)
    drafter = tiny_drafter(target, head="markov", rank=6, block=3, head_scale=1.0)

    def sample(n, seed0=0):
        params = [SamplingParams(temperature=1.0, max_new_tokens=FIRST, seed=seed0 + i, ignore_eos=True)
                  for i in range(n)]
        reqs, widths = run(target, drafter, make_policy("mtp1"), [PROMPT] * n, params, max_running=512)
        assert set(widths) == {1} and sum(r.accepted for r in reqs) > 0
        return [r.output for r in reqs]

    assert sample(40) == sample(40) != sample(40, seed0=100)
    n = 8000
    assert_first_tokens_match_target(target, sample(n), n)
