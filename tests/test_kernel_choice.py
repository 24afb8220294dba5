"""The measured row limit of our C projection kernel (models/kernel_choice.py): the rule, the cache, the override,
and that the speed profile is keyed by the limit it was measured with."""
import json
import logging
from pathlib import Path

import pytest
import torch

from dspark.models import kernel_choice, native
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


@needs_kernel
def test_measured_once_then_read_from_the_cache(model, monkeypatch, caplog):
    calls = []
    real = kernel_choice.measure
    monkeypatch.setattr(kernel_choice, "measure", lambda m: calls.append(1) or real(m, rows=(1, 2, 3), rounds=1))
    limit = kernel_choice.tune(model)
    assert limit in (0, 1, 2, 3) and len(calls) == 1
    assert all(p.native_rows == limit for p in kernel_choice.projections(model))
    saved = json.loads(kernel_choice.cache_path(model).read_text())
    assert saved["native_rows"] == limit and set(saved["seconds"]) == {"1", "2", "3"}
    assert kernel_choice.tune(model) == limit and len(calls) == 1  # cached
    assert kernel_choice.tune(model, force=True) in (0, 1, 2, 3) and len(calls) == 2  # `dspark profile --force`

    kernel_choice.cache_path(model).write_text("{not json")
    with caplog.at_level(logging.WARNING, logger="dspark"):
        kernel_choice.tune(model)
    assert len(calls) == 3 and "measuring the kernel crossover again" in caplog.text
    assert json.loads(kernel_choice.cache_path(model).read_text())["version"] == kernel_choice.VERSION


@needs_kernel
def test_the_environment_overrides_and_bad_values_are_refused(model, monkeypatch):
    monkeypatch.setattr(kernel_choice, "measure", lambda m: pytest.fail("an override must not measure"))
    monkeypatch.setenv("DSPARK_NATIVE_ROWS", "7")
    assert kernel_choice.tune(model) == 7 and model.layers[0].qkv.native_rows == 7
    monkeypatch.setenv("DSPARK_NATIVE_ROWS", "many")
    with pytest.raises(ValueError, match="DSPARK_NATIVE_ROWS"):
        kernel_choice.tune(model)


def test_no_choice_without_both_kernels(model, monkeypatch):
    plain = ours_from_hf(hf_model("llama"), fast_kernels=False)
    monkeypatch.setattr(kernel_choice, "measure", lambda m: pytest.fail("nothing to measure"))
    assert kernel_choice.tune(plain) is None
    assert all(p.native_rows == native.DEFAULT_ROWS for p in kernel_choice.projections(plain))


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

    kernel_choice.apply(model, 5)
    five = profile_key("m", "float32", "d", model)
    kernel_choice.apply(model, 8)
    eight = profile_key("m", "float32", "d", model)
    assert "<=5" in five.kernels and "<=8" in eight.kernels and five != eight
    assert profile_key("m", "bfloat16", "d", model).kernels in ("torch", "attention", "norm", "attention+norm")


def test_the_suite_measures_into_its_own_cache_not_the_users():
    from dspark.models.loader import cache_root

    root = cache_root()
    assert root.name.startswith("dspark-test-cache-") and root != Path.home() / ".cache" / "dspark"
