"""The C ragged-attention kernel (models/native_attention.py) against an fp64 reference and torch's per-request path:
cache writes, causal and sliding-window masks, GQA, softcap, batch and thread invariance, and its fallbacks."""
import pytest
import torch

from dspark.models import Segment, native, native_attention
from helpers import hf_model, ours_from_hf

needs_kernel = pytest.mark.skipif(native_attention.kernel() is None, reason="no C compiler here: torch attends")


class Cache:
    def __init__(self, layers, kv_heads, cap, hd, g):
        self.k = torch.randn(layers, kv_heads, cap, hd, generator=g)
        self.v = torch.randn(layers, kv_heads, cap, hd, generator=g)

    @property
    def capacity(self):
        return self.k.shape[2]


def run_kernel(segs, heads, kv_heads, hd, layer=1, window=None, softcap=None, seed=0, threads=None):
    """segs: [(start, length, cap)] -> (caches, q, k, v, out) after one kernel call over all of them."""
    g = torch.Generator().manual_seed(seed)
    caches = [Cache(3, kv_heads, cap, hd, g) for _, _, cap in segs]
    n = sum(length for _, length, _ in segs)
    q, k, v = (torch.randn(n, h, hd, generator=g) for h in (heads, kv_heads, kv_heads))
    rows = [sum(s[1] for s in segs[:i]) for i in range(len(segs))]
    out = torch.full((n, heads, hd), float("nan"))
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
def test_rejects_layouts_it_cannot_read():
    caches = [Cache(1, 1, 4, 8, torch.Generator().manual_seed(0))]
    table = native_attention.segment_table(caches, [0], [0], [1])
    q = torch.randn(1, 8, 2).transpose(1, 2)  # heads not contiguous
    with pytest.raises(ValueError, match="contiguous heads"):
        native_attention.attend(native_attention.kernel(), q, torch.randn(1, 1, 8), torch.randn(1, 1, 8),
                                torch.empty(1, 2, 8), table, 0, None, 1.0, None)


@needs_kernel
@pytest.mark.parametrize("kind", ["llama", "qwen3", "gemma3"])
def test_forward_agrees_with_torch_attention(kind):
    """One ragged step (decode, verification blocks and a long prefill chunk together) through both paths."""
    model = ours_from_hf(hf_model(kind))
    assert model.native_attention
    g = torch.Generator().manual_seed(4)
    lengths = [(20, 1), (7, 8), (0, 40), (33, 4)]  # (cached positions, new tokens); 40 > MAX_QUERIES: torch
    prefixes = [torch.randint(0, 96, (p,), generator=g) for p, _ in lengths]
    new = torch.randint(0, 96, (sum(n for _, n in lengths),), generator=g)
    logits = {}
    for flag in (False, True):
        model.native_attention = flag
        caches = [model.new_cache(capacity=8) for _ in lengths]
        for c, p in zip(caches, prefixes):
            if len(p):
                model.forward(p, [Segment(c, 0, len(p))])
        logits[flag] = model.forward(new, [Segment(c, p, n) for c, (p, n) in zip(caches, lengths)]).logits
    assert torch.allclose(logits[True], logits[False], rtol=1e-4, atol=1e-4)


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
