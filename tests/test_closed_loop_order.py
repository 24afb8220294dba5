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

