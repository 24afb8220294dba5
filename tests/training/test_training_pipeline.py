"""End to end on a tiny target, through the CLI: datagen -> cache estimate/build -> train -> load -> decode.

Decoding uses the real single-request loop (`Generation`) with an adapter that feeds the drafter the hidden
states of committed tokens — the observe() contract the engine implements.
"""
import json

import pytest
import torch

from dspark.decoding import SamplingParams
import dspark.drafters.dflash  # noqa: F401  (registers checkpoint:dspark and checkpoint:dflash)
from dspark.drafters.base import Drafter, make_drafter
from dspark.engine import Generation, TransformerTarget
from dspark.models import load_model
from dspark.models.transformer import Segment
from dspark.training.cli import main
from tiny_target import make_target_dir, write_prompts


class ObservingTarget(TransformerTarget):
    """Runs every forward with the drafter's layer taps and remembers them until the drafter is next asked."""

    def __init__(self, model, layers):
        super().__init__(model)
        self.layers, self.pending = layers, None

    def forward(self, state, start, tokens):
        out = self.model.forward(torch.tensor(tokens), [Segment(state, start, len(tokens))], hidden_layers=self.layers)
        self.pending = (state, start, out.hidden)
        return out.logits


class ObservingDrafter(Drafter):
    def __init__(self, inner, target: ObservingTarget):
        super().__init__(inner.gamma)
        self.inner, self.target = inner, target

    def propose(self, requests, depth=None):
        state, start, hidden = self.target.pending  # committed = what the loop kept in the target cache
        self.inner.observe(requests[0], hidden, state.length - start, start=start)
        return self.inner.propose(requests, depth)

    def release(self, request):
        self.inner.release(request)


@pytest.mark.parametrize("family", ["llama", "qwen2", "gemma3_text"])
def test_pipeline(tmp_path, family):
    """Any supported target: Llama, Qwen2 (biases in the drafter layer initialised from the target's), Gemma3
    (sandwich norms, sliding window, soft-capped logits)."""
    target_dir = make_target_dir(tmp_path / "target", family=family)
    prompts = write_prompts(tmp_path / "prompts.jsonl", 8)
    gen, cache, run = tmp_path / "gen", tmp_path / "cache", tmp_path / "run"
    model = ["--model", str(target_dir)]
    assert main(["datagen", "--prompts", str(prompts), "--out", str(gen), "--max-new-tokens", "24",
                 "--batch-size", "4", "--no-progress", *model]) == 0
    assert main(["cache", "estimate", "--data", str(gen), "--layers", "0,2", *model]) == 0
    assert main(["cache", "build", "--data", str(gen), "--out", str(cache), "--layers", "0,1,2", "--no-progress",
                 *model]) == 0
    config = tmp_path / "train.toml"
    config.write_text(f"""
[target]
name = "{target_dir}"
[drafter]
layer_ids = [0, 2]
block_size = 4
rank = 8
[data]
cache = "{cache}"
anchors_per_seq = 8
[optim]
batch_seqs = 4
max_steps = 3
warmup_steps = 1
[run]
out_dir = "{run}"
""")
    assert main(["train", "--config", str(config), "--set", "optim.lr=1e-3", "--set", "run.tf32=true",
                 "--no-progress"]) == 0
    assert torch.get_float32_matmul_precision() == "highest"  # TF32 is for a CUDA target only
    saved = json.loads((run / "drafter" / "config.json").read_text())
    assert saved["drafter_type"] == "dspark" and saved["arch"]["layer_ids"] == [0, 2]
    assert saved["chat_template"] and saved["target"]["vocab_size"] == 96

    loaded = load_model(str(target_dir))
    drafter = make_drafter(str(run / "drafter"), target=loaded)
    assert (drafter.model.layers[0].qkv.bias is not None) == (family == "qwen2")  # the target family's layer
    observing = ObservingTarget(loaded.model, drafter.needs_layers)
    params = SamplingParams(temperature=0, max_new_tokens=30, ignore_eos=True)
    prompt = [0, 10, 11, 12, 13, 1]
    spec = Generation(observing, ObservingDrafter(drafter, observing), prompt, params)
    plain = Generation(TransformerTarget(loaded.model), None, prompt, params)
    assert [t for c in spec for t in c] == [t for c in plain for t in c]
    assert spec.stats.rounds < 30 or spec.stats.accepted == 0
