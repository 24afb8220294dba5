"""Training configuration: frozen dataclasses loaded from TOML or JSON, with `--set section.key=value` overrides.

Unknown sections or keys are errors (a typo must not silently train with a default), and every value is
type-checked against its field, so a config either loads completely or says exactly what is wrong.
"""
from __future__ import annotations

import dataclasses
import json
import tomllib
import typing
from dataclasses import dataclass, field
from pathlib import Path


class ConfigError(ValueError):
    pass


@dataclass(frozen=True)
class TargetSection:
    name: str = "smollm2-135m-instruct"  # model spec for dspark.models.load_model
    dtype: str = "float32"
    device: str = "cpu"  # "cpu" | "cuda" | "cuda:N" | "auto": where the target and the drafter train


@dataclass(frozen=True)
class DrafterSection:
    type: str = "dspark"  # "dspark" | "dflash" | "eagle3" (the EAGLE-3 baseline: one layer, TTT over block_size)
    num_layers: int = 1
    layer_ids: tuple[int, ...] = ()  # empty = num_feature_layers spread from layer 1 to L−3
    num_feature_layers: int = 5
    block_size: int = 7
    mask_token_id: int = -1  # -1 = the last vocabulary row
    head: str = "markov"  # "markov" | "rnn" | "none"
    rank: int = 64
    confidence: bool = True
    init_from_target: bool = True
    intermediate_size: int = 0  # 0 = the target's
    draft_vocab: int = 0  # > 0: the drafter's LM head covers the N most frequent answer tokens of the data


@dataclass(frozen=True)
class DataSection:
    dataset: str = ""  # datagen output (directory, .jsonl, .jsonl.xz or .jsonl.gz); tokenised on load
    cache: str = ""  # a target cache directory; empty = compute features online
    max_seq_len: int = 1024
    anchors_per_seq: int = 32
    feature_dtype: str = "bfloat16"  # rounding of online features, to match a cache built with this dtype
    limit: int = 0  # use only the first N sequences (0 = all)


@dataclass(frozen=True)
class OptimSection:
    lr: float = 6e-4
    min_lr_ratio: float = 0.1
    warmup_steps: int = 50
    max_steps: int = 1000
    weight_decay: float = 0.0
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    clip: float = 1.0
    batch_seqs: int = 8  # sequences per optimizer step, over all processes and accumulation steps
    grad_accum: int = 1
    loss_chunk_blocks: int = 64  # blocks per LM-head chunk (bounds the [rows × V] logits memory)
    head_dtype: str = "float32"  # "bfloat16": frozen LM-head products in bf16 (about 2x faster on CPU)


@dataclass(frozen=True)
class LossSection:
    ce: float = 0.1
    tv: float = 0.9
    conf: float = 1.0
    soft: float = 0.0  # soft cross-entropy to the target distribution (see training/losses.py)
    decay: float = 4.0  # w_k = exp(−(k−1)/decay)


@dataclass(frozen=True)
class RunSection:
    out_dir: str = "runs/dspark"
    seed: int = 0
    log_every: int = 1
    ckpt_every: int = 100
    keep_checkpoints: int = 2
    threads: int = 0  # torch threads per process (0 = leave torch's default)
    progress: bool = True
    max_time_s: float = 0.0  # stop (with a checkpoint) after this long; 0 = no limit
    export_on_stop: bool = False  # also export the drafter when max_time_s ends the run early
    # With max_time_s: after a few timed steps, shorten optim.max_steps to what fits the time left, so the
    # cosine schedule ends with the time box instead of being cut off at a high learning rate.
    fit_steps_to_time: bool = False
    # An exported drafter (its weights and draft vocabulary) to start from instead of a fresh initialisation:
    # training goes on across machines and sessions, with a new optimizer and schedule. Same architecture only.
    init_from: str = ""
    profile_steps: int = 0  # > 0: profile this many steps (after the first 10) into out_dir/profile.txt
    tf32: bool = False  # `dspark train` on a CUDA target: fp32 matrix products on TF32 tensor cores
    export_dtype: str = "float32"  # precision of the exported drafter weights
    resume: bool = True


