"""DeepSpec's Hugging Face checkpoint layout for DSpark/DFlash drafters: load it, and export ours to it.

Their layout (deepseek-ai/DeepSpec, `Qwen3DSparkModel.save_pretrained`): config.json is the target's Qwen3
config with the draft's `num_hidden_layers` and `architectures: ["Qwen3DSparkModel"]`, `num_target_layers`,
`block_size`, `mask_token_id`, `target_layer_ids`, `num_anchors`, `markov_rank`, `markov_head_type`
("vanilla" | "gated" | "rnn", only when rank > 0), `enable_confidence_head`, `confidence_head_with_markov`
(only when enabled). Their DFlash is the same model with markov_rank 0 and no confidence head. Weights
(no prefix): fc, hidden_norm, norm, layers.i.{input_layernorm, post_attention_layernorm,
self_attn.{q,k,v,o}_proj, self_attn.{q,k}_norm, mlp.{gate,up,down}_proj}, markov_head.markov_w{1,2},
markov_head.joint_proj (rnn), confidence_head.proj, plus frozen copies of the target's embed_tokens/lm_head.

The math is ours exactly: fc → RMSNorm fuses the m target layers (their id i = output of decoder layer i,
as our hidden_layers), the fused features feed every layer's k/v (k-norm, RoPE at their positions, no input
norm), the block [anchor, MASK×(γ−1)] sits at anchor+k and sees context strictly before the anchor, slot k
predicts anchor+k+1, and the heads/confidence are ours. Only the packing differs (we fuse q|k|v and
gate|up), so names map by split/concat. Exact equivalences: a hidden-only confidence head next to a Markov
head loads with zero token columns; o_proj's bias (attention_bias) is exported as zeros, loaded only if zero.

Refused, because our drafter cannot compute what theirs does: targets other than Qwen3 (Llama lacks the
QK-norm their attention applies; Gemma3 has sandwich norms; Gemma4 is not a family here); a "gated" Markov
head; target layer −1 (the embedding output, which our target forward does not expose); vocab weights that
differ from the target's (we always use the target's frozen embedding and LM head); rope/eps/shapes that
differ from the target; DeepSpec's Eagle3 (autoregressive; its layout is not mapped here) and z-lab's
`DFlashDraftModel` (its mask slot k predicts anchor+k itself, a shifted readout). Export also refuses the
target's last layer: HF `output_hidden_states` stores it after the final norm and DeepSpec refuses it.
"""
from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import torch

from ..models.config import ModelConfigError, parse_hf_config
from .base import DrafterError, register_drafter
from .dspark import DSparkDrafter, _transformer
from .dspark_checkpoint import (CALIBRATION, check_target, load_calibration, load_drafter_model, read_config,
                                target_fingerprint)
from .dspark_model import DrafterArch, DSparkModel

ARCH, WEIGHTS, INDEX = "Qwen3DSparkModel", "model.safetensors", "model.safetensors.index.json"
HEADS = {"vanilla": "markov", "rnn": "rnn"}  # theirs -> ours; "gated" has no counterpart here
REFUSED = {**dict.fromkeys(("Qwen3Eagle3Model", "Gemma4Eagle3Model", "Eagle3DraftModel"),
                           "DeepSpec's Eagle3 drafter (autoregressive), whose layout is not mapped here"),
           "Gemma4DSparkModel": "a drafter for Gemma4 targets, a family this project does not run",
           "DFlashDraftModel": "z-lab DFlash, whose mask slot k predicts the token at anchor+k (ours: anchor+k+1)"}
EXPECTED = (f"DeepSpec layout: config.json with architectures [{ARCH!r}], model_type 'qwen3', block_size, "
            f"target_layer_ids, mask_token_id, markov_rank, enable_confidence_head; {WEIGHTS} (or {INDEX})")


