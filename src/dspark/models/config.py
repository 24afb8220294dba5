"""The architecture record of a target model, parsed once from a Hugging Face `config.json`.

One frozen record covers the Llama, Mistral, Qwen2 (2.5), Qwen3 and Gemma3 families; the forward pass branches on
a handful of flags rather than on the family name, so a new family is a new parser, not a new forward.
"""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path

SUPPORTED_FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "gemma3_text")
_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


class ModelConfigError(ValueError):
    """A config.json we cannot run, with the reason."""


@dataclass(frozen=True)
class RopeSpec:
    """Rotary embedding of one layer type (Gemma3 uses two: local and global)."""

    theta: float
    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0  # llama3
    high_freq_factor: float = 4.0  # llama3
    original_max_position: int = 8192  # llama3, yarn
    beta_fast: float = 32.0  # yarn
    beta_slow: float = 1.0  # yarn
    attention_factor: float | None = None  # yarn; None = derived from factor
    truncate: bool = True  # yarn

    def __post_init__(self) -> None:
        if self.rope_type not in _ROPE_TYPES:
            raise ModelConfigError(f"rope type {self.rope_type!r} is not supported; supported: {_ROPE_TYPES}")


@dataclass(frozen=True)
class ModelConfig:
    family: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_eps: float
    max_position: int
    tie_embeddings: bool
    rope: RopeSpec
    rope_local: RopeSpec | None = None  # Gemma3 sliding layers
    activation: str = "silu"  # "silu" | "gelu_tanh"
    attention_bias: bool = False
    qk_norm: bool = False  # Qwen3, Gemma3
    gemma_norm: bool = False  # RMSNorm weight used as (1 + w), sandwich norms, scaled embedding
    query_scale: float | None = None  # softmax scale; None = head_dim ** -0.5
    sliding_window: int | None = None
    layer_types: tuple[str, ...] = ()  # per layer: "full_attention" | "sliding_attention"
    final_logit_softcap: float | None = None
    attn_logit_softcap: float | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    extra: dict = field(default_factory=dict, compare=False, hash=False)

    def __post_init__(self) -> None:
        if self.family not in SUPPORTED_FAMILIES:
            raise ModelConfigError(
                f"model family {self.family!r} is not supported; supported: {', '.join(SUPPORTED_FAMILIES)}")
        if self.num_heads % self.num_kv_heads:
            raise ModelConfigError(f"num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}")
        if len(self.layer_types) != self.num_layers:
            raise ModelConfigError(f"layer_types has {len(self.layer_types)} entries for {self.num_layers} layers")

    def is_sliding(self, layer: int) -> bool:
        return self.layer_types[layer] == "sliding_attention" and self.sliding_window is not None

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def _rope_from(params: dict | None, fallback_theta: float, max_position: int) -> RopeSpec:
    params = dict(params or {})
    rope_type = params.get("rope_type", params.get("type", "default")) or "default"
    theta = float(params.get("rope_theta", fallback_theta))
    factor = float(params.get("factor", 1.0) or 1.0)
    return RopeSpec(
        theta=theta,
        rope_type=rope_type,
        factor=factor,
        low_freq_factor=float(params.get("low_freq_factor", 1.0)),
        high_freq_factor=float(params.get("high_freq_factor", 4.0)),
        original_max_position=int(params.get("original_max_position_embeddings", max_position)),
        beta_fast=float(params.get("beta_fast") or 32.0),
        beta_slow=float(params.get("beta_slow") or 1.0),
        attention_factor=params.get("attention_factor"),
        truncate=bool(params.get("truncate", True)),
    )


def _eos_ids(value) -> tuple[int, ...]:
    if value is None:
        return ()
    return tuple(int(v) for v in (value if isinstance(value, (list, tuple)) else [value]))


