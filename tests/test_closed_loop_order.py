"""`run_loops` steps the policies' loops in a shuffled order each round, so no policy always runs right after the
same neighbour (a step after a drafting policy's step is slower on a CPU: the drafter evicted the target's
working set), and every loop still measures its own time."""
from collections import Counter

from dspark.bench.closed_loop import run_loops


class FakeLoop:
    """Ticks cost 1 s of this loop's own clock and are logged in one shared list."""

    def __init__(self, name: str, log: list):
        self.name, self.log, self.clock, self.clock0 = name, log, 0.0, 0.0

    first_wave_finished = True

    @property
    def measured_seconds(self) -> float:
        return self.clock - self.clock0

    def start_measuring(self) -> None:
        self.clock0 = self.clock

    def tick(self) -> None:
        self.log.append(self.name)
        self.clock += 1.0

    def finish(self) -> dict:
        return {"name": self.name, "seconds": self.measured_seconds}


def test_every_loop_follows_every_other_about_equally_often():
    log: list[str] = []
    loops = [FakeLoop(n, log) for n in ("none", "mtp1", "fixed-3", "async")]
    results = run_loops(loops, seconds=400)
    assert [r["seconds"] for r in results] == [400.0] * 4
    assert Counter(log) == {n: 400 for n in ("none", "mtp1", "fixed-3", "async")}
    after = Counter(zip(log, log[1:]))  # (previous, next) pairs
    for prev in ("none", "mtp1", "fixed-3"):
        share = after[prev, "async"] / sum(after[p, "async"] for p in ("none", "mtp1", "fixed-3", "async"))
        assert 0.15 < share < 0.35  # a fixed order would give fixed-3 → async every time (share 1)
    again: list[str] = []
    run_loops([FakeLoop(n, again) for n in ("none", "mtp1", "fixed-3", "async")], seconds=400)
    assert again == log  # seeded: the same order every run



class RecordingEngine:
    """Takes requests and remembers their parameters; every step finishes them all."""

    class Stats:
        steps = verify_budget_total = decode_requests_total = 0
        step_seconds_total = forward_seconds_total = drafter_seconds_total = 0.0

    def __init__(self):
        self.params, self.live, self.stats = [], [], self.Stats()

    def add_request(self, prompt, params):
        from types import SimpleNamespace

        req = SimpleNamespace(request_id=str(len(self.params)), finished=False, output=[1], rounds=1, accepted=0,
                              cached_tokens=0)
        self.params.append(params)
        self.live.append(req)
        return req

    def step(self):
        for r in self.live:
            r.finished = True


def test_each_request_of_a_closed_loop_gets_its_own_seed_and_every_loop_the_same_ones():
    # One seed for every request would replay the same answer each time the mix comes back to a prompt at T > 0.
    from dspark.bench.closed_loop import ClosedLoop
    from dspark.decoding import SamplingParams

    seeds = []
    for _ in range(2):
        engine = RecordingEngine()
        loop = ClosedLoop(engine, [[1, 2], [3]], 2, SamplingParams(temperature=1.0, seed=7), 0.5, limit=6)
        while loop.live:
            loop.tick()
        seeds.append([p.seed for p in engine.params])
        assert len({p.max_new_tokens for p in engine.params}) > 1  # the length spread still applies
    assert seeds[0] == seeds[1] == [7, 8, 9, 10, 11, 12]
    unseeded = RecordingEngine()
    ClosedLoop(unseeded, [[1]], 2, SamplingParams(temperature=1.0), limit=2)
    assert [p.seed for p in unseeded.params] == [None, None]
