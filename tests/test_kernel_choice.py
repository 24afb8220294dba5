"""The measured projection routes (models/kernel_choice.py): our C kernel's row limit and oneDNN's padding of a few
rows — the rules, the cache, the override, and that the speed profile is keyed by the routes it was measured with."""
import json
import logging
from pathlib import Path

import pytest
import torch

from dspark.models import kernel_choice, native
from dspark.models.kernel_choice import Routes
from dspark.models.config import parse_hf_config
from dspark.models.weights import build_transformer
from helpers import hf_model, ours_from_hf

needs_kernel = pytest.mark.skipif(native.kernel() is None, reason="no C compiler here: nothing to choose")


def test_the_limit_is_the_prefix_where_ours_is_never_slower():
    assert kernel_choice.crossover({1: [1, 2], 2: [1, 2], 4: [3, 2], 8: [1, 2]}) == 2  # a win past a loss is noise
    assert kernel_choice.crossover({2: [1, 1], 1: [1, 2]}) == 2  # ties go to ours; order of the table is irrelevant
    assert kernel_choice.crossover({1: [3, 2], 2: [1, 2]}) == 0  # slower at one row: oneDNN everywhere


@pytest.fixture
def model(monkeypatch, tmp_path):
    monkeypatch.setenv("DSPARK_CACHE", str(tmp_path))
    monkeypatch.delenv("DSPARK_NATIVE_ROWS", raising=False)
    return ours_from_hf(hf_model("llama"), fast_kernels=True)


def test_padding_goes_where_it_is_faster_and_the_limit_is_against_the_better_route():
    table = {1: {"native": 1.0, "onednn": 3.0, "padded": 2.0},   # ours wins; padded still beats unpadded
             2: {"native": 2.5, "onednn": 3.0, "padded": 2.0},   # padded oneDNN beats ours: the limit stops at 1
             3: {"native": 1.0, "onednn": 2.0, "padded": 2.5},   # padding loses here: not padded
             4: {"native": 1.0, "onednn": 2.0}}
    assert kernel_choice.routes_from(table, with_native=True) == Routes(1, {1: 4, 2: 4})
    no_c = {n: {k: v for k, v in t.items() if k != "native"} for n, t in table.items() if n < 4}
    assert kernel_choice.routes_from(no_c, with_native=False) == Routes(None, {1: 4, 2: 4})


@needs_kernel
def test_measured_once_then_read_from_the_cache(model, monkeypatch, caplog):
    calls = []
    real = kernel_choice.measure
    monkeypatch.setattr(kernel_choice, "measure", lambda m: calls.append(1) or real(m, rows=(1, 2, 3), rounds=1))
    chosen = kernel_choice.tune(model)
    assert chosen.native_rows in (0, 1, 2, 3) and len(calls) == 1
    assert set(chosen.pad_to) <= {1, 2, 3} and set(chosen.pad_to.values()) <= {kernel_choice.PAD_TO}
    assert all(p.native_rows == chosen.native_rows and p.pad_to == chosen.pad_to
               for p in kernel_choice.projections(model))
    saved = json.loads(kernel_choice.cache_path(model).read_text())
    assert saved["native_rows"] == chosen.native_rows and set(saved["seconds"]) == {"1", "2", "3"}
    assert {int(k): v for k, v in saved["pad_to"].items()} == chosen.pad_to
    assert set(saved["seconds"]["1"]) == {"native", "onednn", "padded"}
    assert kernel_choice.tune(model) == chosen and len(calls) == 1  # cached
    assert kernel_choice.tune(model, force=True).native_rows in (0, 1, 2, 3) and len(calls) == 2  # `--force`

    for bad in ("{not json", json.dumps({**saved, "version": 1}), json.dumps({**saved, "pad_to": [1, 2]})):
        kernel_choice.cache_path(model).write_text(bad)
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="dspark"):
            kernel_choice.tune(model)
        assert "measuring the kernel routes again" in caplog.text
    assert len(calls) == 5
    assert json.loads(kernel_choice.cache_path(model).read_text())["version"] == kernel_choice.VERSION


def bf16_model(monkeypatch, tmp_path):
    monkeypatch.setenv("DSPARK_CACHE", str(tmp_path))
    monkeypatch.delenv("DSPARK_NATIVE_ROWS", raising=False)
    hf = hf_model("llama")
    config = parse_hf_config(json.loads(hf.config.to_json_string()))
    state = {k: v.detach().clone() for k, v in hf.state_dict().items()}
    return build_transformer(config, state, torch.bfloat16, fast_kernels=True)


