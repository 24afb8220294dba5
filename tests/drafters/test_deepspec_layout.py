"""DeepSpec's Hugging Face layout: ours -> export -> load drafts the same, the names are theirs, and an
independent re-computation of DeepSpec's forward (written from its published formulas over transformers'
Qwen3 modules, using only the exported tensors) gives our probabilities and confidences."""
import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from dspark.decoding import SamplingParams, make_generator
from dspark.drafters.base import DraftRequest, DrafterError, make_drafter
from dspark.drafters.deepspec_layout import export_deepspec, load_deepspec
from dspark.drafters.dspark import DSparkDrafter
from dspark.drafters.dspark_checkpoint import save_drafter
from dspark.drafters.dspark_model import DrafterArch, DSparkModel
from dspark.models.config import parse_hf_config
from dspark.models.transformer import Segment
from dspark.models.weights import build_transformer

QWEN3 = dict(model_type="qwen3", vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
             num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
             rms_norm_eps=1e-6, tie_word_embeddings=True, rope_theta=1e6)
PROMPT, ANCHOR = [3, 14, 15, 92, 65, 35, 8, 9], 7


@pytest.fixture(scope="module")
def target():
    """A tiny random Qwen3 (QK-norm) in our runtime, built from HF-named tensors like a real checkpoint."""
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(AutoConfig.for_model(**QWEN3)).eval()
    state = {k: v.detach().clone() for k, v in hf.state_dict().items()}
    return build_transformer(parse_hf_config(QWEN3), state, torch.float32)


def drafter(target, head="markov", confidence=True, layers=2, seed=1) -> DSparkDrafter:
    arch = DrafterArch(drafter_type="dspark" if head != "none" else "dflash", layer_ids=(0, 2), num_layers=layers,
                       block_size=4, mask_token_id=95, head=head, rank=8 if head != "none" else 0,
                       confidence=confidence)
    torch.manual_seed(seed)
    model = DSparkModel(arch, target)
    with torch.no_grad():  # random everything (norms too), so a swapped or misplaced tensor cannot go unnoticed
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.3)
    return DSparkDrafter(model.eval().requires_grad_(False), target, bf16=False)  # compared with fp32 references


def propose(target, d, temperature=1.0, seed=0):
    cache = target.new_cache()
    out = target.forward(torch.tensor(PROMPT), [Segment(cache, 0, len(PROMPT))], hidden_layers=d.needs_layers)
    req = DraftRequest(tokens=PROMPT + [ANCHOR], params=SamplingParams(temperature=temperature),
                       generator=make_generator(seed))
    d.observe(req, out.hidden, len(PROMPT))
    return d.propose([req]), out.hidden


def assert_same_proposals(a, b):
    assert torch.equal(a.tokens, b.tokens)
    torch.testing.assert_close(a.probs, b.probs, rtol=0, atol=1e-6)
    if a.confidences is None:
        assert b.confidences is None
    else:
        torch.testing.assert_close(a.confidences, b.confidences, rtol=0, atol=1e-6)


@pytest.mark.parametrize("head", ["markov", "rnn"])
def test_export_then_load_drafts_identically(target, tmp_path, head):
    ours = drafter(target, head)
    save_drafter(tmp_path / "ours", ours.model, target, target_name="tiny-qwen3")
    out = export_deepspec(tmp_path / "ours", tmp_path / "deepspec", target)
    back = make_drafter(str(out), target, bf16=False)  # routed by config.json: no drafter_type, HF architectures
    assert back.needs_layers == (0, 2) and back.gamma == 4 and back.model.arch.head == head
    for temperature in (0.0, 1.0):
        assert_same_proposals(propose(target, ours, temperature)[0], propose(target, back, temperature)[0])


