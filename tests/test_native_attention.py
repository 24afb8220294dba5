"""The C ragged-attention kernel (models/native_attention.py) against an fp64 reference and torch's per-request path:
cache writes, causal and sliding-window masks, GQA, softcap, batch and thread invariance, and its fallbacks."""
import json

import pytest
import torch

from dspark.models import Segment, native, native_attention
from dspark.models.config import parse_hf_config
from dspark.models.weights import build_transformer
from helpers import hf_model, ours_from_hf

needs_kernel = pytest.mark.skipif(native_attention.kernel() is None, reason="no C compiler here: torch attends")


class Cache:
    def __init__(self, layers, kv_heads, cap, hd, g, dtype=torch.float32):
        self.k = torch.randn(layers, kv_heads, cap, hd, generator=g).to(dtype)
        self.v = torch.randn(layers, kv_heads, cap, hd, generator=g).to(dtype)

    @property
    def capacity(self):
        return self.k.shape[2]


def run_kernel(segs, heads, kv_heads, hd, layer=1, window=None, softcap=None, seed=0, threads=None,
               dtype=torch.float32):
    """segs: [(start, length, cap)] -> (caches, q, k, v, out) after one kernel call over all of them."""
    g = torch.Generator().manual_seed(seed)
    caches = [Cache(3, kv_heads, cap, hd, g, dtype) for _, _, cap in segs]
    n = sum(length for _, length, _ in segs)
    q, k, v = (torch.randn(n, h, hd, generator=g).to(dtype) for h in (heads, kv_heads, kv_heads))
    rows = [sum(s[1] for s in segs[:i]) for i in range(len(segs))]
    out = torch.full((n, heads, hd), float("nan"), dtype=dtype)
    table = native_attention.segment_table(caches, rows, [s[0] for s in segs], [s[1] for s in segs])
    before = torch.get_num_threads()
    torch.set_num_threads(threads or before)
    try:
        native_attention.attend(native_attention.kernel(), q, k, v, out, table, layer, window, hd ** -0.5, softcap)
    finally:
        torch.set_num_threads(before)
    return caches, rows, q, k, v, out


@needs_kernel
@pytest.mark.parametrize("heads,kv_heads,hd,window,softcap", [
    (9, 3, 64, None, None),  # SmolLM2's attention shape
    (4, 4, 32, None, None),  # no GQA
    (8, 1, 20, 6, None),  # multi-query, head size not a multiple of 8, a sliding window
    (4, 2, 16, None, 30.0),  # Gemma2-style logit softcap
])
def test_matches_fp64_reference_and_writes_the_cache(heads, kv_heads, hd, window, softcap):
    segs = [(40, 1, 48), (0, 5, 8), (17, 8, 30), (3, 1, 4), (9, 32, 64)]
    caches, rows, q, k, v, out = run_kernel(segs, heads, kv_heads, hd, window=window, softcap=softcap)
    for c, row, (start, length, _) in zip(caches, rows, segs):
        got = out[row:row + length]
        assert torch.equal(c.k[1][:, start:start + length], k[row:row + length].transpose(0, 1))
        assert torch.equal(c.v[1][:, start:start + length], v[row:row + length].transpose(0, 1))
        want = native_attention.reference(q[row:row + length], c.k[1], c.v[1], start, length, window, hd ** -0.5,
                                          softcap)
        assert torch.allclose(got, want, rtol=1e-5, atol=1e-5), float((got - want).abs().max())


@needs_kernel
@pytest.mark.parametrize("heads,kv_heads,hd,window,softcap", [
    (9, 3, 64, None, None),  # SmolLM2's attention shape
    (8, 1, 20, 6, None),  # multi-query, head size not a multiple of 8, a sliding window
    (4, 2, 16, None, 30.0),  # softcap
])
def test_bf16_is_fp32_arithmetic_rounded_once(heads, kv_heads, hd, window, softcap):
    """bf16 caches: the new rows land in the cache bit for bit, and each output is the fp64 attention of the bf16
    inputs within one bf16 rounding (2^-8 relative): the kernel widens exactly and rounds only the result."""
    segs = [(40, 1, 48), (0, 5, 8), (17, 8, 30), (3, 1, 4)]
    caches, rows, q, k, v, out = run_kernel(segs, heads, kv_heads, hd, window=window, softcap=softcap,
                                            dtype=torch.bfloat16)
    assert out.dtype == torch.bfloat16
    for c, row, (start, length, _) in zip(caches, rows, segs):
        assert torch.equal(c.k[1][:, start:start + length], k[row:row + length].transpose(0, 1))
        assert torch.equal(c.v[1][:, start:start + length], v[row:row + length].transpose(0, 1))
        want = native_attention.reference(q[row:row + length].float(), c.k[1].float(), c.v[1].float(), start,
                                          length, window, hd ** -0.5, softcap)
        err = (out[row:row + length].float() - want).abs()
        assert (err <= 2 ** -8 * want.abs() + 1e-6).all(), float(err.max())