def _name_map(model: DSparkModel) -> list[tuple[str, list[tuple[str, int]]]]:
    """(our tensor, [(their tensor, rows)]): ours is their parts concatenated along dim 0 (q|k|v, gate|up)."""
    c, inter = model.target_config, model.layers[0].down.weight.shape[1]
    q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    pairs = {"fuse.weight": "fc.weight", "fuse_norm.weight": "hidden_norm.weight", "final_norm.weight": "norm.weight",
             "head.w1.weight": "markov_head.markov_w1.weight", "head.w2.weight": "markov_head.markov_w2.weight",
             "head.joint.weight": "markov_head.joint_proj.weight", "head.joint.bias": "markov_head.joint_proj.bias",
             "confidence.proj.weight": "confidence_head.proj.weight",
             "confidence.proj.bias": "confidence_head.proj.bias"}
    for i in range(len(model.layers)):
        p = f"layers.{i}."
        pairs.update({p + a: p + b for a, b in (
            ("attn_norm.weight", "input_layernorm.weight"), ("ffn_norm.weight", "post_attention_layernorm.weight"),
            ("o.weight", "self_attn.o_proj.weight"), ("q_norm.weight", "self_attn.q_norm.weight"),
            ("k_norm.weight", "self_attn.k_norm.weight"), ("down.weight", "mlp.down_proj.weight"))})
        pairs.update({p + f"qkv.{w}": [(p + f"self_attn.{n}_proj.{w}", r) for n, r in zip("qkv", (q, kv, kv))]
                      for w in ("weight", "bias")})
        pairs[p + "gate_up.weight"] = [(p + "mlp.gate_proj.weight", inter), (p + "mlp.up_proj.weight", inter)]
    ours = model.state_dict()
    return [(a, b if isinstance(b, list) else [(b, -1)]) for a, b in pairs.items() if a in ours]


def _check_target_config(config: dict, target, where: str) -> None:
    """The draft config must describe the target's geometry: our drafter always uses the target's."""
    tc = target.config
    if tc.family != "qwen3":
        raise DrafterError(f"{where}: {ARCH} drafts for Qwen3 targets (QK-norm attention, plain RMSNorms); "
                           f"this target is {tc.family!r}")
    try:
        dc = parse_hf_config(config)
    except ModelConfigError as exc:
        raise DrafterError(f"{where}: not a Qwen3 draft config ({exc}); expected {EXPECTED}") from None
    rope = lambda s: (s.theta,) if s.rope_type == "default" else s  # noqa: E731  (max_position only matters then)
    fields = ("vocab_size", "hidden_size", "num_heads", "num_kv_heads", "head_dim", "rms_eps", "activation",
              "attention_bias")
    bad = [f"{f}: drafter {getattr(dc, f)} vs target {getattr(tc, f)}" for f in fields
           if getattr(dc, f) != getattr(tc, f)]
    if rope(dc.rope) != rope(tc.rope):
        bad.append(f"rope: drafter {dc.rope} vs target {tc.rope}")
    if config.get("num_target_layers", tc.num_layers) != tc.num_layers:
        bad.append(f"num_target_layers: drafter {config.get('num_target_layers')} vs target {tc.num_layers}")
    if bad:
        raise DrafterError(f"{where} was made for another target; mismatched: {'; '.join(bad)}")


def deepspec_arch(config: dict, target, where: str) -> tuple[DrafterArch, bool]:
    """-> (our architecture, whether the confidence head reads the Markov embedding)."""
    archs = config.get("architectures") or []
    for name in archs:
        if name in REFUSED:
            raise DrafterError(f"{where}: {name} is {REFUSED[name]}; only {EXPECTED} loads here")
    missing = [k for k in ("block_size", "target_layer_ids", "mask_token_id", "markov_rank", "enable_confidence_head",
                           "num_hidden_layers") if k not in config]
    if ARCH not in archs or config.get("model_type") != "qwen3" or missing:
        raise DrafterError(f"{where}: unknown checkpoint layout (architectures {archs}, model_type "
                           f"{config.get('model_type')!r}, missing {missing}); expected {EXPECTED}")
    _check_target_config(config, target, where)
    ids, n = [int(i) for i in config["target_layer_ids"]], target.config.num_layers
    if not ids or any(b <= a for a, b in zip(ids, ids[1:])) or not all(0 <= i < n for i in ids):
        why = "; -1 (the embedding output) is not a hidden layer our target forward exposes" if -1 in ids else ""
        raise DrafterError(f"{where}: target_layer_ids {ids} must be strictly increasing layers 0..{n - 1}{why}")
    rank, conf = int(config["markov_rank"]), bool(config["enable_confidence_head"])
    kind = str(config.get("markov_head_type", "")).lower() if rank > 0 else "none"
    if rank > 0 and kind not in HEADS:
        raise DrafterError(f"{where}: markov_head_type {kind!r} has no counterpart here (supported: {sorted(HEADS)})")
    inter = int(config.get("intermediate_size", target.config.intermediate_size))
    arch = DrafterArch(drafter_type="dflash" if rank == 0 and not conf else "dspark", layer_ids=tuple(ids),
                       num_layers=int(config["num_hidden_layers"]), block_size=int(config["block_size"]),
                       mask_token_id=int(config["mask_token_id"]), head=HEADS.get(kind, "none"), rank=rank,
                       confidence=conf, intermediate_size=0 if inter == target.config.intermediate_size else inter)
    return arch, bool(config.get("confidence_head_with_markov", False)) and rank > 0