def test_exported_names_and_fields_are_deepspecs(target, tmp_path):
    out = export_deepspec(drafter(target).model, tmp_path / "x", target)
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["Qwen3DSparkModel"] and cfg["model_type"] == "qwen3"
    assert (cfg["block_size"], cfg["target_layer_ids"], cfg["mask_token_id"], cfg["num_hidden_layers"]) == (4, [0, 2],
                                                                                                            95, 2)
    assert (cfg["num_target_layers"], cfg["markov_rank"], cfg["markov_head_type"]) == (4, 8, "vanilla")
    assert cfg["enable_confidence_head"] and cfg["confidence_head_with_markov"] and not cfg["tie_word_embeddings"]
    w = load_file(str(out / "model.safetensors"))
    shapes = {"fc.weight": (64, 128), "hidden_norm.weight": (64,), "norm.weight": (64,),
              "layers.1.self_attn.q_proj.weight": (64, 64), "layers.1.self_attn.k_proj.weight": (32, 64),
              "layers.1.self_attn.v_proj.weight": (32, 64), "layers.1.self_attn.o_proj.weight": (64, 64),
              "layers.0.self_attn.k_norm.weight": (16,), "layers.0.mlp.gate_proj.weight": (128, 64),
              "layers.0.mlp.up_proj.weight": (128, 64), "layers.0.mlp.down_proj.weight": (64, 128),
              "layers.0.input_layernorm.weight": (64,), "layers.0.post_attention_layernorm.weight": (64,),
              "markov_head.markov_w1.weight": (96, 8), "markov_head.markov_w2.weight": (96, 8),
              "confidence_head.proj.weight": (1, 72), "confidence_head.proj.bias": (1,),
              "embed_tokens.weight": (96, 64), "lm_head.weight": (96, 64)}
    assert {k: tuple(w[k].shape) for k in shapes} == shapes and len(w) == 9 + 2 * 11  # nothing else


def test_exported_tensors_follow_deepspecs_forward(target, tmp_path):
    """Recompute DeepSpec's block forward from the exported tensors with transformers' Qwen3 pieces."""
    from transformers import Qwen3Config
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding, apply_rotary_pos_emb

    d = drafter(target)
    out = export_deepspec(d.model, tmp_path / "x", target)
    w, cfg = load_file(str(out / "model.safetensors")), json.loads((out / "config.json").read_text())
    prop, hidden = propose(target, d)
    rms = lambda x, g: torch.nn.functional.rms_norm(x, (x.shape[-1],), g, 1e-6)  # noqa: E731
    lin = lambda x, n: x @ w[n].T + (w[n.replace("weight", "bias")] if n.replace("weight", "bias") in w else 0)  # noqa
    ctx = rms(lin(torch.cat([hidden[i] for i in cfg["target_layer_ids"]], -1), "fc.weight"), w["hidden_norm.weight"])
    T, B = len(PROMPT), cfg["block_size"]
    x = w["embed_tokens.weight"][torch.tensor([ANCHOR] + [cfg["mask_token_id"]] * (B - 1))]
    cos, sin = Qwen3RotaryEmbedding(Qwen3Config(**{k: v for k, v in cfg.items() if k != "architectures"}))(
        x[None], torch.arange(T + B)[None])
    for i in range(cfg["num_hidden_layers"]):
        p = f"layers.{i}."
        h = rms(x, w[p + "input_layernorm.weight"])
        heads = lambda t, n: t.view(t.shape[0], n, 16).transpose(0, 1)  # noqa: E731  [heads, len, hd]
        q = rms(heads(lin(h, p + "self_attn.q_proj.weight"), 4), w[p + "self_attn.q_norm.weight"])
        kv_in = torch.cat([ctx, h])  # context K/V injected from the fused features (no input norm), then the block
        k = rms(heads(lin(kv_in, p + "self_attn.k_proj.weight"), 2), w[p + "self_attn.k_norm.weight"])
        v = heads(lin(kv_in, p + "self_attn.v_proj.weight"), 2)
        q, _ = apply_rotary_pos_emb(q[None], q[None], cos[:, T:], sin[:, T:])
        _, k = apply_rotary_pos_emb(k[None], k[None], cos, sin)
        att = torch.nn.functional.scaled_dot_product_attention(q, k, v[None], enable_gqa=True)  # all visible
        x = x + lin(att[0].transpose(0, 1).reshape(B, -1), p + "self_attn.o_proj.weight")
        h = rms(x, w[p + "post_attention_layernorm.weight"])
        x = x + lin(torch.nn.functional.silu(lin(h, p + "mlp.gate_proj.weight")) * lin(h, p + "mlp.up_proj.weight"),
                    p + "mlp.down_proj.weight")
    h = rms(x, w["norm.weight"])
    prev = torch.tensor([ANCHOR, *prop.tokens[0, :-1].tolist()])
    emb = w["markov_head.markov_w1.weight"][prev]
    logits = lin(h, "lm_head.weight") + emb @ w["markov_head.markov_w2.weight"].T
    torch.testing.assert_close(prop.probs[0], logits.softmax(-1), rtol=0, atol=1e-5)
    conf = torch.sigmoid(lin(torch.cat([h, emb], -1), "confidence_head.proj.weight"))[:, 0]
    torch.testing.assert_close(prop.confidences[0], conf, rtol=0, atol=1e-5)