@dataclass(frozen=True)
class TrainConfig:
    target: TargetSection = field(default_factory=TargetSection)
    drafter: DrafterSection = field(default_factory=DrafterSection)
    data: DataSection = field(default_factory=DataSection)
    optim: OptimSection = field(default_factory=OptimSection)
    loss: LossSection = field(default_factory=LossSection)
    run: RunSection = field(default_factory=RunSection)

    def __post_init__(self) -> None:
        checks = [
            (self.drafter.type in ("dspark", "dflash", "eagle3"),
             "drafter.type must be 'dspark', 'dflash' or 'eagle3'"),
            (self.drafter.type != "eagle3" or self.drafter.num_layers == 1, "an eagle3 drafter has num_layers = 1"),
            (self.drafter.head in ("markov", "rnn", "none"), "drafter.head must be 'markov', 'rnn' or 'none'"),
            (self.drafter.num_layers >= 1 and self.drafter.block_size >= 1, "drafter sizes must be >= 1"),
            (self.drafter.head == "none" or self.drafter.rank >= 1, "drafter.rank must be >= 1 with a head"),
            (self.data.anchors_per_seq >= 1 and self.data.max_seq_len >= 2, "data sizes are too small"),
            (self.data.feature_dtype in ("float32", "bfloat16", "float16", "int8"), "unknown data.feature_dtype"),
            (self.optim.batch_seqs % self.optim.grad_accum == 0, "optim.batch_seqs must divide by grad_accum"),
            (self.optim.lr > 0 and self.optim.max_steps >= 1, "optim.lr and optim.max_steps must be positive"),
            (self.run.export_dtype in ("float32", "bfloat16", "float16"), "unknown run.export_dtype"),
            (self.optim.head_dtype in ("float32", "bfloat16"), "optim.head_dtype must be float32 or bfloat16"),
            (self.target.device == "auto" or self.target.device.split(":")[0] in ("cpu", "cuda"),
             "target.device must be cpu, cuda, cuda:N or auto"),
        ]
        for ok, message in checks:
            if not ok:
                raise ConfigError(message)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def _coerce(value, hint, where: str):
    origin = typing.get_origin(hint)
    if origin is tuple:
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{where} must be a list, got {value!r}")
        return tuple(_coerce(v, typing.get_args(hint)[0], where) for v in value)
    if hint is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{where} must be true or false, got {value!r}")
        return value
    if hint is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if not isinstance(value, hint) or isinstance(value, bool) and hint is not bool:
        raise ConfigError(f"{where} must be of type {hint.__name__}, got {value!r}")
    return value


def _build(cls, raw: dict, where: str):
    if not isinstance(raw, dict):
        raise ConfigError(f"[{where}] must be a table, got {raw!r}")
    hints = typing.get_type_hints(cls)
    unknown = sorted(set(raw) - set(hints))
    if unknown:
        label = f"in [{where}]" if where else "at top level"
        raise ConfigError(f"unknown key(s) {unknown} {label}; valid: {sorted(hints)}")
    values = {}
    for name, hint in hints.items():
        key = f"{where}.{name}" if where else name
        if name in raw:
            values[name] = (_build(hint, raw[name], key) if dataclasses.is_dataclass(hint)
                            else _coerce(raw[name], hint, key))
    return cls(**values)


def _parse_value(text: str):
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text  # a bare string: --set data.cache=/tmp/x


def apply_overrides(raw: dict, overrides: list[str]) -> dict:
    raw = json.loads(json.dumps(raw))  # deep copy
    for item in overrides:
        key, sep, text = item.partition("=")
        if not sep or "." not in key:
            raise ConfigError(f"--set expects section.key=value, got {item!r}")
        section, name = key.strip().split(".", 1)
        raw.setdefault(section, {})[name] = _parse_value(text.strip())
    return raw


def config_from_dict(raw: dict, overrides: list[str] = ()) -> TrainConfig:
    return _build(TrainConfig, apply_overrides(raw, list(overrides)), "")


def load_config(path: str | Path | None, overrides: list[str] = ()) -> TrainConfig:
    raw: dict = {}
    if path is not None:
        path = Path(path)
        try:
            text = path.read_text()
            raw = json.loads(text) if path.suffix == ".json" else tomllib.loads(text)
        except (OSError, ValueError) as exc:
            raise ConfigError(f"cannot read config {path}: {exc}") from None
    return config_from_dict(raw, overrides)