@pytest.mark.skipif(native.kernel_bf16() is None, reason="no bf16 C kernel on this CPU (it needs AVX512-BF16 or AVX2)")
def test_a_bf16_model_measures_our_bf16_kernel_beside_onednn(monkeypatch, tmp_path):
    model = bf16_model(monkeypatch, tmp_path)
    if not kernel_choice.has_packed(model):
        pytest.skip("this torch build packs no bf16 weights here (oneDNN needs bf16 instructions)")
    assert kernel_choice.has_native(model)
    chosen, table = kernel_choice.measure(model, rows=(1, 2, 4), rounds=1)
    assert chosen.native_rows is not None and set(table) == {1, 2, 4}
    assert set(table[1]) == {"native", "onednn", "padded"} and set(table[4]) == {"native", "onednn"}


def test_without_a_packed_product_the_limit_is_the_last_count_ours_wins_and_may_be_every_count():
    torch_slower = {n: {"native": 1.0, "torch": 1.0 + n} for n in kernel_choice.UNPACKED_ROWS}
    torch_slower[1]["torch"] = 0.9  # a near-tie lost at one row does not hand every count to torch
    assert kernel_choice.routes_from(torch_slower, with_native=True) == Routes(kernel_choice.EVERY_ROW)
    last = kernel_choice.UNPACKED_ROWS[-1]  # fp32 weights: torch's BLAS may win past the counts measured
    assert kernel_choice.routes_from(torch_slower, with_native=True, every_row=False) == Routes(last)
    short = {n: t for n, t in torch_slower.items() if n <= 16}  # not measured up to a prefill's rows: no extrapolation
    assert kernel_choice.routes_from(short, with_native=True) == Routes(16)
    *_, before, last = kernel_choice.UNPACKED_ROWS
    torch_slower[last]["torch"] = 0.5
    assert kernel_choice.routes_from(torch_slower, with_native=True) == Routes(before)


@pytest.mark.skipif(native.kernel_bf16() is None, reason="no bf16 C kernel on this CPU (it needs AVX512-BF16 or AVX2)")
def test_a_bf16_model_with_nothing_packed_weighs_our_kernel_against_torch(monkeypatch, tmp_path):
    """A CPU whose torch packs no bf16 weights (AVX2 only): the C kernel against F.linear, prefill sizes included."""
    model = bf16_model(monkeypatch, tmp_path)
    for p in kernel_choice.projections(model):
        p.packed = None
    assert kernel_choice.is_tunable(model) and not kernel_choice.has_packed(model)
    monkeypatch.setattr(kernel_choice, "UNPACKED_ROWS", (1, 2, 64))
    chosen, table = kernel_choice.measure(model, rounds=1)
    assert set(table) == {1, 2, 64} and all(set(t) == {"native", "torch"} for t in table.values())
    assert chosen.native_rows is not None and not chosen.pad_to
    kernel_choice.apply(model, Routes(kernel_choice.EVERY_ROW))
    calls = []  # a prefill's rows take our kernel too
    monkeypatch.setattr(native, "linear", lambda *a: calls.append(a[0].shape[0]) or torch.nn.functional.linear(*a))
    model.layers[0].down(torch.randn(300, model.layers[0].down.weight.shape[1]).bfloat16())
    assert calls == [300]


def test_a_bf16_model_without_our_kernel_measures_only_the_padding(monkeypatch, tmp_path):
    monkeypatch.setattr(native, "kernel_bf16", lambda *a: None)  # a CPU without bf16 dot products
    model = bf16_model(monkeypatch, tmp_path)
    if not kernel_choice.is_tunable(model):
        pytest.skip("this torch build has no packed oneDNN product")
    assert not kernel_choice.has_native(model)
    chosen, table = kernel_choice.measure(model, rounds=1)
    assert chosen.native_rows is None and set(table) == {1, 2, 3}
    assert all(set(t) == {"onednn", "padded"} for t in table.values())


def test_padded_rows_give_the_unpadded_result(model, monkeypatch):
    """oneDNN pads a few rows where kernel_choice found it faster: the same rows come back, to its rounding."""
    proj = model.layers[0].gate_up
    if proj.packed is None:
        pytest.skip("this torch build has no packed oneDNN product")
    sizes = []
    real = torch.ops.mkldnn._linear_pointwise
    monkeypatch.setattr(torch.ops.mkldnn, "_linear_pointwise", lambda x, *a: sizes.append(x.shape[0]) or real(x, *a))
    x = torch.randn(2, proj.weight.shape[1])
    proj.native_rows, proj.pad_to = 0, {}
    plain = proj(x)
    proj.pad_to = {2: 4}
    padded = proj(x)
    assert sizes == [2, 4] and padded.shape == plain.shape
    torch.testing.assert_close(padded, plain, rtol=1e-4, atol=1e-5)
    proj(torch.randn(3, proj.weight.shape[1]))  # a row count not in pad_to: unpadded
    assert sizes[-1] == 3


@needs_kernel
def test_the_environment_overrides_and_bad_values_are_refused(model, monkeypatch):
    monkeypatch.setattr(kernel_choice, "measure", lambda m: pytest.fail("an override must not measure"))
    monkeypatch.setenv("DSPARK_NATIVE_ROWS", "7")
    assert kernel_choice.tune(model) == Routes(7) and model.layers[0].qkv.native_rows == 7
    assert model.layers[0].qkv.pad_to == {}  # an override measures nothing, so it pads nothing
    monkeypatch.setenv("DSPARK_NATIVE_ROWS", "many")
    with pytest.raises(ValueError, match="DSPARK_NATIVE_ROWS"):
        kernel_choice.tune(model)


