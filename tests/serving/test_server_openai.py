"""The server through the official `openai` client: chat and completions, streamed and not, on loopback."""
import json
import urllib.request

import pytest

pytest.importorskip("starlette")
pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")

from server_testlib import engine_idle, start_server, wait_until  # noqa: E402

MESSAGES = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name three rivers."}]


@pytest.fixture(scope="module")
def server():
    srv = start_server()
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=60)


def streamed_chat(client, **kw):
    parts, finish, usage, spec = [], None, None, None
    for chunk in client.chat.completions.create(model="tiny", messages=MESSAGES, stream=True,
                                                stream_options={"include_usage": True}, **kw):
        for choice in chunk.choices:
            parts.append(choice.delta.content or "")
            finish = choice.finish_reason or finish
        usage = chunk.usage or usage
        spec = (chunk.model_extra or {}).get("speculative") or spec
    return "".join(parts), finish, usage, spec


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_chat_stream_equals_non_stream_and_carries_stats(client, server, temperature):
    kw = dict(max_tokens=24, temperature=temperature, seed=11, top_p=0.95)
    plain = client.chat.completions.create(model="tiny", messages=MESSAGES, **kw)
    text, finish, usage, spec = streamed_chat(client, **kw)
    assert plain.object == "chat.completion" and plain.choices[0].message.role == "assistant"
    assert text == plain.choices[0].message.content and text
    assert finish == plain.choices[0].finish_reason == "length"
    assert usage.completion_tokens == plain.usage.completion_tokens == 24
    assert usage.total_tokens == usage.prompt_tokens + 24
    stats = plain.model_extra["speculative"]
    assert stats == spec and stats["rounds"] >= 1 and stats["mean_accepted_length"] >= 1
    assert wait_until(lambda: engine_idle(server))


def test_completion_stream_and_non_stream(client):
    kw = dict(model="tiny", prompt="The history of the river", max_tokens=16, temperature=0.7, seed=3,
              extra_body={"top_k": 40})
    plain = client.completions.create(**kw)
    chunks = list(client.completions.create(stream=True, **kw))
    assert plain.object == "text_completion"
    assert "".join(c.choices[0].text for c in chunks if c.choices) == plain.choices[0].text
    assert chunks[-1].choices[0].finish_reason == plain.choices[0].finish_reason == "length"
    assert plain.usage.completion_tokens == 16 and plain.model_extra["speculative"]["rounds"] >= 1


def test_stop_strings_cut_the_text_in_both_modes(client):
    base = client.completions.create(model="tiny", prompt="Once upon a time", max_tokens=40, temperature=0)
    text = base.choices[0].text
    assert len(text) > 10
    stop = text[5:8]  # something the greedy continuation is known to produce
    for stops in (stop, [stop, "\u2603never"]):
        kw = dict(model="tiny", prompt="Once upon a time", max_tokens=40, temperature=0, stop=stops)
        plain = client.completions.create(**kw)
        streamed = "".join(c.choices[0].text for c in client.completions.create(stream=True, **kw) if c.choices)
        assert plain.choices[0].finish_reason == "stop"
        assert plain.choices[0].text == streamed == text[: text.index(stop)]
        assert stop not in streamed


def test_models_health_and_metrics(client, server):
    models = client.models.list()
    assert [m.id for m in models.data] == ["tiny"]
    with urllib.request.urlopen(f"{server.url}/health") as r:
        health = json.loads(r.read())
    assert health["status"] == "ok" and health["drafter"] == "ngram" and health["policy"] == "fixed-4"
    assert health["load_dependent_policy"] is False  # a seeded sampled request repeats whatever the load
    client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=8, temperature=0)
    with urllib.request.urlopen(f"{server.url}/metrics") as r:
        assert r.headers["Content-Type"].startswith("text/plain")
        text = r.read().decode()
    series = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            series[name] = float(value)
    names = {n.split("{")[0] for n in series}
    for name in ("vllm:spec_decode_num_drafts_total", "vllm:spec_decode_num_draft_tokens_total",
                 "vllm:spec_decode_num_accepted_tokens_total", "vllm:spec_decode_num_accepted_tokens_per_pos_total",
                 "dspark:spec_decode_accepted_length_bucket", "dspark:verify_budget_per_request_step",
                 "dspark:num_requests_waiting", "dspark:engine_step_seconds_sum", "dspark:generation_tokens_total",
                 "dspark:request_finished_total", "dspark:kv_reserved_tokens", "vllm:num_requests_running"):
        assert name in names, name
    assert series['dspark:generation_tokens_total{model_name="tiny"}'] > 0
    inf = series['dspark:spec_decode_accepted_length_bucket{model_name="tiny",le="+Inf"}']
    assert inf == series['dspark:spec_decode_accepted_length_count{model_name="tiny"}'] > 0
    # Each family's samples form one group (the text format requires it).
    seen = set()
    for line in text.splitlines():
        if line.startswith("# TYPE"):
            family = line.split()[2]
            assert family not in seen, family
            seen.add(family)


