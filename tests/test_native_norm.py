"""The C RMSNorm (models/native_norm.py) against an fp64 reference and torch, its row independence, where
layers.rms_norm takes it, and its fallbacks."""
import pytest
import torch
import torch.nn.functional as F

from dspark.models import layers, native_norm

needs_kernel = pytest.mark.skipif(native_norm.kernels() is None, reason="no C compiler here: torch's norm is used")


def _fp64(x, w, eps):
    x64 = x.double()
    return x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + eps) * w.double()


@needs_kernel
@pytest.mark.parametrize("rows", [1, 2, 5, 64, 513])
@pytest.mark.parametrize("d", [1, 7, 8, 576, 1543])
def test_fp32_matches_fp64_and_torch(rows, d):
    g = torch.Generator().manual_seed(rows * 10_000 + d)
    x, w = torch.randn(rows, d, generator=g) * 3, torch.randn(d, generator=g)
    got = native_norm.rms_norm(x, w, 1e-5)
    ref = _fp64(x, w, 1e-5)
    assert got.dtype == torch.float32 and got.shape == (rows, d)
    # a few fp32 roundings of each factor: the sum of squares (d terms), the root, two products
    assert float(((got.double() - ref).abs() / (ref.abs() + 1e-30)).max()) <= 1e-6 * (4 + d ** 0.5)
    torch.testing.assert_close(got, F.rms_norm(x, (d,), w, 1e-5), rtol=2e-6, atol=1e-7)


@needs_kernel
@pytest.mark.parametrize("d", [7, 576])
def test_bf16_is_the_fp32_result_rounded_once(d):
    """bf16 rows are widened, normalised like fp32 rows and rounded to nearest even: within one bf16 rounding of
    the fp64 result, and equal to torch's bf16 norm but where the two fp32 results straddle a rounding boundary."""
    g = torch.Generator().manual_seed(d)
    x, w = (torch.randn(16, d, generator=g) * 3).bfloat16(), torch.randn(d, generator=g).bfloat16()
    got = native_norm.rms_norm(x, w, 1e-6)
    ref = _fp64(x, w, 1e-6)
    assert got.dtype == torch.bfloat16
    assert float(((got.double() - ref).abs() / ref.abs().clamp_min(1e-30)).max()) <= 2 ** -8 * 1.01
    torch.testing.assert_close(got, F.rms_norm(x, (d,), w, 1e-6), rtol=2 ** -7, atol=0)
    assert (got != F.rms_norm(x, (d,), w, 1e-6)).float().mean() < 0.01


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_row_does_not_depend_on_the_other_rows(dtype):
    g = torch.Generator().manual_seed(1)
    x, w = torch.randn(9, 576, generator=g).to(dtype), torch.randn(576, generator=g).to(dtype)
    alone = torch.cat([native_norm.rms_norm(x[i:i + 1], w, 1e-5) for i in range(9)])
    assert torch.equal(native_norm.rms_norm(x, w, 1e-5), alone)
    many = torch.randn(300, 576, generator=g).to(dtype)  # rows split between threads
    assert torch.equal(native_norm.rms_norm(many, w, 1e-5)[:9],
                       torch.cat([native_norm.rms_norm(many[i:i + 1], w, 1e-5) for i in range(9)]))
    strided = torch.randn(9, 600, generator=g).to(dtype)[:, :576]  # rows of a wider tensor: a row stride ≠ d
    assert torch.equal(native_norm.rms_norm(strided, w, 1e-5),
                       torch.cat([native_norm.rms_norm(strided[i:i + 1].contiguous(), w, 1e-5) for i in range(9)]))


@needs_kernel
def test_layers_rms_norm_takes_the_kernel_only_where_it_applies(monkeypatch):
    calls = []
    real = native_norm.rms_norm
    monkeypatch.setattr(native_norm, "rms_norm", lambda *a: calls.append(a[0].shape) or real(*a))
    g = torch.Generator().manual_seed(2)
    w = torch.randn(32, generator=g)
    for x in (torch.randn(3, 32, generator=g), torch.randn(700, 32, generator=g)):  # a step, a prompt chunk
        torch.testing.assert_close(layers.rms_norm(x, w, 1e-6), F.rms_norm(x, (32,), w, 1e-6))
    assert calls == [(3, 32), (700, 32)]
    calls.clear()
    for x, wt in ((torch.randn(2, 4, 32, generator=g), w),  # per-head norms (q_norm, k_norm)
                  (torch.randn(3, 32, generator=g).double(), w.double()),  # neither fp32 nor bf16
                  (torch.randn(3, 64, generator=g)[:, ::2], w),  # strided columns
                  (torch.randn(3, 32, generator=g, requires_grad=True), w)):  # training needs autograd
        torch.testing.assert_close(layers.rms_norm(x, wt, 1e-6), F.rms_norm(x, (32,), wt, 1e-6))
    assert calls == []


def test_without_the_kernel_torch_is_used(monkeypatch):
    monkeypatch.setenv("DSPARK_NATIVE", "0")
    native_norm.kernels.cache_clear()
    try:
        assert native_norm.kernels() is None
        x, w = torch.randn(2, 16), torch.randn(16)
        assert torch.equal(layers.rms_norm(x, w, 1e-6), F.rms_norm(x, (16,), w, 1e-6))
    finally:
        native_norm.kernels.cache_clear()


@needs_kernel
def test_the_drafters_norm_takes_the_kernel_at_inference_only(monkeypatch):
    """The drafter's RMSNorm (3-D and 4-D block inputs) goes through the kernel when nothing needs gradients and
    through torch's composite in training, with the same result up to rounding."""
    from dspark.drafters.dspark_model import RMSNorm

    calls = []
    real = native_norm.rms_norm
    monkeypatch.setattr(native_norm, "rms_norm", lambda *a: calls.append(a[0].shape) or real(*a))
    norm = RMSNorm(32, 1e-6)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(32, generator=torch.Generator().manual_seed(3)))
    x = torch.randn(2, 1, 7, 32, generator=torch.Generator().manual_seed(4))  # [G, A, S, d]
    with torch.inference_mode():
        fast = norm(x)
    assert calls == [(14, 32)] and fast.shape == x.shape
    trained = norm(x.clone().requires_grad_(True))  # the weight is a parameter: autograd, torch's path
    assert calls == [(14, 32)] and trained.requires_grad
    torch.testing.assert_close(fast, trained.detach())
