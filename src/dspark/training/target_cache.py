"""The target cache: per token, the captured layer states and the final pre-LM-head hidden state, on disk.

Layout: `manifest.json` + `shard-00000.safetensors`, ... Each shard holds whole sequences (ids int32, loss
mask, offsets, layers [T, m, d], final [T, d] in bf16/fp16/int8 with per-row scales). Every shard is written
to a temporary file and renamed; the manifest is rewritten the same way after it — so an interruption or a
full disk leaves the last complete state, and `build` resumes from it. The cache carries its own ids and
masks: training from it needs neither the dataset nor a target forward.
"""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch

from ..drafters.dspark_checkpoint import target_fingerprint
from .features import (STORAGE_DTYPES, FeatureSource, SeqFeatures, TokenizedData, compute_features, dequantize,
                       quantize)

FORMAT, VERSION, MANIFEST = "dspark.target_cache", 1, "manifest.json"


class CacheError(ValueError):
    pass


def bytes_per_token(num_layers: int, hidden: int, dtype: str) -> int:
    element = 1 if dtype == "int8" else torch.finfo(STORAGE_DTYPES[dtype]).bits // 8
    scales = (num_layers + 1) * 4 if dtype == "int8" else 0
    return 4 + 1 + (num_layers + 1) * hidden * element + scales  # ids + mask + states (+ scales)


def estimate(data: TokenizedData, num_layers: int, hidden: int, dtype: str) -> dict:
    tokens = sum(len(s) for s in data.ids)
    per = bytes_per_token(num_layers, hidden, dtype)
    return {"sequences": len(data), "tokens": tokens, "bytes_per_token": per, "bytes": tokens * per}


def _write_json_atomic(path: Path, payload: dict) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(payload, indent=2) + "\n")
    os.replace(tmp, path)


def _save_shard(path: Path, seqs: list[torch.Tensor], masks: list[torch.Tensor], feats: list[SeqFeatures],
                dtype: str) -> int:
    from safetensors.torch import save_file

    layers, layer_scales = quantize(torch.cat([f.layers for f in feats]), dtype)  # [T, m, d]
    final, final_scales = quantize(torch.cat([f.final for f in feats]), dtype)  # [T, d]
    tensors = {"ids": torch.cat(seqs).to(torch.int32), "mask": torch.cat(masks).to(torch.uint8),
               "offsets": torch.tensor([0, *torch.tensor([len(s) for s in seqs]).cumsum(0).tolist()]),
               "layers": layers.contiguous(), "final": final.contiguous()}
    if layer_scales is not None:
        tensors.update(layer_scales=layer_scales.contiguous(), final_scales=final_scales.contiguous())
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        save_file(tensors, str(tmp))
        tmp.chmod(0o644)  # safetensors writes owner-only files; a cache is shared data
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path.stat().st_size


def _open_manifest(out: Path, fresh: dict, data: TokenizedData, overwrite: bool) -> dict:
    path = out / MANIFEST
    if overwrite and out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True, exist_ok=True)
    if not path.is_file():
        return fresh
    old = json.loads(path.read_text())
    keys = ("format", "version", "layer_ids", "dtype", "hidden_size", "target")
    diff = [k for k in keys if old.get(k) != fresh.get(k)]
    if diff:
        raise CacheError(f"{out} holds a cache built with other settings ({', '.join(diff)} differ); "
                         f"use another directory or --overwrite")
    if old["sequences"] > len(data) or data.digest(old["sequences"]) != old["prefix_digest"]:
        raise CacheError(f"{out}: the dataset's first {old['sequences']} sequences changed since this cache was "
                         f"started; use another directory or --overwrite")
    return old