def test_chat_logprobs_plain_and_streamed(client, server):
    """logprobs=True with top_logprobs: one entry per completion token, the same in both modes (greedy), the
    chosen token's log-probability at most the best alternative's and each top list sorted."""
    kw = dict(model="tiny", messages=MESSAGES, max_tokens=20, temperature=0, logprobs=True, top_logprobs=3)
    plain = client.chat.completions.create(**kw)
    entries = plain.choices[0].logprobs.content
    assert len(entries) == plain.usage.completion_tokens == 20
    for e in entries:
        tops = [t.logprob for t in e.top_logprobs]
        assert len(tops) == 3 and tops == sorted(tops, reverse=True) and e.logprob <= 0
        assert e.logprob == pytest.approx(tops[0], abs=1e-5)  # greedy: the chosen token is the most likely
        assert e.bytes == list(e.token.encode())
    assert "".join(e.token for e in entries) == plain.choices[0].message.content
    streamed = [e for chunk in client.chat.completions.create(stream=True, **kw) for c in chunk.choices
                if c.logprobs is not None for e in c.logprobs.content]
    assert [(e.token, round(e.logprob, 5)) for e in streamed] == [(e.token, round(e.logprob, 5)) for e in entries]
    no = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=4, temperature=0)
    assert no.choices[0].logprobs is None
    assert wait_until(lambda: engine_idle(server))


def test_completion_logprobs_with_a_stop_string(client):
    base = client.completions.create(model="tiny", prompt="Once upon a time", max_tokens=30, temperature=0)
    stop = base.choices[0].text[6:9]
    kw = dict(model="tiny", prompt="Once upon a time", max_tokens=30, temperature=0.8, seed=5, logprobs=2)
    plain = client.completions.create(**kw)
    lp = plain.choices[0].logprobs
    n = plain.usage.completion_tokens
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == n
    assert all(len(t) <= 2 for t in lp.top_logprobs) and lp.text_offset == sorted(lp.text_offset)
    cut = client.completions.create(stop=stop, **{**kw, "temperature": 0, "seed": None})
    assert cut.choices[0].finish_reason == "stop"
    assert len(cut.choices[0].logprobs.tokens) == cut.usage.completion_tokens  # the stop string's tokens too
    streamed = [t for c in client.completions.create(stream=True, stop=stop, **{**kw, "temperature": 0,
                                                                                   "seed": None})
                if c.choices and c.choices[0].logprobs is not None for t in c.choices[0].logprobs.tokens]
    assert streamed == cut.choices[0].logprobs.tokens


