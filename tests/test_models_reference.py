"""Our forward against transformers on tiny random models of every family (fp32, within 1e-3 relative)."""
import pytest
import torch

from dspark.models import Segment
from helpers import TINY, hf_model, ours_from_hf

KINDS = sorted(TINY)


def rel_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


def hf_logits_and_hidden(model, ids: torch.Tensor):
    with torch.no_grad():
        out = model(ids[None], output_hidden_states=True)
    return out.logits[0], out.hidden_states


@pytest.mark.parametrize("kind", KINDS)
def test_prefill_matches_transformers(kind):
    hf = hf_model(kind)
    ours = ours_from_hf(hf)
    ids = torch.randint(0, TINY[kind]["vocab_size"], (23,), generator=torch.Generator().manual_seed(1))
    ref, ref_hidden = hf_logits_and_hidden(hf, ids)
    layers = tuple(range(ours.config.num_layers - 1))  # the last layer's HF hidden state is post-norm
    out = ours.forward(ids, [Segment(ours.new_cache(), 0, len(ids))], hidden_layers=layers)
    diff = rel_diff(out.logits, ref)
    print(f"{kind}: max relative logit difference {diff:.2e}")
    assert diff < 1e-3
    for i in layers:  # layer i = output of decoder layer i = HF hidden_states[i + 1]
        assert rel_diff(out.hidden[i], ref_hidden[i + 1][0]) < 1e-3


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("fast_kernels", [False, True])
def test_ragged_batch_with_caches_and_rollback(kind, fast_kernels):
    """Three requests advanced in mixed chunks inside shared flattened forwards, with a rollback. fast_kernels
    also selects the attention path: the C kernel for short segments where it could be built, else torch's."""
    hf = hf_model(kind)
    ours = ours_from_hf(hf, fast_kernels=fast_kernels)
    ours.native_attention = ours.native_attention and fast_kernels
    g = torch.Generator().manual_seed(2)
    vocab = TINY[kind]["vocab_size"]
    seqs = [torch.randint(0, vocab, (n,), generator=g) for n in (17, 9, 12)]
    caches = [ours.new_cache(capacity=4) for _ in seqs]  # tiny capacity: forces the cache to grow
    got = [[] for _ in seqs]
    # Schedule of (chunk lengths per request) per step; 0 = request idle this step. The 1- and 2-row steps are
    # decode-sized: with fast kernels they run through the native C kernel where one could be built.
    plan = [(6, 9, 1), (1, 0, 4), (5, 0, 6), (1, 0, 1), (2, 0, 0), (1, 0, 0), (1, 0, 0)]
    done = [0, 0, 0]
    for step in plan:
        segs, toks = [], []
        for r, n in enumerate(step):
            if n:
                segs.append(Segment(caches[r], done[r], n))
                toks.append(seqs[r][done[r]: done[r] + n])
        out = ours.forward(torch.cat(toks), segs)
        offset = 0
        for r, n in enumerate(step):
            if n:
                got[r].append(out.logits[offset: offset + n])
                offset += n
                done[r] += n
        if step == plan[1]:  # a speculative rejection: request 2 drops its last 3 positions and redoes them
            caches[2].truncate(done[2] - 3)
            redo = ours.forward(seqs[2][done[2] - 3: done[2]], [Segment(caches[2], done[2] - 3, 3)])
            got[2][-1] = torch.cat([got[2][-1][:-3], redo.logits])
    for r, seq in enumerate(seqs):
        ref, _ = hf_logits_and_hidden(hf, seq)
        assert rel_diff(torch.cat(got[r]), ref) < 1e-3, f"request {r}"


@pytest.mark.parametrize("kind,sliding", [("gemma3", (0, 1, 3)), ("mistral", (0, 1)), ("qwen2_sliding", (1, 2))])
def test_sliding_window_is_exercised(kind, sliding):
    """With a window of 5-6 and 23 tokens, a full-attention forward must differ from the family's: the mask
    matters, and the layers that slide are the ones transformers slides."""
    hf = hf_model(kind)
    ours = ours_from_hf(hf)
    assert tuple(i for i in range(ours.config.num_layers) if ours.config.is_sliding(i)) == sliding
    ids = torch.randint(0, 96, (23,), generator=torch.Generator().manual_seed(3))
    ref, _ = hf_logits_and_hidden(hf, ids)
    assert rel_diff(ours.forward(ids, [Segment(ours.new_cache(), 0, len(ids))]).logits, ref) < 1e-3
    object.__setattr__(ours.config, "sliding_window", 10_000)  # widen the window on our side only
    wrong = ours.forward(ids, [Segment(ours.new_cache(), 0, len(ids))]).logits
    assert rel_diff(wrong[:5], ref[:5]) < 1e-3  # inside the first window nothing changes
    assert rel_diff(wrong[6:], ref[6:]) > 1e-3


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kind", ["llama", "qwen2_sliding"])
def test_one_query_attention_equals_attention_over_every_head(kind, dtype):
    """A one-token segment outside our C kernel attends its grouped query heads as rows of their kv head (a faster
    torch path in bf16): the same numbers as attention with every head expanded, within the dtype's rounding."""
    import torch.nn.functional as F

    model = ours_from_hf(hf_model(kind))
    c = model.config
    g = torch.Generator().manual_seed(6)
    q = torch.randn(1, c.num_heads, c.head_dim, generator=g).to(dtype)
    keys, values = (torch.randn(1, c.num_kv_heads, 11, c.head_dim, generator=g).to(dtype) for _ in range(2))
    for mask in (None, torch.arange(11)[None, :] >= 5):  # [1, T]: a sliding window's band
        got = model._one_query_attention(q, keys, values, mask)
        want = F.scaled_dot_product_attention(q.transpose(0, 1).unsqueeze(0), keys, values, attn_mask=mask,
                                              scale=c.query_scale, enable_gqa=True)[0].transpose(0, 1)
        tol = 1e-6 if dtype == torch.float32 else 1e-2
        assert got.shape == want.shape == (1, c.num_heads, c.head_dim)
        assert torch.allclose(got.float(), want.float(), atol=tol, rtol=tol)
