"""Training sequences and their target features, behind one interface for both sources.

A `FeatureSource` gives, per sequence, the token ids and loss mask (cheap, always in memory) and — on demand —
the captured target layer states [S, m, d] and the final pre-LM-head hidden state [S, d] (after the target's
final norm: exactly what its LM head sees). `OnlineFeatures` runs the target; `target_cache.CachedFeatures`
reads what `dspark cache build` stored. Both round the features through the same storage precision, so a
batch gives the same loss from either source.
"""
from __future__ import annotations

import hashlib
import json
from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path

import torch

from ..models.layers import rms_norm
from ..models.transformer import Segment, Transformer
from .conversations import encode_conversation, jsonl_lines

STORAGE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "int8": torch.int8}


@dataclass
class SeqFeatures:
    layers: torch.Tensor  # [S, m, d] fp32
    final: torch.Tensor  # [S, d] fp32


@dataclass
class TokenizedData:
    ids: list[torch.Tensor]  # each [S] long
    masks: list[torch.Tensor]  # each [S] bool: assistant-produced tokens

    def __len__(self) -> int:
        return len(self.ids)

    def digest(self, count: int | None = None) -> str:
        """Hash of the first `count` sequences (ids and masks): detects a changed source on resume."""
        h = hashlib.sha256()
        for ids, mask in zip(self.ids[:count], self.masks[:count]):
            h.update(ids.to(torch.int32).numpy().tobytes())
            h.update(mask.to(torch.uint8).numpy().tobytes())
        return h.hexdigest()


def _data_file(path: Path) -> Path:
    """A datagen directory's data.jsonl (or its compressed copy, data.jsonl.xz), else the file itself."""
    if not path.is_dir():
        return path
    plain = path / "data.jsonl"
    return plain if plain.exists() or not (path / "data.jsonl.xz").exists() else path / "data.jsonl.xz"


def load_sequences(path: str | Path, tokenizer, max_seq_len: int, limit: int = 0) -> TokenizedData:
    """datagen output (directory, .jsonl, or .jsonl.xz / .gz): lines with "messages" (chat-rendered with the
    tokenizer's template) or pre-tokenised "input_ids" + "loss_mask". Skipped records and sequences too short to
    train on are dropped."""
    ids_out, masks_out = [], []
    for number, line in jsonl_lines(_data_file(Path(path))):
        if not line.strip():
            continue
        if not line.endswith("\n"):
            break  # a record datagen is still writing (or was interrupted writing): not data yet
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path} line {number}: not valid JSON ({exc.msg})") from None
        if rec.get("status", "ok") != "ok":
            continue
        if "input_ids" in rec:
            ids, mask = rec["input_ids"][:max_seq_len], rec["loss_mask"][:max_seq_len]
        elif "messages" in rec:
            ids, mask = encode_conversation(tokenizer, rec["messages"], max_seq_len)
        else:
            raise ValueError(f"{path} line {number}: a record needs 'messages' or 'input_ids'")
        if len(ids) != len(mask):
            raise ValueError(f"{path} line {number}: input_ids and loss_mask differ in length")
        if sum(mask) >= 2:  # an anchor and at least one target token
            ids_out.append(torch.tensor(ids, dtype=torch.long))
            masks_out.append(torch.tensor(mask, dtype=torch.bool))
        if limit and len(ids_out) >= limit:
            break
    return TokenizedData(ids_out, masks_out)


def quantize(x: torch.Tensor, dtype: str) -> tuple[torch.Tensor, torch.Tensor | None]:
    """x: [..., d] fp32 -> (stored values, per-row scales [...] for int8 else None)."""
    if dtype != "int8":
        return x.to(STORAGE_DTYPES[dtype]), None
    scale = x.abs().amax(dim=-1).clamp_min(1e-12) / 127.0  # absmax per row: outliers stay representable
    return torch.round(x / scale.unsqueeze(-1)).clamp(-127, 127).to(torch.int8), scale.float()


def dequantize(values: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
    x = values.float()
    return x * scale.unsqueeze(-1) if scale is not None else x


def round_trip(x: torch.Tensor, dtype: str) -> torch.Tensor:
    return dequantize(*quantize(x, dtype))


def compute_features(target: Transformer, sequences: list[torch.Tensor],
                     layer_ids: tuple[int, ...]) -> list[SeqFeatures]:
    """One ragged target forward over several sequences -> fp32 features of each (no rounding)."""
    last = target.config.num_layers - 1
    tokens = torch.cat(sequences).to(target.device)
    # On a GPU, cache-less segments: no keys kept, one padded attention call per layer for all sequences (a cache
    # and an attention call per sequence make ~1,900 small operators a sequence, which a GPU pays in launches).
    # A CPU pays for the padding instead: per sequence there (0.91-1.08x, scripts/features_cost.py).
    padded = target.device.type != "cpu"
    segments = [Segment(None if padded else target.new_cache(capacity=len(s)), 0, len(s)) for s in sequences]
    # Ask for the last layer's output and apply the final norm here: cheaper than LM-head logits for all rows.
    out = target.forward(tokens, segments, logit_rows=torch.tensor([0]), hidden_layers=(*layer_ids, last))
    final = rms_norm(out.hidden[last], target.final_norm, target.config.rms_eps).float()
    layers = torch.stack([out.hidden[i].float() for i in layer_ids], dim=1)  # [N, m, d]
    result, at = [], 0
    for s in sequences:
        # clone(): leave inference mode's tensors behind so autograd may use these as inputs.
        result.append(SeqFeatures(layers[at: at + len(s)].clone(), final[at: at + len(s)].clone()))
        at += len(s)
    return result


class FeatureSource(ABC):
    layer_ids: tuple[int, ...]
    data: TokenizedData

    def __len__(self) -> int:
        return len(self.data)

    def sequence(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.data.ids[i], self.data.masks[i]

    @abstractmethod
    def features(self, indices: list[int], lengths: list[int] | None = None) -> list[SeqFeatures]:
        """Features of the given sequences; `lengths` may cut each to its first n positions (anchor bound)."""


class OnlineFeatures(FeatureSource):
    """Computes the features with the target for every batch: no disk, one extra target forward per step."""

    def __init__(self, target: Transformer, data: TokenizedData, layer_ids: tuple[int, ...], dtype: str):
        if dtype not in STORAGE_DTYPES:
            raise ValueError(f"unknown feature dtype {dtype!r}; choose one of {', '.join(STORAGE_DTYPES)}")
        self.target, self.data, self.layer_ids, self.dtype = target, data, tuple(layer_ids), dtype

    def features(self, indices: list[int], lengths: list[int] | None = None) -> list[SeqFeatures]:
        seqs = [self.data.ids[i] for i in indices]
        if lengths is not None:
            seqs = [s[:n] for s, n in zip(seqs, lengths)]  # causal: a prefix's states don't need the rest
        raw = compute_features(self.target, seqs, self.layer_ids)
        return [SeqFeatures(round_trip(f.layers, self.dtype), round_trip(f.final, self.dtype)) for f in raw]