def test_n_choices_are_seeded_requests_plain_and_streamed(client, server):
    """n = 3 with a seed: choice i is the request with seed + i, streamed or not; usage counts the prompt once."""
    kw = dict(model="tiny", messages=MESSAGES, max_tokens=12, temperature=1.0, seed=7)
    many = client.chat.completions.create(n=3, **kw)
    singles = [client.chat.completions.create(**{**kw, "seed": 7 + i}) for i in range(3)]
    assert [c.index for c in many.choices] == [0, 1, 2]
    assert [c.message.content for c in many.choices] == [s.choices[0].message.content for s in singles]
    assert len({c.message.content for c in many.choices}) > 1  # different seeds, different samples
    assert many.usage.prompt_tokens == singles[0].usage.prompt_tokens
    assert many.usage.completion_tokens == sum(s.usage.completion_tokens for s in singles) == 36
    assert many.model_extra["speculative"]["rounds"] == sum(s.model_extra["speculative"]["rounds"] for s in singles)
    texts, finishes, usage = ["", "", ""], [None] * 3, None
    for chunk in client.chat.completions.create(n=3, stream=True, stream_options={"include_usage": True}, **kw):
        for c in chunk.choices:
            texts[c.index] += c.delta.content or ""
            finishes[c.index] = c.finish_reason or finishes[c.index]
        usage = chunk.usage or usage
    assert texts == [c.message.content for c in many.choices] and finishes == ["length"] * 3
    assert usage.completion_tokens == 36
    done = client.completions.create(model="tiny", prompt="Once upon a time", max_tokens=6, temperature=0, n=2,
                                     logprobs=1)
    assert done.choices[0].text == done.choices[1].text  # greedy: every choice the same
    assert [len(c.logprobs.tokens) for c in done.choices] == [6, 6]
    assert wait_until(lambda: engine_idle(server))


def test_stop_token_ids_end_the_answer(client, server):
    """vLLM's stop_token_ids: the greedy first token, named as a stop token, ends the answer right there."""
    import torch
    from dspark.models import Segment

    model, prompt = server.app.state.llm.engine.model, [5, 6, 7, 8]
    ids = torch.tensor(prompt)
    first = int(model.forward(ids, [Segment(model.new_cache(), 0, len(ids))]).logits[-1].argmax())
    done = client.completions.create(model="tiny", prompt=prompt, max_tokens=10, temperature=0,
                                     extra_body={"stop_token_ids": [first]})
    assert done.choices[0].finish_reason == "stop" and done.usage.completion_tokens == 1
    free = client.completions.create(model="tiny", prompt=prompt, max_tokens=10, temperature=0)
    assert free.usage.completion_tokens == 10


def test_logit_bias_forces_and_bans(client, server):
    """+100 on one token makes it the whole greedy answer; -100 on the greedy first token removes it."""
    import torch
    from dspark.models import Segment

    model, prompt = server.app.state.llm.engine.model, [5, 6, 7, 8]
    forced = client.completions.create(model="tiny", prompt=prompt, max_tokens=6, temperature=0, logprobs=0,
                                       logit_bias={"1234": 100})
    tok = server.app.state.llm.tokenizer
    assert forced.choices[0].logprobs.tokens == [tok.decode([1234])] * 6
    ids = torch.tensor(prompt)
    first = int(model.forward(ids, [Segment(model.new_cache(), 0, len(ids))]).logits[-1].argmax())
    banned = client.completions.create(model="tiny", prompt=prompt, max_tokens=1, temperature=0, logprobs=0,
                                       logit_bias={str(first): -100})
    free = client.completions.create(model="tiny", prompt=prompt, max_tokens=1, temperature=0, logprobs=0)
    assert free.choices[0].logprobs.tokens == [tok.decode([first])] != banned.choices[0].logprobs.tokens


def test_penalties_change_the_greedy_answer(client):
    kw = dict(model="tiny", prompt="Once upon a time", max_tokens=30, temperature=0, logprobs=0)
    free = client.completions.create(**kw)
    tokens = free.choices[0].logprobs.tokens
    assert len(set(tokens)) < len(tokens)  # the tiny model repeats itself greedily
    penalized = client.completions.create(frequency_penalty=2.0, presence_penalty=2.0, **kw)
    assert penalized.choices[0].logprobs.tokens[0] == tokens[0]  # nothing generated yet: the same first token
    assert penalized.choices[0].logprobs.tokens != tokens


def test_repetition_penalty_and_min_p_reach_the_engine(client):
    kw = dict(model="tiny", prompt="Once upon a time", max_tokens=30, logprobs=0)
    greedy = client.completions.create(temperature=0, **kw).choices[0].logprobs.tokens
    penalized = client.completions.create(temperature=0, extra_body={"repetition_penalty": 20.0}, **kw)
    assert penalized.choices[0].logprobs.tokens != greedy
    # min_p = 1 keeps only the most likely token: sampling then is greedy decoding
    argmax = client.completions.create(temperature=1.0, seed=3, extra_body={"min_p": 1.0}, **kw)
    assert argmax.choices[0].logprobs.tokens == greedy


