"""GGUF files of each family, written here the way llama.cpp's converter lays them out (its tensor names from the
`gguf` package's own name map; Llama's q/k rows interleaved per head), read back by our converter: the same logits
as the transformers model they were written from."""
import numpy as np
import pytest
import torch

from dspark.models import Segment
from dspark.models.config import parse_hf_config
from dspark.models.gguf_convert import read_gguf
from dspark.models.weights import build_transformer
from helpers import TINY, hf_model

gguf = pytest.importorskip("gguf")

ARCH = {"llama": gguf.MODEL_ARCH.LLAMA, "qwen2": gguf.MODEL_ARCH.QWEN2, "qwen3": gguf.MODEL_ARCH.QWEN3}


def llama_cpp_permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's Llama q/k layout: within each head, the two rotary halves' rows interleaved."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf(model, kind: str, path) -> None:
    cfg, arch = model.config, ARCH[TINY[kind]["model_type"]]
    name = gguf.MODEL_ARCH_NAMES[arch]
    writer = gguf.GGUFWriter(str(path), name)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_key_length(getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads)
    writer.add_rope_freq_base(float(getattr(cfg, "rope_theta", None) or cfg.rope_parameters["rope_theta"]))
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    names = gguf.get_tensor_name_map(arch, cfg.num_hidden_layers)
    for hf_name, t in model.state_dict().items():
        if hf_name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        w = t.detach().float().numpy().copy()
        if name == "llama" and hf_name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = cfg.num_attention_heads if "q_proj" in hf_name else cfg.num_key_value_heads
            w = llama_cpp_permute(w, heads)
        writer.add_tensor(names.get_name(hf_name, try_suffixes=(".weight", ".bias")), w)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.mark.parametrize("kind", ["llama", "qwen2", "qwen3"])
def test_gguf_of_each_family_gives_the_transformers_logits(kind, tmp_path):
    hf = hf_model(kind)
    write_gguf(hf, kind, tmp_path / "tiny.gguf")
    config, tensors, _ = read_gguf(tmp_path / "tiny.gguf")
    ours = build_transformer(parse_hf_config(config), tensors, torch.float32)
    assert ours.config.attention_bias == (kind == "qwen2")
    ids = torch.randint(0, TINY[kind]["vocab_size"], (19,), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        ref = hf(ids[None]).logits[0]
    got = ours.forward(ids, [Segment(ours.new_cache(), 0, len(ids))]).logits
    assert float((got - ref).abs().max() / ref.abs().max()) < 1e-4
