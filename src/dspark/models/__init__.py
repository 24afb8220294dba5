"""Target runtime: config parsing, loading (HF dir / GGUF / embedded / hub), our own forward, KV caches."""
from .config import ModelConfig, ModelConfigError, parse_hf_config
from .kv_cache import KVCache
from .loader import DEFAULT_MODEL, LoadedModel, ModelNotFoundError, load_model, resolve
from .transformer import ForwardOutput, Segment, Transformer

__all__ = ["DEFAULT_MODEL", "ForwardOutput", "KVCache", "LoadedModel", "ModelConfig", "ModelConfigError",
           "ModelNotFoundError", "Segment", "Transformer", "load_model", "parse_hf_config", "resolve"]