def post(server, path: str, body: dict) -> dict:
    req = urllib.request.Request(f"{server.url}{path}", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req) as r:
        return json.loads(r.read())


def test_tokenize_gives_the_ids_the_completion_endpoints_use(client, server):
    text = "Once upon a time"
    ids = post(server, "/tokenize", {"prompt": text})
    by_text = client.completions.create(model="tiny", prompt=text, max_tokens=8, temperature=0)
    by_ids = client.completions.create(model="tiny", prompt=ids["tokens"], max_tokens=8, temperature=0)
    assert ids["count"] == len(ids["tokens"]) == by_text.usage.prompt_tokens and ids["max_model_len"] > 0
    assert by_ids.choices[0].text == by_text.choices[0].text
    assert post(server, "/detokenize", {"tokens": ids["tokens"]}) == {"prompt": text}
    chat = post(server, "/tokenize", {"model": "tiny", "messages": MESSAGES})
    answer = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=2, temperature=0)
    assert chat["count"] == answer.usage.prompt_tokens
    bare = post(server, "/tokenize", {"messages": MESSAGES, "add_generation_prompt": False})
    assert bare["tokens"] == chat["tokens"][: bare["count"]] and bare["count"] < chat["count"]


def test_a_repeated_prompt_prefix_is_reported_as_cached_tokens(client, server):
    """The second request copies the first one's prompt KV (engine/prefix_cache.py): OpenAI's
    usage.prompt_tokens_details.cached_tokens says how much, /metrics counts it, and the answer is the same."""
    messages = [{"role": "system", "content": "You answer in one line. " * 12},
                {"role": "user", "content": "Name a river."}]
    kw = dict(model="tiny", messages=messages, max_tokens=12, temperature=0)
    first, second = (client.chat.completions.create(**kw) for _ in range(2))
    assert second.choices[0].message.content == first.choices[0].message.content
    assert second.usage.prompt_tokens == first.usage.prompt_tokens > 60
    assert second.usage.prompt_tokens_details.cached_tokens >= first.usage.prompt_tokens - 1
    with urllib.request.urlopen(f"{server.url}/metrics") as r:
        metrics = r.read().decode()
    cached = [line for line in metrics.splitlines() if line.startswith("dspark:prompt_tokens_cached_total")]
    assert cached and float(cached[0].split()[-1]) >= first.usage.prompt_tokens - 1
    assert wait_until(lambda: engine_idle(server))


def test_min_tokens_reaches_the_engine_and_is_checked(client):
    kw = dict(model="tiny", prompt="Once upon a time", max_tokens=40, temperature=0)
    base = client.completions.create(**kw)
    stop = base.choices[0].text[2:5]  # matched within the first few tokens
    early = client.completions.create(stop=[stop], **kw)
    late = client.completions.create(stop=[stop], extra_body={"min_tokens": 30}, **kw)
    assert early.usage.completion_tokens < 10 and early.choices[0].finish_reason == "stop"
    assert late.usage.completion_tokens >= 30  # a match ending in token 30 or later
    assert late.choices[0].text.startswith(base.choices[0].text[:5])
    with pytest.raises(openai.BadRequestError, match="min_tokens"):
        client.completions.create(extra_body={"min_tokens": 41}, **kw)