@needs_kernel
def test_bf16_segment_does_not_depend_on_its_neighbours_or_the_thread_count():
    segs = [(30, 4, 40), (12, 1, 16), (5, 8, 16)]
    caches, _, q, k, v, together = run_kernel(segs, 9, 3, 64, seed=7, dtype=torch.bfloat16)
    *_, one_thread = run_kernel(segs, 9, 3, 64, seed=7, threads=1, dtype=torch.bfloat16)
    assert torch.equal(together, one_thread)
    alone = torch.empty(4, 9, 64, dtype=torch.bfloat16)
    native_attention.attend(native_attention.kernel(), q[:4], k[:4], v[:4], alone,
                            native_attention.segment_table(caches[:1], [0], [30], [4]), 1, None, 64 ** -0.5, None)
    assert torch.equal(together[:4], alone)


@needs_kernel
def test_other_layers_and_positions_are_untouched():
    g = torch.Generator().manual_seed(5)
    cache = Cache(3, 2, 16, 8, g)
    k0, v0 = cache.k.clone(), cache.v.clone()
    q, k, v = torch.randn(2, 4, 8), torch.randn(2, 2, 8), torch.randn(2, 2, 8)
    table = native_attention.segment_table([cache], [0], [6], [2])
    native_attention.attend(native_attention.kernel(), q, k, v, torch.empty(2, 4, 8), table, 1, None, 0.3, None)
    changed = (cache.k != k0).any(-1)  # [L, kvH, cap]
    assert changed[1, :, 6:8].all() and changed.sum() == 2 * 2
    assert torch.equal(cache.v[0], v0[0]) and torch.equal(cache.v[2], v0[2])


@needs_kernel
def test_a_segment_does_not_depend_on_its_neighbours_or_the_thread_count():
    segs = [(30, 4, 40), (12, 1, 16), (5, 8, 16)]
    _, rows, *_, together = run_kernel(segs, 6, 2, 16, seed=3)
    _, _, *_, one_thread = run_kernel(segs, 6, 2, 16, seed=3, threads=1)
    assert torch.equal(together, one_thread)
    g = torch.Generator().manual_seed(9)
    caches = [Cache(2, 2, 40, 16, g), Cache(2, 2, 16, 16, g)]
    q, k, v = torch.randn(5, 6, 16, generator=g), torch.randn(5, 2, 16, generator=g), torch.randn(5, 2, 16, generator=g)
    fn = native_attention.kernel()
    both = torch.empty(5, 6, 16)
    native_attention.attend(fn, q, k, v, both, native_attention.segment_table(caches, [0, 4], [30, 12], [4, 1]), 0,
                            None, 0.25, None)
    alone = torch.empty(4, 6, 16)
    native_attention.attend(fn, q[:4], k[:4], v[:4], alone, native_attention.segment_table(caches[:1], [0], [30], [4]),
                            0, None, 0.25, None)
    assert torch.equal(both[:4], alone)


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads,kv_heads,hd,window", [(9, 3, 64, None), (8, 2, 20, 11), (4, 2, 8, None)])
def test_a_verified_row_equals_the_same_token_decoded_alone(dtype, heads, kv_heads, hd, window):
    """Speculative decoding verifies a draft in one multi-token segment where plain decoding attends one token a
    step; the kernel blocks keys by 8 and query rows by 3, so every row must come out bitwise the same either way
    (whatever block a key falls in, and with the rows after it in the segment masked). Head sizes: two full
    16-lane vectors, one and a 4-dimension tail, and 8 (below a 16-lane vector: every dimension in the tail)."""
    g = torch.Generator().manual_seed(11)
    start, n = 29, 8
    cache = Cache(2, kv_heads, 48, hd, g, dtype)
    q, k, v = (torch.randn(n, h, hd, generator=g).to(dtype) for h in (heads, kv_heads, kv_heads))
    fn, scale = native_attention.kernel(), hd ** -0.5
    block = torch.empty(n, heads, hd, dtype=dtype)
    native_attention.attend(fn, q, k, v, block, native_attention.segment_table([cache], [0], [start], [n]), 1,
                            window, scale, None)
    for i in range(n):  # the cache already holds every row of the block: each step rewrites its own row only
        one = torch.empty(1, heads, hd, dtype=dtype)
        native_attention.attend(fn, q[i:i + 1], k[i:i + 1], v[i:i + 1], one,
                                native_attention.segment_table([cache], [0], [start + i], [1]), 1, window, scale, None)
        assert torch.equal(one[0], block[i]), i


