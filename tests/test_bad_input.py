"""Bad input gets one clear error and loses nothing."""
import json
import shutil

import pytest
import torch

from dspark.cli import main
from dspark.decoding import SamplingParams
from dspark.drafters import DrafterError, make_drafter
from dspark.drafters.base import Drafter, Proposal
from dspark.engine import Generation, PromptTooLongError, TransformerTarget
from dspark.engine.engine import Engine, EngineConfig
from dspark.models import ModelNotFoundError, load_model, resolve
from dspark.models.config import ModelConfigError
from dspark.models.gguf_convert import GGUFError, read_gguf
from dspark.models.weights import WeightsError, read_safetensors
from dspark.scheduling.registry import make_policy
from helpers import hf_model, ours_from_hf


def test_unknown_model_names_what_is_accepted(tmp_path):
    with pytest.raises(ModelNotFoundError, match="smollm2-135m-instruct"):
        resolve("no-such-model")
    with pytest.raises(ModelNotFoundError, match="config.json"):
        resolve(str(tmp_path))  # a directory, but not a model


def test_unsupported_architecture(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "bert", "hidden_size": 8}))
    with pytest.raises(ModelConfigError, match="supported: llama, mistral, qwen2, qwen3, gemma3_text"):
        load_model(str(tmp_path))


def _save_tiny(tmp_path):
    model = hf_model("llama")
    model.save_pretrained(tmp_path, safe_serialization=True)
    return tmp_path / "model.safetensors"


def test_truncated_safetensors_is_reported(tmp_path):
    weights = _save_tiny(tmp_path)
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) // 2])
    with pytest.raises(WeightsError, match="corrupt or truncated"):
        read_safetensors(tmp_path)


def test_missing_tensor_is_named(tmp_path):
    from safetensors.torch import load_file, save_file
    weights = _save_tiny(tmp_path)
    tensors = load_file(str(weights))
    del tensors["model.layers.1.mlp.down_proj.weight"]
    save_file(tensors, str(weights))
    with pytest.raises(WeightsError, match="model.layers.1.mlp.down_proj.weight"):
        load_model(str(tmp_path))


def test_truncated_gguf_is_reported(tmp_path):
    from dspark.models.loader import embedded_path
    bad = tmp_path / "cut.gguf"
    with open(embedded_path("smollm2-135m-instruct"), "rb") as f:
        bad.write_bytes(f.read(1 << 20))
    with pytest.raises(GGUFError, match="not a readable GGUF"):
        read_gguf(bad)


def test_prompt_longer_than_context_fails_before_compute():
    target = TransformerTarget(ours_from_hf(hf_model("llama")))  # context 256
    with pytest.raises(PromptTooLongError, match="context window is 256"):
        Generation(target, None, list(range(300)), SamplingParams())


def test_generation_stops_at_the_context_end():
    target = TransformerTarget(ours_from_hf(hf_model("llama")))
    gen = Generation(target, make_drafter("ngram", gamma=4), [1, 2, 3] * 80, SamplingParams(max_new_tokens=100))
    out = [t for chunk in gen for t in chunk]
    assert len(out) == 256 - 240 and gen.stats.finish_reason == "length"


def test_unknown_drafter_lists_valid_names(tmp_path):
    with pytest.raises(DrafterError, match="valid names are none, auto, dspark, ngram"):
        make_drafter("eagle9")
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(DrafterError, match="drafter_type"):
        make_drafter(str(tmp_path))


@pytest.mark.parametrize("argv,message", [
    (["generate", "--prompt", "x", "--temperature", "-1"], "temperature"),
    (["generate", "--prompt", "x", "--top-p", "0"], "top_p"),
    (["generate", "--prompt", "x", "--top-k", "-2"], "top_k"),
    (["generate", "--prompt", "x", "--max-new-tokens", "0"], "max_new_tokens"),
    (["generate", "--prompt", "x", "--model", "/nonexistent/model"], "unknown model"),
    (["generate", "--prompt-file", "/nonexistent/prompt.txt"], "No such file"),
    (["generate", "--prompt", "x", "--policy", "fixed-three"], "unknown policy"),
    (["generate", "--prompt", "x", "--drafter", "ngram", "--policy", "async"], "needs a drafter with a confidence"),
    (["bench", "acceptance", "--limit", "0"], "--limit"),  # was a ZeroDivisionError after the model loaded
    (["bench", "acceptance", "--temperatures", "-1"], "temperatures >= 0"),
    (["bench", "runtime", "--per-set", "0"], "--per-set"),
])
def test_cli_reports_bad_input_in_one_line(argv, message, capsys):
    assert main(argv) == 2
    # One-time progress lines ("[dspark] measuring ...", a fresh cache's kernel crossover) are not the error.
    err = "\n".join(ln for ln in capsys.readouterr().err.strip().splitlines() if not ln.startswith("[dspark] "))
    assert err.startswith("error:") and message in err and "\n" not in err


