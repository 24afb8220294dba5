"""The C projection kernel (models/native.py) against an fp64 reference, its batch invariance, and its fallbacks."""
import logging
import shutil

import pytest
import torch
import torch.nn.functional as F

from dspark.models import native
from dspark.models.layers import Projection

needs_kernel = pytest.mark.skipif(native.kernel() is None, reason="no C compiler here: the torch path is used")
needs_bf16 = pytest.mark.skipif(native.kernel_bf16() is None, reason="no bf16 dot products (AVX512-BF16) here")


@pytest.fixture
def fresh_kernel():
    """Each test builds its own kernel state; the process-wide one is restored afterwards."""
    native.kernel.cache_clear()
    native.kernel_bf16.cache_clear()
    yield native.kernel
    native.kernel.cache_clear()
    native.kernel_bf16.cache_clear()


def _run(x, w, b=None, threads=2):
    y = torch.empty(x.shape[0], w.shape[0], dtype=w.dtype)
    (native.kernel() if w.dtype == torch.float32 else native.kernel_bf16())(x.data_ptr(), x.shape[0], w.data_ptr(), None if b is None else b.data_ptr(),
                    w.shape[0], w.shape[1], y.data_ptr(), threads)
    return y


@needs_kernel
@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 9])
@pytest.mark.parametrize("n,k", [(1, 1), (3, 7), (4, 8), (5, 9), (17, 64), (130, 577)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_matches_fp64_reference(m, n, k, with_bias):
    g = torch.Generator().manual_seed(m * 1000 + n * 10 + k)
    x, w = torch.randn(m, k, generator=g), torch.randn(n, k, generator=g)
    b = torch.randn(n, generator=g) if with_bias else None
    ref = F.linear(x.double(), w.double(), None if b is None else b.double())
    got = native.linear(x, w, b)
    assert got.shape == (m, n) and got.dtype == torch.float32
    scale = (x.double().abs() @ w.double().abs().T).max()  # error bound of a k-term fp32 dot product (+ bias)
    assert float((got.double() - ref).abs().max()) <= 1e-6 * (k * float(scale) + float(ref.abs().max()))


@needs_kernel
@pytest.mark.parametrize("m", [2, 3, 4, 7, 16])
@pytest.mark.parametrize("n,k", [(1003, 576), (30, 1541), (5, 64)])
def test_a_row_does_not_depend_on_its_batch_or_the_thread_count(m, n, k):
    """Decode at concurrency 1 and 2, a verify step of m tokens, or another thread count: bitwise the same
    logits per row. Two or more rows take the kernel's tiles (and an odd last row or W rows past the last full
    tile take its one-row blocks), one row never does, so this pins that every path sums in the same order."""
    g = torch.Generator().manual_seed(m * n)
    x, w, b = torch.randn(m, k, generator=g), torch.randn(n, k, generator=g), torch.randn(n, generator=g)
    alone = torch.cat([_run(x[i:i + 1], w, b) for i in range(m)])
    assert torch.equal(_run(x, w, b), alone)
    assert torch.equal(_run(x, w, b, threads=1), alone)
    assert torch.equal(_run(x[1:], w, b), alone[1:])  # the same row as first or second of a tile


@needs_bf16
@pytest.mark.parametrize("m", [1, 2, 3, 5])
@pytest.mark.parametrize("n,k", [(1, 1), (3, 15), (5, 16), (17, 64), (130, 577)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_bf16_matches_fp64_reference_to_one_rounding(m, n, k, with_bias):
    """bf16 x, W and bias: fp32 sums, then one rounding to bf16 (the tolerance: half a bf16 ulp plus the fp32 sums'
    error; the CPU's bf16 dot product flushes subnormals, which randn does not produce)."""
    g = torch.Generator().manual_seed(m * 1000 + n * 10 + k)
    x, w = torch.randn(m, k, generator=g).bfloat16(), torch.randn(n, k, generator=g).bfloat16()
    b = torch.randn(n, generator=g).bfloat16() if with_bias else None
    ref = F.linear(x.double(), w.double(), None if b is None else b.double())
    got = native.linear(x, w, b)
    assert got.shape == (m, n) and got.dtype == torch.bfloat16
    scale = float((x.double().abs() @ w.double().abs().T).max())
    assert ((got.double() - ref).abs() <= 2 ** -8 * ref.abs() + 1e-6 * k * scale + 1e-30).all()


@needs_bf16
@pytest.mark.parametrize("m", [2, 3, 4, 7])
@pytest.mark.parametrize("n,k", [(1003, 576), (30, 1541), (5, 64)])
def test_a_bf16_row_does_not_depend_on_its_batch_or_the_thread_count(m, n, k):
    """As for fp32: bf16 decode, a verify step and another thread count give bitwise the same row."""
    g = torch.Generator().manual_seed(m * n)
    x, w, b = (torch.randn(*s, generator=g).bfloat16() for s in ((m, k), (n, k), (n,)))
    alone = torch.cat([_run(x[i:i + 1], w, b) for i in range(m)])
    assert torch.equal(_run(x, w, b), alone)
    assert torch.equal(_run(x, w, b, threads=1), alone)
    assert torch.equal(_run(x[1:], w, b), alone[1:])


@needs_bf16
def test_a_bf16_projection_uses_it():
    w = torch.randn(64, 32).bfloat16()
    proj = Projection(w, packed=True, native=True)
    x = torch.randn(1, 32).bfloat16()
    assert proj.native and torch.equal(proj(x), native.linear(x, w))
    assert proj(x).dtype == torch.bfloat16


@needs_kernel
def test_projection_uses_it_up_to_its_row_limit(monkeypatch):
    w = torch.randn(64, 32)
    proj = Projection(w, packed=True, native=True)
    assert proj.native
    calls = []
    monkeypatch.setattr(native, "linear", lambda *a: calls.append(a[0].shape[0]) or F.linear(*a))
    assert proj.native_rows == native.DEFAULT_ROWS == 3  # until kernel_choice measures this machine
    for rows in (1, 2, 3, 4, 8):
        proj(torch.randn(rows, 32))
    assert calls == [1, 2, 3]
    proj.native_rows = 8
    proj(torch.randn(8, 32))
    assert calls == [1, 2, 3, 8]
    x = torch.randn(1, 32, requires_grad=True)  # no backward in C: autograd inputs take the torch path
    proj(x).sum().backward()
    assert calls == [1, 2, 3, 8] and x.grad is not None
    assert not Projection(w, native=False).native
    assert not Projection(w.double(), native=True).native  # fp32 and bf16 only


def test_disabled_by_environment(monkeypatch, fresh_kernel):
    monkeypatch.setenv("DSPARK_NATIVE", "0")
    assert fresh_kernel() is None
    w = torch.randn(8, 4)
    proj = Projection(w, native=True)
    x = torch.randn(1, 4)
    assert not proj.native and torch.equal(proj(x), F.linear(x, w))


def test_no_compiler_falls_back(monkeypatch, tmp_path, fresh_kernel):
    monkeypatch.setenv("CC", "no-such-compiler-dspark")
    assert fresh_kernel(str(tmp_path)) is None
    assert not any(tmp_path.iterdir())


@pytest.mark.skipif(shutil.which("false") is None, reason="needs /bin/false")
def test_failing_compiler_warns_and_leaves_no_partial_library(monkeypatch, tmp_path, fresh_kernel, caplog):
    monkeypatch.setenv("CC", "false")
    with caplog.at_level(logging.WARNING, logger="dspark"):
        assert fresh_kernel(str(tmp_path)) is None
    assert "could not build" in caplog.text
    assert list(tmp_path.iterdir()) == []


@needs_kernel
def test_built_once_and_reused(tmp_path, fresh_kernel):
    assert fresh_kernel(str(tmp_path)) is not None
    libs = list(tmp_path.glob("native_linear-*.so"))
    assert len(libs) == 1
    stamp = libs[0].stat().st_mtime_ns
    native.kernel.cache_clear()
    assert fresh_kernel(str(tmp_path)) is not None
    assert libs[0].stat().st_mtime_ns == stamp


def test_projection_benchmark_times_every_available_kernel():
    from dspark.bench.kernels import ROWS, projection_kernels
    from helpers import hf_model, ours_from_hf

    model = ours_from_hf(hf_model("llama"), fast_kernels=True)
    rows = projection_kernels(model, repeats=2)
    names = {r["kernel"] for r in rows}
    assert "torch linear" in names and ("native (ours)" in names) == (native.kernel() is not None)
    assert len(rows) == len(names) * len(ROWS)
    assert all(r["seconds"] > 0 and r["gb_per_s"] > 0 for r in rows)


def test_projection_benchmark_command_saves_the_rows_asked_for(monkeypatch, tmp_path):
    import json
    import types

    from dspark.bench import kernels
    from dspark.models import loader
    from helpers import hf_model, ours_from_hf

    model = ours_from_hf(hf_model("llama"), fast_kernels=True)
    monkeypatch.setattr(loader, "load_model", lambda name, dtype: types.SimpleNamespace(model=model))
    kernels.main(["--rows", "1,3", "--repeats", "2", "--out", str(tmp_path)])
    saved = json.loads((tmp_path / "kernels.json").read_text())
    assert sorted({r["rows"] for r in saved["results"]}) == [1, 3] and "cpu" in saved["machine"]
    assert "| torch linear | 3 |" in (tmp_path / "kernels.md").read_text()
    with pytest.raises(SystemExit):
        kernels.main(["--rows", "0"])


def test_packed_row_counts_are_bucketed_and_padding_changes_no_row():
    from dspark.models.layers import bucket_rows

    assert [bucket_rows(r) for r in (1, 8, 9, 12, 13, 32, 33, 65, 129, 257, 513, 1025)] == \
        [1, 8, 12, 12, 16, 32, 36, 72, 144, 288, 576, 1152]
    assert len({bucket_rows(r) for r in range(1, 1025)}) <= 54  # a bounded set of oneDNN primitives
    assert all(bucket_rows(r) - r < r / 8 for r in range(65, 4096))  # padding under 1/8 of the rows
    w = torch.randn(48, 40)
    proj = Projection(w, packed=True)
    for rows in (9, 10, 30):
        x = torch.randn(rows, 40)
        assert torch.allclose(proj(x), F.linear(x, w), rtol=1e-5, atol=1e-5)


@needs_kernel
def test_projection_benchmark_times_another_kernel_source_beside_ours():
    from dspark.bench.kernels import projection_kernels
    from helpers import hf_model, ours_from_hf

    model = ours_from_hf(hf_model("llama"), fast_kernels=True)
    rows = projection_kernels(model, repeats=2, rows=(3,), compare=str(native.SOURCE))
    assert {r["kernel"] for r in rows} >= {"native (ours)", "native (native_linear)"}
    with pytest.raises(SystemExit, match="could not build"):
        projection_kernels(model, repeats=2, rows=(3,), compare="/nonexistent/kernel.c")
