"""Tiny random models of each family, built through the same path real checkpoints take."""
from __future__ import annotations

import json
from pathlib import Path

import torch

from dspark.models.config import parse_hf_config
from dspark.models.weights import build_transformer

SHARED = Path(__file__).resolve().parents[2] / "shared"
BENCH_DATA = SHARED / "bench_data"

TINY = {
    "llama": dict(model_type="llama", vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-5,
                  tie_word_embeddings=True, rope_theta=10000.0),
    "llama3_rope": dict(model_type="llama", vocab_size=96, hidden_size=64, intermediate_size=128,
                        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=1,
                        max_position_embeddings=256, tie_word_embeddings=False, attention_bias=True,
                        rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                          original_max_position_embeddings=32), rope_theta=500000.0),
    "qwen3": dict(model_type="qwen3", vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=256,
                  tie_word_embeddings=False, rope_theta=1000000.0),
    "qwen3_yarn": dict(model_type="qwen3", vocab_size=96, hidden_size=64, intermediate_size=128,
                       num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                       max_position_embeddings=256, tie_word_embeddings=True,
                       rope_scaling=dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=64),
                       rope_theta=10000.0),
    "qwen2": dict(model_type="qwen2", vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                  tie_word_embeddings=False, rope_theta=1000000.0),
    "qwen2_sliding": dict(model_type="qwen2", vocab_size=96, hidden_size=64, intermediate_size=128,
                          num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=1,
                          max_position_embeddings=256, tie_word_embeddings=True, use_sliding_window=True,
                          sliding_window=5, max_window_layers=1, rope_theta=10000.0),
    "mistral": dict(model_type="mistral", vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, head_dim=24, max_position_embeddings=256,
                    tie_word_embeddings=False, sliding_window=6, rope_theta=10000.0),
    "gemma3": dict(model_type="gemma3_text", vocab_size=96, hidden_size=64, intermediate_size=128,
                   num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                   max_position_embeddings=256, sliding_window=5, query_pre_attn_scalar=16,
                   layer_types=["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"],
                   final_logit_softcapping=30.0, rope_theta=1000000.0, rope_local_base_freq=10000.0),
}


def hf_model(kind: str, seed: int = 0):
    """A randomly initialised transformers model (fp32, eager attention) for a tiny config."""
    from transformers import AutoConfig, AutoModelForCausalLM

    raw = dict(TINY[kind])
    config = AutoConfig.for_model(**raw)
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():  # random norms and biases, so a wrong (1 + w) or missing bias would show
        for name, p in model.named_parameters():
            if "norm" in name or "bias" in name:
                p.normal_(0, 0.3)
    return model


def ours_from_hf(model, fast_kernels: bool | None = None):
    raw = json.loads(model.config.to_json_string())
    config = parse_hf_config(raw)
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return build_transformer(config, state, torch.float32, fast_kernels=fast_kernels)


def chat_ids(tokenizer, text: str) -> list[int]:
    ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                        tokenize=True)
    if hasattr(ids, "keys"):
        ids = ids["input_ids"]
    return list(ids)


def bench_prompts(per_set: int, sets=("humaneval", "gsm8k", "mt-bench", "mbpp")) -> list[str]:
    out = []
    for name in sets:
        with open(BENCH_DATA / f"{name}.jsonl") as f:
            for i, line in enumerate(f):
                if i >= per_set:
                    break
                out.append(json.loads(line)["turns"][0])
    return out


class FakeClock:
    """A timer for measure_profile tests: ``job(tag, cost)`` is a step function that advances the clock by
    ``cost(*args)`` and records (tag, *args) in ``order``; call the clock itself for the time."""

    def __init__(self):
        self.now, self.order = 0.0, []

    def __call__(self) -> float:
        return self.now

    def job(self, tag, cost):
        def run(*args):
            self.order.append((tag, *args))
            self.now += cost(*args)
        return run
