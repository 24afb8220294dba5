"""`bench serve` prompt order: sets interleaved, each repeat starting elsewhere in the mix."""
from dspark.bench.serving import mixed, rotated


def test_prompts_are_interleaved_across_sets():
    pairs = [("math", "m1"), ("math", "m2"), ("math", "m3"), ("code", "c1"), ("chat", "h1"), ("chat", "h2")]
    assert [t for _, t in mixed(pairs)] == ["m1", "c1", "h1", "m2", "h2", "m3"]
    assert mixed([]) == []


def test_each_repeat_starts_further_along_the_mix():
    prompts = list(range(6))
    assert rotated(prompts, 0, 3) == [0, 1, 2, 3, 4, 5]
    assert rotated(prompts, 1, 3) == [2, 3, 4, 5, 0, 1]
    assert rotated(prompts, 2, 3) == [4, 5, 0, 1, 2, 3]
    assert sorted(rotated(prompts, 1, 4)) == prompts