@needs_kernel
def test_rejects_layouts_it_cannot_read():
    caches = [Cache(1, 1, 4, 8, torch.Generator().manual_seed(0))]
    table = native_attention.segment_table(caches, [0], [0], [1])
    q = torch.randn(1, 8, 2).transpose(1, 2)  # heads not contiguous
    with pytest.raises(ValueError, match="contiguous heads"):
        native_attention.attend(native_attention.kernel(), q, torch.randn(1, 1, 8), torch.randn(1, 1, 8),
                                torch.empty(1, 2, 8), table, 0, None, 1.0, None)
    for dtype in (torch.float16, torch.float64):  # the kernel reads fp32 or bf16 only, all of one dtype
        with pytest.raises(ValueError, match="fp32 or bf16"):
            native_attention.attend(native_attention.kernel(), torch.randn(1, 2, 8, dtype=dtype),
                                    torch.randn(1, 1, 8), torch.randn(1, 1, 8), torch.empty(1, 2, 8), table, 0,
                                    None, 1.0, None)


def _ragged_step_logits(model, native: bool) -> torch.Tensor:
    """One ragged step (decode, verification blocks and longer chunks together) after prefixes, through the C
    kernel (native) or torch's per-request attention."""
    model.native_attention = native
    g = torch.Generator().manual_seed(4)
    lengths = [(20, 1), (7, 8), (0, 40), (33, 4), (9, 12)]  # (cached positions, new tokens); 40 > MAX_QUERIES,
    # 12 > MAX_QUERIES_BF16: torch
    prefixes = [torch.randint(0, 96, (p,), generator=g) for p, _ in lengths]
    new = torch.randint(0, 96, (sum(n for _, n in lengths),), generator=g)
    caches = [model.new_cache(capacity=8) for _ in lengths]
    for c, p in zip(caches, prefixes):
        if len(p):
            model.forward(p, [Segment(c, 0, len(p))])
    return model.forward(new, [Segment(c, p, n) for c, (p, n) in zip(caches, lengths)]).logits


@needs_kernel
@pytest.mark.parametrize("kind", ["llama", "qwen3", "gemma3"])
def test_forward_agrees_with_torch_attention(kind):
    hf = hf_model(kind)
    model = ours_from_hf(hf)
    assert model.native_attention
    assert torch.allclose(_ragged_step_logits(model, True), _ragged_step_logits(model, False), rtol=1e-4, atol=1e-4)


@needs_kernel
@pytest.mark.parametrize("kind", ["llama", "qwen3", "gemma3"])
def test_bf16_forward_is_at_least_as_close_to_fp32_as_torchs(kind):
    """A bf16 model's ragged step through the kernel (fp32 arithmetic inside, each output rounded to bf16) against
    torch's per-request bf16 attention: measured against the fp32 model, the kernel's logits are no further off."""
    hf = hf_model(kind)
    config = parse_hf_config(json.loads(hf.config.to_json_string()))
    exact = _ragged_step_logits(ours_from_hf(hf), False)
    model = build_transformer(config, hf.state_dict(), torch.bfloat16)
    assert model.native_attention
    off = {native: float((_ragged_step_logits(model, native) - exact).norm() / exact.norm()) for native in (0, 1)}
    assert 0 < off[True] <= 1.25 * off[False], off


@needs_kernel
def test_the_kernel_takes_segments_up_to_its_dtypes_limit():
    """bf16 segments longer than MAX_QUERIES_BF16 go to torch's flash kernel, which is faster there."""
    hf = hf_model("llama")
    config = parse_hf_config(json.loads(hf.config.to_json_string()))
    for dtype, limit in ((torch.float32, native_attention.MAX_QUERIES), (torch.bfloat16,
                                                                          native_attention.MAX_QUERIES_BF16)):
        model = build_transformer(config, hf.state_dict(), dtype)
        caches = [model.new_cache(capacity=64) for _ in range(3)]
        segments = [Segment(caches[0], 0, 1), Segment(caches[1], 0, limit), Segment(caches[2], 0, limit + 1)]
        for s in segments:
            s.cache.begin_write(s.start, s.length)
        plan = model._plan_attention(segments)
        assert plan.native.shape[1] == 2 and [seg for _, seg, _ in plan.loop] == segments[2:]


def test_disabled_by_environment(monkeypatch):
    native_attention.kernel.cache_clear()
    monkeypatch.setenv("DSPARK_NATIVE", "0")
    try:
        assert native_attention.kernel() is None
        assert not ours_from_hf(hf_model("llama")).native_attention
    finally:
        native_attention.kernel.cache_clear()


def test_no_compiler_falls_back(monkeypatch, tmp_path):
    monkeypatch.setenv("CC", "/nonexistent/cc")
    native_attention.kernel.cache_clear()
    try:
        assert native_attention.kernel(str(tmp_path)) is None
    finally:
        native_attention.kernel.cache_clear()
    assert native.load_function(native_attention.SOURCE, "dspark_ragged_attention", str(tmp_path)) is None
