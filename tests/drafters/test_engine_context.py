"""The engine tells a policy that prices context (scheduling/profile.py) the decoding requests' mean context."""
import numpy as np

from dspark.decoding import SamplingParams
from dspark.engine.engine import Engine, EngineConfig
from dspark_testlib import tiny_drafter, tiny_target


class _Spy:
    """Verifies nothing; records the context the engine passes before each step."""

    needs_confidence, drafts, load_dependent, prices_context = False, True, False, True

    def __init__(self):
        self.seen = []

    def prepare(self, n_requests, context=None):
        self.seen.append((n_requests, context))
        return False

    def select(self, c=None, *, n_requests=None, gamma=None):
        return np.zeros(n_requests, dtype=np.int64)


def test_the_engine_passes_the_decoding_requests_mean_context():
    target = tiny_target(seed=4, scale=6.0)
    spy = _Spy()
    engine = Engine(target, None, tiny_drafter(target, head="markov", block=4), spy, (),
                    EngineConfig(gamma=4, prefill_chunk=64))
    params = SamplingParams(temperature=0, max_new_tokens=3, ignore_eos=True)
    engine.add_request([3, 4, 5, 6], params)
    engine.add_request([7, 8], params)
    while engine.has_unfinished():
        engine.step()
    # step 2: both decode, 5 and 3 tokens committed (prompt + first token): mean 4; then 5; then one request left
    assert spy.seen == [(2, 4.0), (2, 5.0)]