def build_cache(out_dir: str | Path, target: Transformer, data: TokenizedData, layer_ids: tuple[int, ...], *,
                target_name: str | None = None, dtype: str = "bfloat16", shard_tokens: int = 16384,
                batch_tokens: int = 2048, progress: bool = True, overwrite: bool = False) -> dict:
    """Compute and store features for all sequences of `data`, resuming a partial cache. -> the manifest."""
    from tqdm import tqdm

    if dtype not in STORAGE_DTYPES:
        raise CacheError(f"unknown cache dtype {dtype!r}; choose one of {', '.join(STORAGE_DTYPES)}")
    out = Path(out_dir)
    fresh = {"format": FORMAT, "version": VERSION, "layer_ids": list(layer_ids), "dtype": dtype,
             "hidden_size": target.config.hidden_size, "target": target_fingerprint(target, None),
             "target_name": target_name, "shards": [], "sequences": 0, "tokens": 0, "complete": False}
    manifest = _open_manifest(out, fresh, data, overwrite)
    bar = tqdm(total=sum(len(s) for s in data.ids), initial=manifest["tokens"], unit="tok", desc="cache",
               disable=not progress, dynamic_ncols=True)
    i = manifest["sequences"]
    try:
        while i < len(data):
            j, tokens = i, 0
            while j < len(data) and (j == i or tokens + len(data.ids[j]) <= shard_tokens):
                tokens += len(data.ids[j])
                j += 1
            feats = _features(target, data.ids[i:j], layer_ids, batch_tokens)
            name = f"shard-{len(manifest['shards']):05d}.safetensors"
            size = _save_shard(out / name, data.ids[i:j], data.masks[i:j], feats, dtype)
            manifest["shards"].append({"file": name, "sequences": j - i, "tokens": tokens, "bytes": size})
            manifest.update(sequences=j, tokens=manifest["tokens"] + tokens, prefix_digest=data.digest(j),
                            complete=j == len(data))
            _write_json_atomic(out / MANIFEST, manifest)
            bar.update(tokens)
            i = j
    finally:
        bar.close()
    if not manifest["complete"]:  # an empty dataset, or nothing left to do
        manifest.update(complete=True, prefix_digest=data.digest(i))
        _write_json_atomic(out / MANIFEST, manifest)
    return manifest


def _features(target, seqs: list[torch.Tensor], layer_ids, batch_tokens: int) -> list[SeqFeatures]:
    out, group = [], []
    for s in seqs:
        if group and sum(len(g) for g in group) + len(s) > batch_tokens:
            out += compute_features(target, group, layer_ids)
            group = []
        group.append(s)
    return out + (compute_features(target, group, layer_ids) if group else [])


class CachedFeatures(FeatureSource):
    """Reads a built cache; `layer_ids` may be any subset of the cached layers."""

    def __init__(self, cache_dir: str | Path, layer_ids: tuple[int, ...] | None = None, target=None,
                 limit: int = 0):
        from safetensors import safe_open

        self.dir = Path(cache_dir)
        try:
            self.manifest = json.loads((self.dir / MANIFEST).read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise CacheError(f"{self.dir} is not a target cache ({exc})") from None
        if self.manifest.get("format") != FORMAT or self.manifest.get("version") != VERSION:
            raise CacheError(f"{self.dir}: unsupported cache format/version")
        if target is not None:
            from ..drafters.dspark_checkpoint import check_target
            check_target(self.manifest["target"], target, f"target cache {self.dir}")
        cached = tuple(self.manifest["layer_ids"])
        self.layer_ids = tuple(layer_ids) if layer_ids else cached
        missing = [i for i in self.layer_ids if i not in cached]
        if missing:
            raise CacheError(f"{self.dir} has layers {list(cached)}; the drafter needs {missing} as well")
        self._pick = [cached.index(i) for i in self.layer_ids]
        self._files = [safe_open(str(self.dir / s["file"]), framework="pt") for s in self.manifest["shards"]]
        self._where: list[tuple[int, int, int]] = []  # per sequence: (shard, start row, length)
        ids, masks = [], []
        for shard, f in enumerate(self._files):
            offsets, all_ids, all_mask = f.get_tensor("offsets"), f.get_tensor("ids"), f.get_tensor("mask")
            for a, b in zip(offsets[:-1].tolist(), offsets[1:].tolist()):
                self._where.append((shard, a, b - a))
                ids.append(all_ids[a:b].long())
                masks.append(all_mask[a:b].bool())
        if limit > 0:  # the first N sequences, as data.limit means without a cache
            self._where, ids, masks = self._where[:limit], ids[:limit], masks[:limit]
        self.data = TokenizedData(ids, masks)

    def features(self, indices: list[int], lengths: list[int] | None = None) -> list[SeqFeatures]:
        out = []
        for n, i in enumerate(indices):
            shard, start, length = self._where[i]
            end = start + (length if lengths is None else min(length, lengths[n]))
            f = self._files[shard]
            scales = "layer_scales" in f.keys()
            layers = dequantize(f.get_slice("layers")[start:end], f.get_slice("layer_scales")[start:end]
                                if scales else None)[:, self._pick]
            final = dequantize(f.get_slice("final")[start:end], f.get_slice("final_scales")[start:end]
                               if scales else None)
            out.append(SeqFeatures(layers, final))
        return out
