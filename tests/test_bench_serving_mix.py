"""`bench serve` prompts: sets interleaved, each repeat starting elsewhere in the mix, lengthened for long context."""
import pytest
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


def test_lengthened_prompts_read_the_mix_before_the_question_within_the_context():
    from dspark.bench.serving import ServeBenchConfig, lengthened

    texts = ["a b", "c d e", "f", "g h i j"]
    count = lambda t: len(t.split())  # noqa: E731 - one "token" per word
    long = lengthened(texts, count, at_least=12, at_most=40)
    assert all(count(t) >= 12 for t in long) and all(t.endswith("Now: " + q) for t, q in zip(long, texts))
    assert long[0].startswith("Read this first:\n\nc d e\n\nf\n\ng h i j")  # the prompts after it, in turn
    capped = lengthened(texts, count, at_least=12, at_most=12)
    assert all(count(t) <= 12 for t in capped)  # a document that would pass at_most stops before it
    with pytest.raises(ValueError, match="no room"):
        lengthened(texts, count, at_least=50, at_most=40)
    with pytest.raises(ValueError, match="prompt tokens"):
        ServeBenchConfig(prompt_tokens=-1)