def test_ctrl_c_exits_cleanly(monkeypatch, capsys):
    import dspark.cli as cli

    def interrupted(args):
        raise KeyboardInterrupt
    monkeypatch.setattr(cli, "run_generate", interrupted)  # the parser binds it when main() builds it
    assert cli.main(["generate", "--prompt", "x"]) == 130
    assert "interrupted" in capsys.readouterr().err


def test_stale_conversion_cache_is_rebuilt(tmp_path, monkeypatch):
    """A half-written or tampered conversion is detected by its manifest and redone, never used."""
    from dspark.models import loader
    monkeypatch.setenv("DSPARK_CACHE", str(tmp_path))
    gguf = loader.embedded_path("smollm2-135m-instruct")
    first = loader.convert_gguf(gguf)
    weights = first / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])  # simulate a torn file
    again = loader.convert_gguf(gguf)
    assert again == first and (again / "model.safetensors").stat().st_size > 100_000_000
    assert read_safetensors(again)["model.norm.weight"].shape == (576,)
    shutil.rmtree(tmp_path / "models")


class OracleDrafter(Drafter):
    """Drafts the target's own greedy continuation, so every draft is accepted — up to the context's end, where
    it pads with token 0 (a position the target cannot compute)."""

    name = "test-oracle"

    def __init__(self, target, gamma: int):
        super().__init__(gamma)
        self.target = target

    def propose(self, requests, depth=None):
        rows = []
        for req in requests:
            tokens = list(req.tokens)
            for _ in range(self.gamma):
                if len(tokens) >= self.target.max_position:
                    tokens.append(0)
                    continue
                logits = self.target.forward(self.target.new_state(), 0, tokens)
                tokens.append(int(logits[-1].argmax()))
            rows.append(tokens[len(req.tokens):])
        return Proposal(tokens=torch.tensor(rows), num_tokens=torch.full((len(rows),), self.gamma))



@pytest.mark.parametrize("prompt_len", [240, 249, 250, 254, 255])
def test_a_fully_accepted_last_round_stays_inside_the_context(prompt_len):
    """Every draft accepted up to the context's end: prompt + output is exactly the context (256), never one token
    more, and the output is plain greedy decoding's."""
    target = TransformerTarget(ours_from_hf(hf_model("llama")))
    prompt, params = ([1, 2, 3] * 90)[:prompt_len], SamplingParams(temperature=0, max_new_tokens=100)
    gen = Generation(target, OracleDrafter(target, gamma=4), prompt, params)
    out = [t for chunk in gen for t in chunk]
    plain = [t for chunk in Generation(target, None, prompt, params) for t in chunk]
    assert len(prompt) + len(out) == 256 and gen.stats.finish_reason == "length"
    assert out == plain and gen.stats.accepted == gen.stats.drafted
    assert gen.stats.drafted > 0 or prompt_len >= 254  # 254: the first token and one more fill the context
    engine = Engine(target.model, None, OracleDrafter(target, gamma=4), make_policy("fixed-4"), (),
                    EngineConfig(gamma=4, max_running=2))
    req = engine.add_request(prompt, params)
    while not req.finished:
        engine.step()
    assert req.output == plain  # the engine's room rule, the same


def test_an_option_a_drafter_does_not_take_is_named():
    with pytest.raises(DrafterError, match="'ngram' drafter takes no option 'calibration'; it takes gamma"):
        make_drafter("ngram", calibration=False)


def test_calibrate_names_malformed_prompt_lines_before_loading(tmp_path, monkeypatch):
    import dspark.calibrate as calibrate

    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"turns": ["one"]}\n{"turns": \n' + "".join(f'{{"turns": ["q{i}"]}}\n' for i in range(5)))
    monkeypatch.setattr(calibrate, "load_model", lambda *a, **k: pytest.fail("loaded the model first"))
    with pytest.raises(ValueError, match="line 2: .*use --skip-bad"):
        calibrate._roll_out(calibrate.CalibrateConfig(drafter="dspark", prompts=str(prompts)))
    assert calibrate.read_turns(str(prompts), 0, 10, skip_bad=True) == ["one"] + [f"q{i}" for i in range(5)]


def test_calibrate_refuses_a_drafter_without_confidences_in_one_line(tmp_path, capsys):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(f'{{"turns": ["q{i}"]}}\n' for i in range(4)))
    assert main(["calibrate", "--drafter", "ngram", "--prompts", str(prompts)]) == 2  # was a TypeError
    err = "\n".join(ln for ln in capsys.readouterr().err.strip().splitlines() if not ln.startswith("[dspark] "))
    assert err.startswith("error:") and "no confidence head" in err and "\n" not in err
