"""datagen: prompt-file errors by line, multi-turn replay, exactly-once resume, OpenAI-compatible endpoint."""
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from dspark.models import load_model
from dspark.training.cli import main
from dspark.training.conversations import PromptFileError, encode_conversation, read_prompts
from dspark.training.datagen import DatagenError, DatagenSettings, run_datagen
from tiny_target import make_target_dir, write_prompts

SETTINGS = DatagenSettings(max_new_tokens=12, batch_size=4, temperature=1.0)


@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
    return load_model(str(make_target_dir(tmp_path_factory.mktemp("dg") / "target")))


def lines(path):
    return [json.loads(x) for x in path.read_text().splitlines()]


def test_malformed_lines_are_reported_by_number(tmp_path):
    bad = {2: "{not json", 4: json.dumps({"turns": []}), 6: json.dumps({"turns": ["ok", 3]})}
    path = write_prompts(tmp_path / "p.jsonl", 5, bad)
    with pytest.raises(PromptFileError, match=r"line 2: .*line 4: no user turn.*line 6: every user turn"):
        read_prompts(path)
    records, problems = read_prompts(path, skip_bad=True)
    assert len(records) == 5 and [p.split(":")[0] for p in problems] == ["line 2", "line 4", "line 6"]
    assert main(["datagen", "--prompts", str(path), "--out", str(tmp_path / "o"), "--model", "x"]) == 2


def test_prompt_files_may_be_xz_compressed(tmp_path):
    import lzma

    path = write_prompts(tmp_path / "p.jsonl", 5)
    packed = tmp_path / "p.jsonl.xz"
    packed.write_bytes(lzma.compress(path.read_bytes()))
    assert read_prompts(packed) == read_prompts(path)


def test_multi_turn_replay_and_loss_mask(tmp_path, loaded):
    out = tmp_path / "out"
    summary = run_datagen(write_prompts(tmp_path / "p.jsonl", 4), out, SETTINGS, loaded=loaded, progress=False)
    assert summary["records"] == 4
    by_id = {r["id"]: r for r in lines(out / "data.jsonl")}
    multi = by_id["line-1"]  # prompt 0 has two user turns
    assert [m["role"] for m in multi["messages"]] == ["user", "assistant", "user", "assistant"]
    assert multi["messages"][2]["content"] == "and now 1?" and len(multi["answer_tokens"]) == 2
    meta = json.loads((out / "meta.json").read_text())
    assert meta["sampling"]["temperature"] == 1.0 and meta["chat_template"]
    ids, mask = encode_conversation(loaded.tokenizer, multi["messages"])
    tok = loaded.tokenizer
    answer = tok.decode([t for t, m in zip(ids, mask) if m])
    assert answer == "".join(m["content"] + "<|im_end|>" for m in multi["messages"] if m["role"] == "assistant")


def test_resume_after_interruption_has_no_duplicates_and_no_losses(tmp_path, loaded):
    prompts, out = write_prompts(tmp_path / "p.jsonl", 11), tmp_path / "out"

    def interrupt(record, seen=[]):
        seen.append(record)
        if len(seen) == 4:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        run_datagen(prompts, out, SETTINGS, loaded=loaded, progress=False, on_record=interrupt)
    assert len(lines(out / "data.jsonl")) == 4
    with open(out / "data.jsonl", "a") as f:
        f.write('{"id": "line-9", "messages": [{"ro')  # a record torn by the interruption
    summary = run_datagen(prompts, out, SETTINGS, loaded=loaded, progress=False)
    assert summary["already_done"] == 4 and summary["records"] == 7
    ids = [r["id"] for r in lines(out / "data.jsonl")]
    assert sorted(ids) == sorted(f"line-{i}" for i in range(1, 12)) and len(ids) == len(set(ids))
    with pytest.raises(DatagenError, match="other settings"):
        run_datagen(prompts, out, DatagenSettings(temperature=0.1), loaded=loaded, progress=False)


class FakeServer(BaseHTTPRequestHandler):
    seen: list = []

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        FakeServer.seen.append(body)
        turn = sum(m["role"] == "user" for m in body["messages"])
        reply = {"choices": [{"message": {"role": "assistant", "content": f"answer {turn}"},
                              "finish_reason": "stop"}], "usage": {"completion_tokens": 3}}
        data = json.dumps(reply).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):
        pass


def test_openai_compatible_endpoint(tmp_path):
    server = ThreadingHTTPServer(("127.0.0.1", 0), FakeServer)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}/v1"
        summary = run_datagen(write_prompts(tmp_path / "p.jsonl", 3), tmp_path / "out",
                              DatagenSettings(temperature=0.5, max_new_tokens=7), endpoint=url, api_model="m",
                              progress=False)
    finally:
        server.shutdown()
    assert summary["records"] == 3 and summary["failed"] == 0
    multi = next(r for r in lines(tmp_path / "out" / "data.jsonl") if r["id"] == "line-1")
    assert [m["content"] for m in multi["messages"]] == ["say 0 please", "answer 1", "and now 1?", "answer 2"]
    second = next(b for b in FakeServer.seen if len(b["messages"]) == 3)
    assert second["messages"][1]["content"] == "answer 1"  # the regenerated answer is replayed
    assert second["model"] == "m" and second["temperature"] == 0.5 and second["max_tokens"] == 7


def test_token_groups_bound_each_generate_call():
    from dspark.training.datagen_hf import token_groups

    class C:
        def __init__(self, n):
            self.ids = [0] * n

    convs = [C(n) for n in (5, 30, 8, 12, 9, 40)]
    groups = token_groups(convs, batch_tokens=60, max_new=10)
    assert sorted(len(c.ids) for g in groups for c in g) == [5, 8, 9, 12, 30, 40]
    assert all(len(g) * (max(len(c.ids) for c in g) + 10) <= 60 or len(g) == 1 for g in groups)
    assert [len(g) for g in groups] == [3, 1, 1, 1] and token_groups(convs, 0, 10) == [convs]


def _answers(out):
    return {r["id"]: [m["content"] for m in r["messages"]] for r in lines(out / "data.jsonl")}


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not __import__("torch").cuda.is_available(), reason="needs a CUDA GPU"))])
def test_transformers_backend_gives_the_runtime_greedy_answers(tmp_path, loaded, device):
    """The GPU backend (padded `generate` batches, left padding, multi-turn replay) writes the same greedy
    conversations as our runtime, whatever the chunking."""
    prompts, greedy = write_prompts(tmp_path / "p.jsonl", 7), DatagenSettings(max_new_tokens=12, temperature=0.0)
    run_datagen(prompts, tmp_path / "runtime", greedy, loaded=loaded, progress=False)
    for name, cap in (("hf", 0), ("hf-capped", 70)):  # batch_tokens=70: a turn's calls hold 1-2 rows
        chunked = DatagenSettings(max_new_tokens=12, temperature=0.0, batch_size=3, batch_tokens=cap)
        summary = run_datagen(prompts, tmp_path / name, chunked, loaded=loaded, progress=False,
                              backend="transformers", device=device)
        assert summary["records"] == 7
        assert _answers(tmp_path / name) == _answers(tmp_path / "runtime")
    meta = json.loads((tmp_path / "hf" / "meta.json").read_text())
    assert meta["backend"] == "transformers"
