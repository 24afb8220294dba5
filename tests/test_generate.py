"""`dspark generate` runs one request through the batched engine; `auto` picks a drafter for the policy that runs it."""
import json

import pytest

from dspark.decoding import SamplingParams
from dspark.drafters import DrafterError
from dspark.drafters import shipped
from dspark.engine import Generation, TransformerTarget
from dspark.engine.llm import drafter_options
from dspark.generate import TextGenerator, prompt_ids


@pytest.mark.parametrize("mode, alone, scheduled", [(True, True, True), (False, False, False),
                                                    ("scheduled", False, True)])
def test_defaults_json_says_where_auto_may_pick_a_shipped_drafter(tmp_path, monkeypatch, mode, alone, scheduled):
    defaults = tmp_path / "defaults.json"
    defaults.write_text(json.dumps({"d": {"auto": mode, "why": "measured"}}))
    monkeypatch.setattr(shipped, "DEFAULTS", defaults)
    assert shipped.auto_allowed(tmp_path / "d", scheduled=False) is alone
    assert shipped.auto_allowed(tmp_path / "d", scheduled=True) is scheduled
    assert shipped.auto_allowed(tmp_path / "other", scheduled=False)  # no entry: no objection


@pytest.mark.parametrize("bad", [1, "always", None])
def test_a_malformed_auto_entry_is_refused(tmp_path, monkeypatch, bad):
    defaults = tmp_path / "defaults.json"
    defaults.write_text(json.dumps({"d": {"auto": bad}}))
    monkeypatch.setattr(shipped, "DEFAULTS", defaults)
    with pytest.raises(DrafterError, match="must be true, false or \"scheduled\""):
        shipped.auto_allowed(tmp_path / "d")


def test_auto_is_scheduled_only_under_a_confidence_scheduling_policy():
    assert drafter_options("auto", "auto") == {"scheduled": True}
    assert drafter_options("auto@fp32", "async:min_gain=0.01") == {"scheduled": True}
    assert drafter_options("auto", "sync") == {"scheduled": True}
    assert drafter_options("auto", "fixed-3") == {"scheduled": False}
    assert drafter_options("auto", "threshold") == {"scheduled": False}
    assert drafter_options("ngram", "auto") == {} and drafter_options(None, "auto") == {}
    assert drafter_options("dspark", "auto") == {}


@pytest.fixture(scope="module")
def generator():
    return TextGenerator("smollm2-135m-instruct", "ngram", policy="auto")


def test_generate_through_the_engine_equals_plain_greedy_decoding(smollm2, generator):
    prompt = "List the first ten prime numbers, separated by commas."
    params = SamplingParams(temperature=0.0, max_new_tokens=40)
    stream = generator.stream(prompt, params)
    text = "".join(stream)
    plain = Generation(TransformerTarget(smollm2.model), None, prompt_ids(smollm2.tokenizer, prompt, True), params,
                       smollm2.eos_ids)
    expected = [t for chunk in plain for t in chunk]
    assert stream.tokens == expected
    assert text == stream.text == smollm2.tokenizer.decode(expected, skip_special_tokens=True)
    stats = stream.stats
    assert generator.policy_name == "fixed-7" and generator.drafter_name == "ngram"
    assert stats.new_tokens == len(expected) and stats.finish_reason == plain.stats.finish_reason
    assert stats.rounds >= 1 and stats.drafted >= stats.accepted > 0  # n-gram drafts were verified and kept
    assert stats.tau == pytest.approx((stats.accepted + stats.rounds) / stats.rounds)
    assert 0 < stats.ttft_s <= stats.total_s


def test_generate_repeats_a_seeded_sampled_request(generator):
    params = SamplingParams(temperature=1.0, top_p=0.95, seed=7, max_new_tokens=24)
    first = generator.stream("Describe a harbour at dawn.", params)
    text = "".join(first)  # run to the end before the second request joins the engine
    second = generator.stream("Describe a harbour at dawn.", params)
    assert text == "".join(second) and first.tokens == second.tokens and first.stats.drafted > 0


def test_a_stream_left_early_frees_its_request(generator):
    engine = generator.llm.engine
    stream = generator.stream("Write a long story about a lighthouse.", SamplingParams(max_new_tokens=200))
    pieces = iter(stream)
    next(pieces)
    pieces.close()  # the consumer stops reading (a closed pipe, Ctrl-C)
    assert stream.request.finished and stream.request.finish_reason == "abort"
    assert not engine.has_unfinished() and engine.kv_reserved == 0


def test_a_prompt_longer_than_the_context_is_refused_before_it_runs(generator):
    with pytest.raises(ValueError, match="context window"):
        generator.stream("word " * 9000, SamplingParams(max_new_tokens=4))
    assert not generator.llm.engine.has_unfinished()


def test_two_streams_on_one_engine_each_get_all_their_text(generator):
    params = (SamplingParams(temperature=0.0, max_new_tokens=4), SamplingParams(temperature=0.0, max_new_tokens=16))
    prompts = ("Name three rivers.", "Name three mountains.")
    alone = ["".join(generator.stream(p, sp)) for p, sp in zip(prompts, params)]
    short, long_ = (generator.stream(p, sp) for p, sp in zip(prompts, params))
    long_text = "".join(long_)  # steps the engine until both finish: `short` never steps it itself
    assert short.request.finished and "".join(short) == alone[0] and long_text == alone[1]
