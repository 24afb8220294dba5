"""GGUF file -> Hugging Face layout (config dict + fp32 tensors with HF names), de-quantised with `gguf`.

Two conventions of llama.cpp's converter must be undone: Llama q/k rows are interleaved per head for its
rotary kernel (Qwen2/Qwen3 use the NeoX rotation there and are stored as in Hugging Face), and Gemma norm weights
are stored as (1 + w).
"""
from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import torch

_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
# Norms whose meaning depends on the family (sandwich norms in Gemma).
_FFN_NORM = {"llama": "post_attention_layernorm", "qwen2": "post_attention_layernorm",
             "qwen3": "post_attention_layernorm", "gemma3": "pre_feedforward_layernorm"}
_GEMMA_NORMS = {"post_attention_norm": "post_attention_layernorm", "post_ffw_norm": "post_feedforward_layernorm"}
_MODEL_TYPE = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "gemma3": "gemma3_text"}


class GGUFError(ValueError):
    pass


def _field(reader, key: str, default=None):
    f = reader.fields.get(key)
    return default if f is None else f.contents()


def _unpermute(w: np.ndarray, heads: int) -> np.ndarray:
    """Undo llama.cpp's per-head (hd/2, 2) interleave of q/k rows back to HF's rotate-half layout."""
    rows = w.shape[0]
    return w.reshape(heads, rows // heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _hf_name(name: str, arch: str) -> str | None:
    if name == "token_embd.weight":
        return "model.embed_tokens.weight"
    if name == "output_norm.weight":
        return "model.norm.weight"
    if name == "output.weight":
        return "lm_head.weight"
    m = re.fullmatch(r"blk\.(\d+)\.(\w+)\.(weight|bias)", name)
    if not m:
        return None
    layer, part, kind = m.groups()
    if part == "ffn_norm":
        target = _FFN_NORM[arch]
    elif arch == "gemma3" and part in _GEMMA_NORMS:
        target = _GEMMA_NORMS[part]
    else:
        target = _LAYER_NAMES.get(part)
    return None if target is None else f"model.layers.{layer}.{target}.{kind}"


def read_gguf(path: str | Path) -> tuple[dict, dict[str, torch.Tensor], object]:
    """Returns (HF-style config dict, {hf_name: fp32 tensor}, the GGUFReader for tokenizer metadata)."""
    from gguf import GGUFReader
    from gguf.quants import dequantize

    try:
        reader = GGUFReader(str(path))
    except Exception as exc:  # the gguf package raises assorted errors on truncated files
        raise GGUFError(f"{path} is not a readable GGUF file ({type(exc).__name__}: {exc})") from None
    arch = _field(reader, "general.architecture")
    if arch not in _MODEL_TYPE:
        raise GGUFError(f"{path}: GGUF architecture {arch!r} is not supported; supported: {', '.join(_MODEL_TYPE)}")
    config = _config_from_fields(reader, arch)
    tensors: dict[str, torch.Tensor] = {}
    for t in reader.tensors:
        name = _hf_name(t.name, arch)
        if name is None:
            continue  # e.g. rope_freqs: recomputed from the config
        w = np.array(dequantize(t.data, t.tensor_type), dtype=np.float32)  # writable copy
        if arch == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = config["num_attention_heads"] if "q_proj" in name else config["num_key_value_heads"]
            w = _unpermute(w, heads)
        if arch == "gemma3" and "norm" in name:
            w = w - 1.0
        tensors[name] = torch.from_numpy(np.ascontiguousarray(w))
    config["vocab_size"] = int(tensors["model.embed_tokens.weight"].shape[0])
    config["tie_word_embeddings"] = "lm_head.weight" not in tensors
    return config, tensors, reader


def _config_from_fields(reader, arch: str) -> dict:
    def get(key, default=None):
        return _field(reader, f"{arch}.{key}", default)

    hidden, heads = int(get("embedding_length")), int(get("attention.head_count"))
    config = {
        "model_type": _MODEL_TYPE[arch],
        "architectures": [{"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
                           "gemma3": "Gemma3ForCausalLM"}[arch]],
        "hidden_size": hidden,
        "intermediate_size": int(get("feed_forward_length")),
        "num_hidden_layers": int(get("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(get("attention.head_count_kv", heads)),
        "head_dim": int(get("attention.key_length", hidden // heads)),
        "rms_norm_eps": float(get("attention.layer_norm_rms_epsilon", 1e-6)),
        "max_position_embeddings": int(get("context_length", 2048)),
        "rope_theta": float(get("rope.freq_base", 10000.0)),
        "bos_token_id": _field(reader, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": _field(reader, "tokenizer.ggml.eos_token_id"),
        "torch_dtype": "float32",
    }
    if arch == "gemma3":
        config["sliding_window"] = int(get("attention.sliding_window", 512))
        config["query_pre_attn_scalar"] = config["head_dim"]
        config["rope_local_base_freq"] = 10000.0
        config["hidden_activation"] = "gelu_pytorch_tanh"
    scaling = get("rope.scaling.type")
    if scaling and scaling != "none":
        original = int(get("rope.scaling.original_context_length", config["max_position_embeddings"]))
        config["rope_scaling"] = {"rope_type": scaling, "factor": float(get("rope.scaling.factor", 1.0)),
                                  "original_max_position_embeddings": original}
    return config


def gguf_chat_template(reader) -> str | None:
    return _field(reader, "tokenizer.chat_template")
