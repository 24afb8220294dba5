"""Drafter checkpoints: a directory with model.safetensors + config.json (+ calibration.json from `calibrate`).

config.json records the architecture, the target it was trained for (name, shapes and an embedding signature)
and the chat template used for its data. The frozen embedding and LM head are not stored: they come from the
target at load time, which is why a drafter made for another target must be refused rather than run.
"""
from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import torch

from ..models.transformer import Transformer
from .base import DrafterError
from .dspark_model import DrafterArch, DSparkModel

FORMAT, VERSION = "dspark.drafter", 1
WEIGHTS, CONFIG, CALIBRATION = "model.safetensors", "config.json", "calibration.json"
_SHAPE_FIELDS = ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim")


def embed_signature(embed: torch.Tensor, rows: int = 16) -> list[float]:
    """Projections of a few embedding rows on a fixed random direction: equal (to rounding) for the same
    weights in any precision, unrelated for another model with the same shapes."""
    idx = torch.linspace(0, embed.shape[0] - 1, rows).long()
    direction = torch.randn(embed.shape[1], generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    sample = embed.detach()[idx.to(embed.device)].double().cpu()  # [rows, hidden], on the CPU for any target
    return [round(float(x), 6) for x in sample @ direction]


def target_fingerprint(target: Transformer, name: str | None = None) -> dict:
    c = target.config
    return {"name": name, "family": c.family, "vocab_size": c.vocab_size, "hidden_size": c.hidden_size,
            "num_layers": c.num_layers, "num_heads": c.num_heads, "num_kv_heads": c.num_kv_heads,
            "head_dim": c.head_dim, "embed_signature": embed_signature(target.embed)}


def check_target(saved: dict, target: Transformer, where: str, strict: bool = True) -> None:
    """Refuse a drafter whose recorded target differs in shape (always) or in weights (when strict)."""
    now = target_fingerprint(target)
    bad = [f"{k}: drafter {saved.get(k)} vs target {now[k]}" for k in _SHAPE_FIELDS if saved.get(k) != now[k]]
    if bad:
        raise DrafterError(f"{where} was made for another target ({saved.get('name') or 'unnamed'}, "
                           f"{saved.get('family')}); mismatched: {'; '.join(bad)}")
    a = torch.tensor(saved.get("embed_signature") or [], dtype=torch.float64)
    b = torch.tensor(now["embed_signature"], dtype=torch.float64)
    if strict and (a.shape != b.shape or (a - b).norm() > 1e-2 * b.norm() + 1e-6):
        raise DrafterError(f"{where} was trained for a target with the same shapes but different embedding "
                           f"weights ({saved.get('name') or 'unnamed'}); pass strict_target=False to use it anyway")


def save_drafter(out_dir: str | os.PathLike, model: DSparkModel, target: Transformer, *, target_name: str | None,
                 chat_template: str | None = None, training: dict | None = None,
                 dtype: torch.dtype = torch.float32) -> Path:
    """Write atomically: a reader (or a crash) sees the previous checkpoint or the complete new one."""
    from safetensors.torch import save_file

    out = Path(out_dir)
    out.parent.mkdir(parents=True, exist_ok=True)
    config = {"format": FORMAT, "version": VERSION, "drafter_type": model.arch.drafter_type,
              "arch": model.arch.to_dict(), "target": target_fingerprint(target, target_name),
              "chat_template": chat_template, "weights_dtype": str(dtype).replace("torch.", ""),
              "training": training or {}}
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    tmp.chmod(0o755)  # mkdtemp makes it private; the renamed directory is an ordinary one
    try:
        # Integer buffers (the draft vocabulary's ids) keep their dtype.
        tensors = {k: v.detach().to("cpu", dtype if v.is_floating_point() else v.dtype).contiguous()
                   for k, v in model.state_dict().items()}
        save_file(tensors, str(tmp / WEIGHTS))
        (tmp / WEIGHTS).chmod(0o644)  # safetensors writes owner-only files; weights are ordinary files
        (tmp / CONFIG).write_text(json.dumps(config, indent=2) + "\n")
        old = out.with_name(f".{out.name}.old")
        if out.exists():
            shutil.rmtree(old, ignore_errors=True)
            os.replace(out, old)
        os.replace(tmp, out)
        shutil.rmtree(old, ignore_errors=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def read_config(path: str | os.PathLike) -> dict:
    path = Path(path)
    try:
        config = json.loads((path / CONFIG).read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise DrafterError(f"{path}: cannot read {CONFIG} ({type(exc).__name__}: {exc})") from None
    if config.get("format") != FORMAT or config.get("version") != VERSION:
        raise DrafterError(f"{path}/{CONFIG}: expected format {FORMAT!r} version {VERSION}, "
                           f"got {config.get('format')!r} version {config.get('version')!r}")
    return config


def load_drafter_model(path: str | os.PathLike, target: Transformer, strict_target: bool = True,
                       model_cls=DSparkModel) -> tuple[DSparkModel, dict]:
    """-> (model in eval mode, fp32, config.json contents). Missing or unexpected weights are refused.
    `model_cls(arch, target)` builds the network (DSparkModel; Eagle3Model for the EAGLE-3 baseline)."""
    from safetensors.torch import load_file

    path = Path(path)
    config = read_config(path)
    try:
        arch = DrafterArch.from_dict(config["arch"])
    except (KeyError, TypeError, ValueError) as exc:
        raise DrafterError(f"{path}/{CONFIG}: invalid 'arch' ({exc})") from None
    if arch.drafter_type != config.get("drafter_type"):
        raise DrafterError(f"{path}/{CONFIG}: drafter_type {config.get('drafter_type')!r} disagrees with "
                           f"arch.drafter_type {arch.drafter_type!r}")
    check_target(config.get("target", {}), target, str(path), strict_target)
    model = model_cls(arch, target)
    try:
        tensors = load_file(str(path / WEIGHTS))
    except Exception as exc:  # missing, truncated or corrupt file
        raise DrafterError(f"{path}/{WEIGHTS}: cannot read the weights ({type(exc).__name__}: {exc})") from None
    expected = model.state_dict()
    missing = sorted(set(expected) - set(tensors))
    if missing:
        part = "Markov/RNN head" if any(k.startswith("head.") for k in missing) else (
            "confidence head" if any(k.startswith("confidence.") for k in missing) else "backbone")
        raise DrafterError(f"{path}/{WEIGHTS} lacks {len(missing)} {part} tensor(s) that config.json declares "
                           f"(head={arch.head!r}, rank={arch.rank}, confidence={arch.confidence}): {missing[:6]}")
    unexpected = sorted(set(tensors) - set(expected))
    if unexpected:
        raise DrafterError(f"{path}/{WEIGHTS} has tensors config.json does not declare: {unexpected[:6]}")
    wrong = [k for k in expected if tensors[k].shape != expected[k].shape]
    if wrong:
        raise DrafterError(f"{path}/{WEIGHTS}: shapes differ from config.json for {wrong[:6]}")
    model.load_state_dict({k: v.float() if v.is_floating_point() else v for k, v in tensors.items()})
    return model.eval().requires_grad_(False), config


def load_calibration(path: str | os.PathLike, block_size: int):
    """calibration.json next to the weights, or None. Temperatures must cover the drafter's block."""
    file = Path(path) / CALIBRATION
    if not file.is_file():
        return None
    from ..scheduling.calibration import Calibration  # lazy: scheduling is numpy-only and optional here

    cal = Calibration.load(file)
    if cal.gamma != block_size:
        raise DrafterError(f"{file} has {cal.gamma} temperatures but the drafter's block size is {block_size}")
    return cal
