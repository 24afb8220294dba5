"""Anchor-bounded packing: token-level indices give exactly the attention of a dense-mask reference."""
import pytest
import torch
import torch.nn.functional as F

from dspark.drafters.dspark_attention import block_attention
from dspark.drafters.dspark_model import DrafterArch, DSparkModel
from dspark.training.features import OnlineFeatures, TokenizedData
from dspark.training.losses import batch_loss
from dspark.training.packing import anchor_candidates, load_batch, plan_batch, slot_mask
from tiny_target import make_target_dir

GAMMA = 4


def source(tmp_path, n=4, seed=0):
    from dspark.models import load_model

    loaded = load_model(str(make_target_dir(tmp_path / "t")))
    g = torch.Generator().manual_seed(seed)
    ids, masks = [], []
    for i in range(n):
        length = 15 + 7 * i
        ids.append(torch.randint(2, 90, (length,), generator=g))
        mask = torch.zeros(length, dtype=torch.bool)
        mask[4:] = True
        mask[9:11] = False  # a user turn in the middle
        masks.append(mask)
    return loaded, OnlineFeatures(loaded.model, TokenizedData(ids, masks), (0, 1, 2), "float32")


def test_anchors_and_slot_masks_follow_the_rules():
    mask = torch.tensor([0, 1, 1, 1, 0, 1, 1, 1, 1], dtype=torch.bool)
    assert anchor_candidates(mask).tolist() == [1, 2, 5, 6, 7]
    valid = slot_mask(mask, torch.tensor([1, 2, 7]), 3)
    # anchor 1: labels at 2, 3, 4 -> 4 is not an assistant token; anchor 7: 8 exists, 9 is past the end
    assert valid.tolist() == [[True, True, False], [True, False, False], [True, False, False]]


def test_index_attention_equals_dense_mask_reference(tmp_path):
    _, src = source(tmp_path)
    plans = plan_batch(src, [0, 1, 2, 3], epoch=0, seed=0, anchors_per_seq=5, block_size=GAMMA)
    batch = load_batch(src, plans, GAMMA, 95)
    G, A = batch.anchors.shape
    N, H, kvH, hd = batch.features.shape[0], 4, 2, 8
    assert batch.ctx_index.shape[1] == int(batch.anchors.max())  # context bounded by the last anchor
    g = torch.Generator().manual_seed(1)
    q, kb, vb = (torch.randn(G, A, GAMMA, h, hd, generator=g) for h in (H, kvH, kvH))
    kflat, vflat = torch.randn(N, kvH, hd, generator=g), torch.randn(N, kvH, hd, generator=g)
    visible = (torch.arange(batch.ctx_index.shape[1])[None, None] < batch.anchors[..., None])
    ours = block_attention(q, kb, vb, kflat[batch.ctx_index], vflat[batch.ctx_index], visible, hd ** -0.5)

    # Reference: every block query against ALL flat context rows and ALL block rows, with a dense mask built
    # from the token-level indices (same sequence and position < anchor; or same block).
    qg = torch.arange(G)[:, None, None].expand(G, A, GAMMA).reshape(-1)
    qa = torch.arange(A)[None, :, None].expand(G, A, GAMMA).reshape(-1)
    anchor = batch.anchors[qg, qa]
    ctx_ok = (batch.ctx_seq[None, :] == qg[:, None]) & (batch.ctx_pos[None, :] < anchor[:, None])
    blk_ok = (qg[:, None] == qg[None, :]) & (qa[:, None] == qa[None, :])
    mask = torch.cat([ctx_ok, blk_ok], dim=1)  # [Q, N + Q]
    keys = torch.cat([kflat, kb.reshape(-1, kvH, hd)]).transpose(0, 1)[None]  # [1, kvH, N+Q, hd]
    values = torch.cat([vflat, vb.reshape(-1, kvH, hd)]).transpose(0, 1)[None]
    ref = F.scaled_dot_product_attention(q.reshape(-1, H, hd).transpose(0, 1)[None], keys, values,
                                         attn_mask=mask, enable_gqa=True)[0].transpose(0, 1)
    valid = batch.block_valid[qg, qa]
    torch.testing.assert_close(ours.reshape(-1, H, hd)[valid], ref[valid], rtol=1e-5, atol=1e-5)


def test_packing_several_sequences_equals_each_alone(tmp_path):
    loaded, src = source(tmp_path)
    arch = DrafterArch(layer_ids=(0, 1, 2), num_layers=2, block_size=GAMMA, mask_token_id=95, rank=8)
    torch.manual_seed(0)
    model = DSparkModel(arch, loaded.model)
    plans = plan_batch(src, [0, 1, 2, 3], 0, 0, 6, GAMMA)
    model.requires_grad_(False)
    _, together = batch_loss(model, load_batch(src, plans, GAMMA, 95))
    alone = [batch_loss(model, load_batch(src, [p], GAMMA, 95))[1] for p in plans]
    for key in ("ce", "tv", "conf", "den"):
        torch.testing.assert_close(torch.tensor(float(together[key])), torch.tensor(sum(float(a[key]) for a in alone)),
                                   rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("G,T,S", [(1, 9, 8), (5, 30, 8), (3, 17, 3)])
def test_one_block_attention_equals_the_grouped_products(G, T, S):
    """Drafting (one block per request) takes one fused attention call; training's grouped products are its
    reference: padded context rows (invisible) included."""
    from dspark.drafters.dspark_attention import grouped_block_attention, one_block_attention

    g = torch.Generator().manual_seed(G * 100 + T)
    H, kvH, hd, gamma = 6, 2, 16, 8
    q = torch.randn(G, 1, S, H, hd, generator=g)
    kb, vb = (torch.randn(G, 1, gamma, kvH, hd, generator=g) for _ in range(2))
    kc, vc = (torch.randn(G, T, kvH, hd, generator=g) for _ in range(2))
    visible = torch.arange(T)[None, None] < torch.randint(0, T + 1, (G, 1, 1), generator=g)  # some see nothing
    ours = one_block_attention(q, kb, vb, kc, vc, visible, hd ** -0.5)
    ref = grouped_block_attention(q, kb, vb, kc, vc, visible, hd ** -0.5)
    torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-6)