def test_dflash_round_trip_and_hidden_only_confidence(target, tmp_path):
    ours = drafter(target, head="none", confidence=False)
    out = export_deepspec(ours.model, tmp_path / "dflash", target, vocab_weights=False)
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["markov_rank"] == 0 and not cfg["enable_confidence_head"] and "markov_head_type" not in cfg
    back = load_deepspec(out, target, bf16=False)
    assert back.name == "dflash" and back.model.head is None and not back.has_confidence
    assert_same_proposals(propose(target, ours)[0], propose(target, back)[0])
    # Their hidden-only confidence head beside a Markov head loads exactly, as zero weights on W1[prev].
    d = drafter(target)
    out = export_deepspec(d.model, tmp_path / "hidden_only", target)
    w = load_file(str(out / "model.safetensors"))
    with torch.no_grad():
        d.model.confidence.proj.weight[:, 64:] = 0
    w["confidence_head.proj.weight"] = d.model.confidence.proj.weight[:, :64].clone()
    save_file(w, str(out / "model.safetensors"))
    cfg = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**cfg, "confidence_head_with_markov": False}))
    assert_same_proposals(propose(target, d)[0], propose(target, load_deepspec(out, target, bf16=False))[0])


def test_unknown_or_unrepresentable_layouts_are_refused(target, tmp_path):
    (tmp_path / "plain").mkdir()
    (tmp_path / "plain" / "config.json").write_text(json.dumps({"hidden_size": 64}))
    with pytest.raises(DrafterError, match="'drafter_type'.*DeepSpec's Hugging Face layout"):
        make_drafter(str(tmp_path / "plain"), target)
    good = export_deepspec(drafter(target).model, tmp_path / "good", target)
    cfg = json.loads((good / "config.json").read_text())
    cases = {"llama": ("architectures", ["LlamaForCausalLM"], "unknown checkpoint layout.*expected DeepSpec"),
             "eagle3": ("architectures", ["Qwen3Eagle3Model"], "Eagle3"),
             "zlab": ("architectures", ["DFlashDraftModel"], "anchor\\+k"),
             "gated": ("markov_head_type", "gated", "'gated' has no counterpart"),
             "embedding": ("target_layer_ids", [-1, 2], "embedding output"),
             "rope": ("rope_theta", 10000.0, "another target.*rope")}
    for name, (key, value, message) in cases.items():
        bad = tmp_path / name
        bad.mkdir()
        (bad / "config.json").write_text(json.dumps({**cfg, key: value}))
        (bad / "model.safetensors").symlink_to(good / "model.safetensors")
        with pytest.raises(DrafterError, match=message):
            make_drafter(str(bad), target)
    w = load_file(str(good / "model.safetensors"))
    save_file({**w, "lm_head.weight": w["lm_head.weight"] + 1}, str(good / "model.safetensors"))
    with pytest.raises(DrafterError, match="differs from the target's"):
        load_deepspec(good, target)
    last = DSparkModel(DrafterArch(layer_ids=(1, 3), block_size=4, mask_token_id=95, rank=8), target)
    with pytest.raises(DrafterError, match="last layer"):
        export_deepspec(last, tmp_path / "last", target)


def test_cli_export_from_the_targets_hf_config(target, tmp_path, monkeypatch, capsys):
    import types

    import dspark.models
    from dspark.cli import main

    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text(json.dumps({**QWEN3, "architectures": ["Qwen3ForCausalLM"]}))
    loaded = types.SimpleNamespace(name="tiny-qwen3", model=target, hf_dir=tmp_path / "hf")
    monkeypatch.setattr(dspark.models, "load_model", lambda name, **_: loaded)
    ours = drafter(target, head="rnn")
    save_drafter(tmp_path / "ours", ours.model, target, target_name="tiny-qwen3", dtype=torch.bfloat16)
    assert main(["export", "--format", "deepspec", "--drafter", str(tmp_path / "ours"), "--out",
                 str(tmp_path / "out")]) == 0
    cfg = json.loads((tmp_path / "out" / "config.json").read_text())
    assert cfg["torch_dtype"] == "bfloat16" and cfg["markov_head_type"] == "rnn" and cfg["rope_theta"] == 1e6
    assert load_file(str(tmp_path / "out" / "model.safetensors"))["fc.weight"].dtype == torch.bfloat16
    original = make_drafter(str(tmp_path / "ours"), target, bf16=False)  # the bf16-rounded weights, read back in fp32
    back = make_drafter(str(tmp_path / "out"), target, bf16=False)
    assert_same_proposals(propose(target, original)[0], propose(target, back)[0])
