"""Synthetic prompts: seeded, distinct, all three domains, readable by datagen; interleaving alternates sources."""
import json

from dspark.training.conversations import read_prompts
from dspark.training.synth_prompts import synthesize, write_prompts


def test_synthetic_prompts_are_seeded_distinct_and_cover_the_domains():
    a, b = synthesize(300, seed=3), synthesize(300, seed=3)
    assert a == b and a != synthesize(300, seed=4)
    texts = [r["turns"][0] for r in a]
    assert len(set(texts)) == 300
    assert {r["source"] for r in a} == {"synth:math", "synth:code", "synth:chat"}


def test_written_file_is_a_valid_prompt_file_and_interleaves(tmp_path):
    other = tmp_path / "other.jsonl"
    other.write_text("".join(json.dumps({"turns": [f"other {i}"]}) + "\n" for i in range(50)))
    out = tmp_path / "mix.jsonl"
    assert write_prompts(out, 20, seed=0, interleave_with=other) == 40
    records, problems = read_prompts(out)
    assert not problems and len(records) == 40
    assert [r.source for r in records[:2]][0].startswith("synth:") and records[1].turns[0].startswith("other")