def parse_hf_config(raw: dict) -> ModelConfig:
    """Turn a Hugging Face config dict (transformers 4.x or 5.x conventions) into a ModelConfig."""
    raw = dict(raw)
    if raw.get("model_type") == "gemma3" and "text_config" in raw:  # multimodal wrapper: use the text tower
        raw = {**raw["text_config"], "model_type": "gemma3_text"}
    family = raw.get("model_type")
    if family not in SUPPORTED_FAMILIES:
        raise ModelConfigError(
            f"model_type {family!r} is not supported; supported: {', '.join(SUPPORTED_FAMILIES)}")
    try:
        hidden, heads = int(raw["hidden_size"]), int(raw["num_attention_heads"])
        layers = int(raw["num_hidden_layers"])
        max_pos = int(raw.get("max_position_embeddings", 2048))
        head_dim = int(raw.get("head_dim") or hidden // heads)
        rope_params = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
        default_theta = float(raw.get("rope_theta", 10000.0))
        gemma = family == "gemma3_text"
        if gemma:
            layer_types = tuple(raw.get("layer_types") or _gemma_layer_types(raw, layers))
            if "full_attention" in rope_params:
                rope = _rope_from(rope_params["full_attention"], default_theta, max_pos)
                rope_local = _rope_from(rope_params["sliding_attention"], 10000.0, max_pos)
            else:  # transformers 4.x: rope_theta + rope_local_base_freq + optional rope_scaling for global layers
                rope = _rope_from(rope_params, default_theta, max_pos)
                rope_local = RopeSpec(theta=float(raw.get("rope_local_base_freq", 10000.0)))
        else:
            layer_types = tuple(raw.get("layer_types") or _layer_types(raw, family, layers))
            rope, rope_local = _rope_from(rope_params, default_theta, max_pos), None
        # Mistral's window applies whenever it is set; Qwen's only with use_sliding_window
        windowed = gemma or family == "mistral" or raw.get("use_sliding_window")
        sliding = raw.get("sliding_window") if windowed else None
        activation = raw.get("hidden_activation") or raw.get("hidden_act", "silu")
        return ModelConfig(
            family=family,
            vocab_size=int(raw["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(raw["intermediate_size"]),
            num_layers=layers,
            num_heads=heads,
            num_kv_heads=int(raw.get("num_key_value_heads") or heads),
            head_dim=head_dim,
            rms_eps=float(raw.get("rms_norm_eps", 1e-6)),
            max_position=max_pos,
            tie_embeddings=bool(raw.get("tie_word_embeddings", gemma)),
            rope=rope,
            rope_local=rope_local,
            activation="gelu_tanh" if "gelu" in activation else "silu",
            attention_bias=family == "qwen2" or bool(raw.get("attention_bias", False)),  # Qwen2: q, k, v biases
            qk_norm=family in ("qwen3", "gemma3_text"),
            gemma_norm=gemma,
            query_scale=float(raw["query_pre_attn_scalar"]) ** -0.5 if gemma else None,
            sliding_window=int(sliding) if sliding else None,
            layer_types=layer_types,
            final_logit_softcap=raw.get("final_logit_softcapping"),
            attn_logit_softcap=raw.get("attn_logit_softcapping"),
            bos_token_id=raw.get("bos_token_id"),
            eos_token_ids=_eos_ids(raw.get("eos_token_id")),
        )
    except KeyError as exc:
        raise ModelConfigError(f"config.json lacks the required field {exc.args[0]!r}") from None


def _layer_types(raw: dict, family: str, layers: int) -> list[str]:
    """What transformers derives when config.json lists no layer_types: Mistral slides every layer when its window
    is set; Qwen2/Qwen3 with use_sliding_window slide the layers from max_window_layers on."""
    window = raw.get("sliding_window")
    if family == "mistral" and window:
        return ["sliding_attention"] * layers
    if family in ("qwen2", "qwen3") and window and raw.get("use_sliding_window"):
        first = int(raw.get("max_window_layers", layers))
        return ["sliding_attention" if i >= first else "full_attention" for i in range(layers)]
    return ["full_attention"] * layers


def _gemma_layer_types(raw: dict, layers: int) -> list[str]:
    pattern = int(raw.get("sliding_window_pattern", raw.get("_sliding_window_pattern", 6)))
    return ["full_attention" if (i + 1) % pattern == 0 else "sliding_attention" for i in range(layers)]


def load_hf_config(model_dir: str | Path) -> ModelConfig:
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise ModelConfigError(f"{model_dir} has no config.json (expected a Hugging Face model directory)")
    try:
        raw = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ModelConfigError(f"{path} is not valid JSON: {exc}") from None
    return parse_hf_config(raw)
