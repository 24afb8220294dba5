"""Trainer checkpoints: everything needed to continue a run exactly, written atomically.

<run>/checkpoints/step-00000100/
    drafter/            a complete drafter directory (fp32), loadable by `make_drafter`
    trainer_state.pt    optimizer state, step, RNG states, the config it was trained with
<run>/checkpoints/latest.json   {"step": 100, "dir": "step-00000100"}

The step directory is assembled under a temporary name and renamed into place, then latest.json is replaced;
so after an interruption or a full disk the previous checkpoint is still complete and still the latest.
"""
from __future__ import annotations

import json
import os
import random
import shutil
import tempfile
from pathlib import Path

import numpy as np
import torch

from ..drafters.dspark_checkpoint import save_drafter

LATEST, STATE, DRAFTER = "latest.json", "trainer_state.pt", "drafter"


def rng_state() -> dict:
    return {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": np.random.get_state()}


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])


def save_checkpoint(run_dir: str | Path, step: int, model, target, optimizer, *, config: dict,
                    target_name: str | None, chat_template: str | None, extra: dict, keep: int) -> Path:
    root = Path(run_dir) / "checkpoints"
    root.mkdir(parents=True, exist_ok=True)
    name = f"step-{step:08d}"
    tmp = Path(tempfile.mkdtemp(prefix=f".{name}.", dir=root))
    tmp.chmod(0o755)  # mkdtemp makes it private; the renamed directory is an ordinary one
    try:
        save_drafter(tmp / DRAFTER, model, target, target_name=target_name, chat_template=chat_template,
                     training={"step": step, **extra})
        torch.save({"step": step, "optimizer": optimizer.state_dict(), "rng": rng_state(), "config": config,
                    "extra": extra}, tmp / STATE)
        final = root / name
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    pointer = root / f".{LATEST}.tmp"
    pointer.write_text(json.dumps({"step": step, "dir": name}) + "\n")
    os.replace(pointer, root / LATEST)
    _prune(root, keep, name)
    return root / name


def _prune(root: Path, keep: int, current: str) -> None:
    steps = sorted(p for p in root.glob("step-*") if p.is_dir())
    for old in steps[: max(0, len(steps) - max(keep, 1))]:
        if old.name != current:
            shutil.rmtree(old, ignore_errors=True)


def _complete(path: Path) -> bool:
    return (path / STATE).is_file() and (path / DRAFTER / "model.safetensors").is_file()


def latest_checkpoint(run_dir: str | Path) -> Path | None:
    """The newest complete checkpoint (latest.json first; a scan if it is missing or points nowhere)."""
    root = Path(run_dir) / "checkpoints"
    try:
        pointed = root / json.loads((root / LATEST).read_text())["dir"]
        if _complete(pointed):
            return pointed
    except (OSError, ValueError, KeyError):
        pass
    for path in sorted(root.glob("step-*"), reverse=True):
        if path.is_dir() and _complete(path):
            return path
    return None


def load_checkpoint(path: Path, model, optimizer) -> dict:
    """Restore model weights, optimizer and RNG in place; -> the trainer state (step, config, extra)."""
    from safetensors.torch import load_file

    tensors = load_file(str(path / DRAFTER / "model.safetensors"))
    model.load_state_dict(tensors)
    state = torch.load(path / STATE, weights_only=False)
    optimizer.load_state_dict(state["optimizer"])
    set_rng_state(state["rng"])
    return state