def test_no_choice_without_onednn_packing(model, monkeypatch):
    plain = ours_from_hf(hf_model("llama"), fast_kernels=False)
    monkeypatch.setattr(kernel_choice, "measure", lambda m: pytest.fail("nothing to measure"))
    assert kernel_choice.tune(plain) is None
    assert all(p.native_rows == native.DEFAULT_ROWS and p.pad_to == {} for p in kernel_choice.projections(plain))


@needs_kernel
def test_a_row_limit_changes_no_output_row_beyond_kernel_rounding(model):
    """Either kernel may serve a verify step; the outputs agree to fp32 rounding, and rows served by ours are
    bitwise those of a one-row decode (test_native_linear pins the kernel's row invariance)."""
    proj = model.layers[0].gate_up
    x = torch.randn(6, proj.weight.shape[1])
    proj.native_rows = 0
    theirs = proj(x)
    proj.native_rows = 16
    ours = proj(x)
    assert torch.allclose(ours, theirs, rtol=1e-4, atol=1e-5)
    assert torch.equal(ours[2:3], proj(x[2:3]))


@needs_kernel
def test_the_profile_key_names_the_kernel_version_and_the_limit(model):
    from dspark.engine.profiling import profile_key

    kernel_choice.apply(model, Routes(5))
    five = profile_key("m", "float32", "d", model)
    kernel_choice.apply(model, Routes(8))
    eight = profile_key("m", "float32", "d", model)
    assert "<=5" in five.kernels and "<=8" in eight.kernels and five != eight and "pad" not in five.kernels
    kernel_choice.apply(model, Routes(8, {1: 4, 2: 4}))
    padded = profile_key("m", "float32", "d", model)
    assert padded.kernels.endswith("+pad1>4,2>4") and padded != eight
    kernel_choice.apply(model, Routes(8))
    from dspark.models import native_attention
    if native_attention.usable(model.dtype, model.device):  # a new attention kernel is re-profiled too
        assert f"attention@{native_attention.source_hash()[:8]}" in eight.kernels


def test_a_bf16_profile_key_names_our_kernel_only_where_it_serves(monkeypatch, tmp_path):
    from dspark.engine.profiling import profile_key

    model = bf16_model(monkeypatch, tmp_path)
    key = profile_key("m", "bfloat16", "d", model).kernels
    assert ("native@" in key) == (native.kernel_bf16() is not None) == model.lm_head.native


def test_the_suite_measures_into_its_own_cache_not_the_users():
    from dspark.models.loader import cache_root

    root = cache_root()
    assert root.name.startswith("dspark-test-cache-") and root != Path.home() / ".cache" / "dspark"


@needs_kernel
def test_profile_force_measures_the_routes_once(monkeypatch, tmp_path):
    """`dspark profile --force` re-measures the routes itself, so loading the model must not measure them first
    (with nothing cached it used to measure twice, ~15 s lost)."""
    from dspark import cli
    from dspark.engine import profiling

    class Stop(Exception):
        pass

    monkeypatch.setenv("DSPARK_CACHE", str(tmp_path))
    monkeypatch.delenv("DSPARK_NATIVE_ROWS", raising=False)
    calls = []
    monkeypatch.setattr(kernel_choice, "measure", lambda model, *a, **k: calls.append(1) or (Routes(2), {}))
    monkeypatch.setattr(profiling, "load_or_profile", lambda *a, **k: (_ for _ in ()).throw(Stop()))
    with pytest.raises(Stop):
        cli.main(["profile", "--force"])
    assert calls == [1]


def test_kernel_key_ignores_comments_and_layout_but_not_code():
    # Routes and speed profiles are keyed by the kernels' code: a comment edit must not send every machine back to
    # measuring them, while any change to the code must.
    from dspark.models import native, native_attention

    src = b"/* block\n comment */\nfloat f(float x) {  // why\n    return x * 2.0f;\n}\n"
    same = b"float f(float x) {\n  return x * 2.0f;   /* reworded */\n}\n// trailing note\n"
    other = b"float f(float x) {\n    return x * 3.0f;\n}\n"
    assert native.code_hash(src) == native.code_hash(same)
    assert native.code_hash(src) != native.code_hash(other)
    # the shared header is part of each kernel's code: editing it re-measures what the kernels' speed decides
    assert native.source_hash() == native.code_hash(native.HEADER.read_bytes() + native.SOURCE.read_bytes())
    assert native_attention.source_hash() == native.code_hash(native.kernel_source(native_attention.SOURCE))
    assert native.source_hash() != native.code_hash(native.SOURCE.read_bytes())