def test_completion_echo_scores_the_prompt(client, server):
    """echo (lm-eval's loglikelihood requests): the prompt comes back first, with one log-probability per prompt
    token after the first; max_tokens 0 scores the prompt alone. The score of a token appended to a prompt is the
    log-probability the model gave it as that prompt's next token."""
    tok = server.app.state.engine.engine.tokenizer
    prompt = tok.encode("The river flows past the old mill", add_special_tokens=False)
    nxt = client.completions.create(model="tiny", prompt=prompt, max_tokens=1, temperature=0, logprobs=0)
    token = tok.encode(nxt.choices[0].logprobs.tokens[0], add_special_tokens=False)
    scored = client.completions.create(model="tiny", prompt=prompt + token, max_tokens=0, echo=True, logprobs=2)
    lp = scored.choices[0].logprobs
    n = len(prompt) + len(token)
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == n
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(x <= 0 for x in lp.token_logprobs[1:]) and all(len(t) <= 2 for t in lp.top_logprobs[1:])
    if len(token) == 1:  # the greedy token's string re-encodes to itself
        assert lp.token_logprobs[-1] == pytest.approx(nxt.choices[0].logprobs.token_logprobs[0], abs=1e-4)
    assert scored.usage.completion_tokens == 0 and scored.usage.prompt_tokens == n
    assert scored.choices[0].text == tok.decode(prompt + token) and scored.choices[0].finish_reason == "length"
    assert lp.text_offset == sorted(lp.text_offset)


def test_completion_echo_with_generation_plain_and_streamed(client, server):
    kw = dict(model="tiny", prompt="Once upon a time", max_tokens=12, temperature=0, echo=True, logprobs=1)
    plain = client.completions.create(**kw)
    alone = client.completions.create(**{**kw, "echo": False})
    text, lp = plain.choices[0].text, plain.choices[0].logprobs
    assert text == "Once upon a time" + alone.choices[0].text  # the prompt as sent, then the answer
    n = plain.usage.prompt_tokens
    assert lp.tokens[n:] == alone.choices[0].logprobs.tokens
    assert lp.token_logprobs[n:] == pytest.approx(alone.choices[0].logprobs.token_logprobs, abs=1e-5)
    chunks = [c for c in client.completions.create(stream=True, **kw) if c.choices]
    assert chunks[0].choices[0].text == "Once upon a time"  # the echo comes first, with the prompt's entries
    assert "".join(c.choices[0].text for c in chunks) == text
    streamed = [x for c in chunks if c.choices[0].logprobs for x in c.choices[0].logprobs.token_logprobs]
    assert streamed[0] is None and streamed[1:] == pytest.approx(lp.token_logprobs[1:], abs=1e-5)
    no_lp = client.completions.create(**{**kw, "logprobs": None, "max_tokens": 0})
    assert no_lp.choices[0].text == "Once upon a time" and no_lp.choices[0].logprobs is None
    assert wait_until(lambda: engine_idle(server))


def test_max_tokens_zero_needs_echo_and_suffix_is_refused(client):
    with pytest.raises(openai.BadRequestError, match="echo"):
        client.completions.create(model="tiny", prompt="Hi", max_tokens=0)
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=0)
    with pytest.raises(openai.BadRequestError, match="suffix"):
        client.completions.create(model="tiny", prompt="Hi", suffix="there", max_tokens=4)


def test_a_batch_of_prompts_answers_each_with_n_choices(client, server):
    """A list of prompts (text or token ids) is a batch: choice index = prompt index × n + choice; each answer
    is the one its prompt gets alone, and usage counts every prompt once."""
    prompts = ["The river", "Once upon a time there", "A list of"]
    kw = dict(model="tiny", max_tokens=8, temperature=0)
    alone = [client.completions.create(prompt=p, **kw) for p in prompts]
    batch = client.completions.create(prompt=prompts, n=2, **kw)
    assert [c.index for c in batch.choices] == list(range(6))
    for c in batch.choices:
        assert c.text == alone[c.index // 2].choices[0].text
    assert batch.usage.prompt_tokens == sum(a.usage.prompt_tokens for a in alone)
    assert batch.usage.completion_tokens == 2 * sum(a.usage.completion_tokens for a in alone)
    tok = server.app.state.engine.engine.tokenizer
    ids = [tok.encode(p, add_special_tokens=False) for p in prompts]
    by_ids = client.completions.create(prompt=ids, echo=True, **kw)
    assert [c.text for c in by_ids.choices] == [tok.decode(i) + a.choices[0].text for i, a in zip(ids, alone)]
    chunks = [c for c in client.completions.create(prompt=prompts, stream=True, **kw) if c.choices]
    texts = ["".join(c.choices[0].text for c in chunks if c.choices[0].index == i) for i in range(3)]
    assert texts == [a.choices[0].text for a in alone]
    assert wait_until(lambda: engine_idle(server))