def _read_tensors(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    if (path / WEIGHTS).is_file():
        files = [path / WEIGHTS]
    elif (path / INDEX).is_file():
        files = [path / f for f in sorted(set(json.loads((path / INDEX).read_text())["weight_map"].values()))]
    else:
        raise DrafterError(f"{path}: no {WEIGHTS} or {INDEX}; expected {EXPECTED}")
    tensors = {}
    for f in files:
        try:
            tensors.update(load_file(str(f)))
        except Exception as exc:  # missing, truncated or corrupt shard
            raise DrafterError(f"{f}: cannot read the weights ({type(exc).__name__}: {exc})") from None
    return tensors


def load_deepspec_model(path, target, strict_target: bool = True) -> DSparkModel:
    path, target = Path(path), _transformer(target)
    try:
        config = json.loads((path / "config.json").read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise DrafterError(f"{path}: cannot read config.json ({type(exc).__name__}: {exc}); "
                           f"expected {EXPECTED}") from None
    arch, conf_with_markov = deepspec_arch(config, target, str(path))
    if "dspark_target" in config:  # written by our export: the same target check as our own checkpoints
        check_target(config["dspark_target"], target, str(path), strict_target)
    tensors = _read_tensors(path)
    for name, ours in (("embed_tokens.weight", target.embed), ("lm_head.weight", target.lm_head.weight)):
        saved, ours = tensors.pop(name, None), ours.detach().cpu().double()  # any precision: compare to rounding
        if saved is not None and strict_target and (saved.shape != ours.shape or
                                                    (saved.double() - ours).norm() > 1e-2 * ours.norm() + 1e-6):
            raise DrafterError(f"{path}/{name} differs from the target's; this project always drafts with the "
                               f"target's frozen embedding and LM head (pass strict_target=False to use them anyway)")
    for name in [k for k in tensors if k.endswith(".self_attn.o_proj.bias")]:
        if tensors.pop(name).abs().max() != 0:
            raise DrafterError(f"{path}/{name} is non-zero; our draft layers have no o_proj bias")
    model = DSparkModel(arch, target)
    if model.confidence is not None and model.head is not None and not conf_with_markov:
        w = tensors.get("confidence_head.proj.weight")  # hidden-only head: zero weights on W1[prev]
        if w is not None and w.shape[-1] == target.config.hidden_size:
            tensors["confidence_head.proj.weight"] = torch.cat([w, w.new_zeros(w.shape[0], arch.rank)], dim=1)
    expected, state = model.state_dict(), {}
    for ours, parts in _name_map(model):
        lacking = [n for n, _ in parts if n not in tensors]
        if lacking:
            raise DrafterError(f"{path} lacks {lacking} that its config.json declares "
                               f"(markov_rank={arch.rank}, enable_confidence_head={arch.confidence})")
        state[ours] = torch.cat([tensors.pop(n).float() for n, _ in parts], dim=0)
        if state[ours].shape != expected[ours].shape:
            raise DrafterError(f"{path}: {[n for n, _ in parts]} give shape {tuple(state[ours].shape)}, "
                               f"config.json implies {tuple(expected[ours].shape)}")
    extra = sorted(k for k in tensors if not k.endswith("rotary_emb.inv_freq"))
    if extra:
        raise DrafterError(f"{path} has tensors that config.json does not declare: {extra[:6]}")
    model.load_state_dict(state)
    return model.eval().requires_grad_(False)


@register_drafter("checkpoint:deepspec")  # make_drafter routes configs with architectures and no drafter_type here
def load_deepspec(path, target, gamma: int | None = None, strict_target: bool = True,
                  calibration: bool = True, bf16: bool | None = None) -> DSparkDrafter:
    """A DeepSpec-layout directory as our inference drafter (calibration.json next to it is used if present;
    `bf16` as in load_dspark)."""
    path = Path(path).parent if Path(path).is_file() else Path(path)  # make_drafter may hand us config.json
    model = load_deepspec_model(path, target, strict_target)
    cal = load_calibration(path, model.arch.block_size) if calibration else None
    return DSparkDrafter(model, _transformer(target), gamma, cal, bf16)


def _rope_fields(s) -> dict:
    """Our RopeSpec as HF fields (only when the target's own config.json is not at hand)."""
    by_type = {"llama3": {"low_freq_factor": s.low_freq_factor, "high_freq_factor": s.high_freq_factor},
               "yarn": {"beta_fast": s.beta_fast, "beta_slow": s.beta_slow, "attention_factor": s.attention_factor,
                        "truncate": s.truncate}}
    scaling = {"rope_type": s.rope_type, "factor": s.factor,
               "original_max_position_embeddings": s.original_max_position, **by_type.get(s.rope_type, {})}
    return {"rope_theta": s.theta, "rope_scaling": None if s.rope_type == "default" else scaling}


def export_deepspec(drafter, out_dir, target, *, dtype: torch.dtype | None = None, vocab_weights: bool = True,
                    num_anchors: int | None = None) -> Path:
    """Write `drafter` (our checkpoint directory, DSparkModel or DSparkDrafter) in DeepSpec's layout, atomically.
    vocab_weights: include the target's embed_tokens/lm_head as DeepSpec does (vLLM can share the target's)."""
    from safetensors.torch import save_file

    tgt, source = _transformer(target), None
    if isinstance(drafter, (str, os.PathLike)):
        source = Path(drafter)
        if read_config(source).get("drafter_type") not in ("dspark", "dflash"):
            raise DrafterError(f"{source}: only dspark/dflash drafters have a {ARCH} counterpart")
        drafter, saved = load_drafter_model(source, tgt)
        dtype = dtype or getattr(torch, saved.get("weights_dtype", "float32"))
        num_anchors = num_anchors or (((saved.get("training") or {}).get("config") or {}).get("data") or {}).get(
            "anchors_per_seq")
    model: DSparkModel = drafter.model if isinstance(drafter, DSparkDrafter) else drafter
    dtype, arch, c = dtype or torch.float32, model.arch, tgt.config
    if arch.draft_vocab:
        raise DrafterError(f"this drafter has a {arch.draft_vocab}-token draft vocabulary; {ARCH} drafts over the "
                           f"whole vocabulary and has no field for the id map, so it cannot be exported")
    if c.num_layers - 1 in arch.layer_ids:
        raise DrafterError(f"layer_ids {list(arch.layer_ids)} include the target's last layer {c.num_layers - 1}: "
                           f"DeepSpec and HF-based engines read it after the final norm, so it cannot be exported")
    hf_dir = getattr(target, "hf_dir", None)
    base = json.loads((Path(hf_dir) / "config.json").read_text()) if hf_dir else {}
    base.update(model_type="qwen3", vocab_size=c.vocab_size, hidden_size=c.hidden_size, head_dim=c.head_dim,
                num_attention_heads=c.num_heads, num_key_value_heads=c.num_kv_heads, rms_norm_eps=c.rms_eps,
                max_position_embeddings=c.max_position, hidden_act="silu", attention_bias=c.attention_bias)
    if not hf_dir:
        base.update(_rope_fields(c.rope), attention_dropout=0.0, use_sliding_window=False, sliding_window=None,
                    bos_token_id=c.bos_token_id, eos_token_id=list(c.eos_token_ids) or None)
    rank = model.head.rank if model.head is not None else 0
    config = {**base, "architectures": [ARCH], "torch_dtype": str(dtype).replace("torch.", ""),
              "num_target_layers": c.num_layers, "num_hidden_layers": arch.num_layers,
              "intermediate_size": arch.intermediate_size or c.intermediate_size,
              "layer_types": ["full_attention"] * arch.num_layers, "tie_word_embeddings": False,
              "block_size": arch.block_size, "mask_token_id": arch.mask_token_id,
              "target_layer_ids": list(arch.layer_ids), "num_anchors": int(num_anchors or 512),
              "markov_rank": rank, "enable_confidence_head": model.confidence is not None,
              "dspark_target": target_fingerprint(tgt, getattr(target, "name", None))}
    for key in ("auto_map", "dtype", "quantization_config"):  # ours are plain tensors in torch_dtype
        config.pop(key, None)
    if rank:
        config["markov_head_type"] = {v: k for k, v in HEADS.items()}[model.head.kind]
    if model.confidence is not None:
        config["confidence_head_with_markov"] = rank > 0  # ours reads W1[prev] whenever a head exists
    _check_target_config(config, tgt, "the exported config")  # what load will demand, checked before writing
    state, tensors = model.state_dict(), {}
    for ours, parts in _name_map(model):
        pieces = state[ours].split([r for _, r in parts]) if len(parts) > 1 else [state[ours]]
        tensors.update({n: p for (n, _), p in zip(parts, pieces)})
    if c.attention_bias:  # theirs has an o_proj bias whenever q/k/v have one; ours is zero
        tensors.update({f"layers.{i}.self_attn.o_proj.bias": torch.zeros(c.hidden_size)
                        for i in range(arch.num_layers)})
    if vocab_weights:
        tensors.update({"embed_tokens.weight": tgt.embed, "lm_head.weight": tgt.lm_head.weight})
    out = Path(out_dir)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp, old = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent)), out.with_name(f".{out.name}.old")
    tmp.chmod(0o755)  # mkdtemp makes it private; the renamed directory is an ordinary one
    try:  # a reader (or a crash) sees the previous export or the complete new one
        # clone: split pieces share their parent's storage, and a tied target's embedding is its LM head
        save_file({k: v.detach().to("cpu", dtype).clone(memory_format=torch.contiguous_format)
                   for k, v in tensors.items()}, str(tmp / WEIGHTS))
        (tmp / WEIGHTS).chmod(0o644)  # safetensors writes owner-only files
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        if source is not None and (source / CALIBRATION).is_file():
            shutil.copy2(source / CALIBRATION, tmp / CALIBRATION)
        if out.exists():
            shutil.rmtree(old, ignore_errors=True)
            os.replace(out, old)
        os.replace(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.rmtree(old, ignore_errors=True)
    return out


def add_export(sub) -> None:
    """`dspark export --format deepspec --drafter DIR --out DIR [--model M]` (registered in cli.build_parser)."""
    p = sub.add_parser("export", help="write a trained drafter in DeepSpec's Hugging Face layout",
                       description="Export a dspark/dflash drafter directory as a DeepSpec Qwen3DSparkModel "
                                   "checkpoint, for engines that load DeepSpec drafters.")
    p.add_argument("--format", required=True, choices=["deepspec"])
    p.add_argument("--drafter", required=True, type=Path, help="our trained drafter directory")
    p.add_argument("--out", required=True, type=Path, help="directory to write (replaced atomically)")
    p.add_argument("--model", default=None, help="the target (default: the one the drafter's config.json names)")
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16"], help="default: the drafter's own")
    p.add_argument("--no-vocab-weights", action="store_true", help="omit the target's embed_tokens/lm_head copies")
    p.set_defaults(func=run_export)


def run_export(args) -> int:
    from ..models import load_model
    from ..models.loader import DEFAULT_MODEL

    name = args.model or (read_config(args.drafter).get("target") or {}).get("name") or DEFAULT_MODEL
    print(export_deepspec(args.drafter, args.out, load_model(name), dtype=args.dtype and getattr(torch, args.dtype),
                          vocab_weights=not args.no_vocab_weights))
    return 0
