"""HF-named tensors -> a runnable `Transformer` (projections fused, Gemma norms folded to 1 + w)."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Mapping

import torch

from .config import ModelConfig
from .layers import Projection
from .transformer import LayerWeights, Transformer


class WeightsError(ValueError):
    pass


def _strip_prefix(name: str) -> str:
    # Multimodal Gemma3 checkpoints nest the text tower one level down.
    for prefix in ("model.language_model.", "language_model.model."):
        if name.startswith(prefix):
            return "model." + name[len(prefix):]
    if name.startswith("language_model.lm_head."):
        return name[len("language_model."):]
    return name


def read_safetensors(model_dir: str | Path) -> dict[str, torch.Tensor]:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    model_dir = Path(model_dir)
    files = sorted(model_dir.glob("*.safetensors"))
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        missing = [s for s in shards if not (model_dir / s).is_file()]
        if missing:
            raise WeightsError(f"{model_dir}: shards listed in the index are missing: {missing}")
        files = [model_dir / s for s in shards]
    if not files:
        present = sorted(p.name for p in model_dir.iterdir())
        raise WeightsError(f"{model_dir} has no *.safetensors weights (found: {present})")
    tensors: dict[str, torch.Tensor] = {}
    for f in files:
        try:
            tensors.update(load_file(str(f)))
        except (SafetensorError, OSError, ValueError) as exc:
            raise WeightsError(f"{f} is corrupt or truncated: {exc}") from None
    return {_strip_prefix(k): v for k, v in tensors.items()}


def build_transformer(config: ModelConfig, tensors: Mapping[str, torch.Tensor],
                      dtype: torch.dtype = torch.float32, fast_kernels: bool | None = None,
                      device: torch.device | str = "cpu") -> Transformer:
    """fast_kernels: CPU kernels faster than plain `linear` (False: the plain reference path). Pre-packed oneDNN
    copies double the weight memory, so by default only when the weights take under 2 GB; our C kernel for
    decode-sized products (models/native.py) needs no copy. Never off the CPU."""
    device = torch.device(device)
    small = sum(t.numel() for t in tensors.values()) * torch.finfo(dtype).bits // 8 < 2 << 30
    fast = device.type == "cpu" and fast_kernels is not False
    packed = fast and (fast_kernels or small)

    def proj(weight: torch.Tensor, bias: torch.Tensor | None = None) -> Projection:
        return Projection(weight, bias, packed=packed, native=fast)

    def take(name: str, required: bool = True) -> torch.Tensor | None:
        t = tensors.get(name)
        if t is None and required:
            raise WeightsError(f"weights lack the tensor {name!r} expected for a {config.family} model "
                               f"({len(tensors)} tensors present)")
        return None if t is None else t.to(device=device, dtype=dtype).contiguous()

    def norm(name: str, required: bool = True) -> torch.Tensor | None:
        w = take(name, required)
        if w is not None and config.gemma_norm:
            w = (1.0 + w.float()).to(dtype)  # Gemma's RMSNorm scales by (1 + w)
        return w

    layers = []
    for i in range(config.num_layers):
        p = f"model.layers.{i}."
        q, k, v = (take(p + f"self_attn.{n}_proj.weight") for n in "qkv")
        bias = None
        if config.attention_bias:
            bias = torch.cat([take(p + f"self_attn.{n}_proj.bias") for n in "qkv"])
        gemma = config.gemma_norm
        layers.append(LayerWeights(
            attn_norm=norm(p + "input_layernorm.weight"),
            qkv=proj(torch.cat([q, k, v]).contiguous(), bias),
            o=proj(take(p + "self_attn.o_proj.weight"), take(p + "self_attn.o_proj.bias", required=False)),
            ffn_norm=norm(p + ("pre_feedforward_layernorm.weight" if gemma else "post_attention_layernorm.weight")),
            gate_up=proj(torch.cat([take(p + "mlp.gate_proj.weight"), take(p + "mlp.up_proj.weight")]).contiguous()),
            down=proj(take(p + "mlp.down_proj.weight")),
            q_norm=norm(p + "self_attn.q_norm.weight") if config.qk_norm else None,
            k_norm=norm(p + "self_attn.k_norm.weight") if config.qk_norm else None,
            post_attn_norm=norm(p + "post_attention_layernorm.weight") if gemma else None,
            post_ffn_norm=norm(p + "post_feedforward_layernorm.weight") if gemma else None,
        ))
    embed = take("model.embed_tokens.weight")
    if embed.shape != (config.vocab_size, config.hidden_size):
        raise WeightsError(f"embedding has shape {tuple(embed.shape)}, config expects "
                           f"({config.vocab_size}, {config.hidden_size})")
    head = embed if config.tie_embeddings else take("lm_head.weight", required=False)
    if head is None:
        head = embed  # some exports omit lm_head when it equals the embedding
    return Transformer(config, embed, layers, norm("model.norm.weight"), proj(head))
