"""The DSpark drafter at inference: exact distributions, batching, observe contract, checkpoints, refusals."""
import json

import pytest
import torch

from dspark.decoding import SamplingParams, make_generator, to_probs
from dspark.drafters.base import DraftRequest, DrafterError, make_drafter
from dspark.drafters.dspark_checkpoint import save_drafter
from dspark.drafters.dflash import dflash_arch  # noqa: F401  (registers checkpoint:dflash)
from dspark.drafters.dspark_model import DSparkModel
from dspark.models.transformer import Segment
from dspark_testlib import tiny_drafter, tiny_target


@pytest.fixture(scope="module")
def target():
    return tiny_target(seed=5, scale=3.0)


def observed_request(target, drafter, prompt, anchor, params, seed=0):
    cache = target.new_cache()
    out = target.forward(torch.tensor(prompt), [Segment(cache, 0, len(prompt))], hidden_layers=drafter.needs_layers)
    req = DraftRequest(tokens=prompt + [anchor], params=params, generator=make_generator(seed))
    drafter.observe(req, out.hidden, len(prompt))
    return req


def test_probs_are_the_exact_sampling_distributions_and_heads_are_left_to_right(target):
    drafter = tiny_drafter(target, head="markov", head_scale=1.0, block=4)
    params = SamplingParams(temperature=0.8, top_k=20)
    req = observed_request(target, drafter, [1, 2, 3, 4, 5], 6, params)
    prop = drafter.propose([req])
    h = drafter.model.backbone(torch.tensor([[[6] + [95] * 3]]), torch.tensor([[5]]),
                               *_ctx(drafter, req))[0, 0]  # [γ, d]
    base = drafter.model.base_logits(h)
    prev = torch.tensor([6, *prop.tokens[0, :-1].tolist()])  # the tokens actually drawn before each slot
    expected = to_probs(base + drafter.model.head.block_bias(prev, h), params)
    torch.testing.assert_close(prop.probs[0], expected, rtol=1e-5, atol=1e-6)
    assert prop.probs.dtype == torch.float32
    assert all(prop.probs[0, k, t] > 0 for k, t in enumerate(prop.tokens[0].tolist()))
    conf = drafter.model.confidence_logits(h, prev)
    torch.testing.assert_close(prop.confidence_logits[0], conf)
    torch.testing.assert_close(prop.confidences[0], conf.sigmoid())


def _ctx(drafter, req):
    from dspark.drafters.dspark import STATE_KEY
    from dspark.drafters.dspark_context import DraftContext

    ctx = req.state[STATE_KEY]
    return DraftContext.batch([ctx], torch.tensor([ctx.length]))


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_batched_propose_equals_one_by_one(target, temperature):
    drafter = tiny_drafter(target, head="rnn", block=4)
    params = SamplingParams(temperature=temperature)
    prompts = [[1, 2, 3], [9, 8, 7, 6, 5, 4, 3], [42]]

    def requests():  # fresh ones each time: the same seeds, so the same random draws
        return [observed_request(target, drafter, p, 11 + i, params, seed=i) for i, p in enumerate(prompts)]

    together = drafter.propose(requests())
    for i, r in enumerate(requests()):
        alone = drafter.propose([r])
        assert together.tokens[i].tolist() == alone.tokens[0].tolist()
        torch.testing.assert_close(together.confidences[i], alone.confidences[0], rtol=1e-5, atol=1e-6)
        if temperature:
            torch.testing.assert_close(together.probs[i], alone.probs[0], rtol=1e-5, atol=1e-6)


def test_propose_refuses_unobserved_tokens_and_observe_needs_the_layers(target):
    drafter = tiny_drafter(target)
    req = DraftRequest(tokens=[1, 2, 3], params=SamplingParams(), generator=make_generator(0))
    with pytest.raises(DrafterError, match="observe"):
        drafter.propose([req])
    with pytest.raises(DrafterError, match="hidden_layers"):
        drafter.observe(req, {0: torch.zeros(2, 64)}, 2)


def test_observe_with_start_rolls_back(target):
    drafter = tiny_drafter(target)
    params = SamplingParams(temperature=0)
    a = observed_request(target, drafter, [1, 2, 3, 4], 5, params)
    garbage = target.forward(torch.tensor([9, 9]), [Segment(target.new_cache(), 0, 2)],
                             hidden_layers=drafter.needs_layers).hidden
    drafter.observe(a, garbage, 2)  # positions 4, 5: states of tokens that were then rolled back
    with pytest.raises(DrafterError, match="gap"):
        drafter.observe(a, garbage, 1, start=9)
    drafter.observe(a, garbage, 0, start=4)
    b = observed_request(target, drafter, [1, 2, 3, 4], 5, params)
    assert drafter.propose([a]).tokens.tolist() == drafter.propose([b]).tokens.tolist()


def save(tmp_path, drafter, target, name="d", **kw):
    return save_drafter(tmp_path / name, drafter.model, target, target_name="tiny", **kw)


def test_checkpoint_round_trip_with_calibration(tmp_path, target):
    drafter = tiny_drafter(target, head="markov", head_scale=0.5, block=4)
    path = save(tmp_path, drafter, target)
    (path / "calibration.json").write_text(json.dumps({"format": "dspark.calibration", "version": 1,
                                                       "temperatures": [1.0, 2.0, 3.0, 4.0]}))
    loaded = make_drafter(str(path), target=target, gamma=3, bf16=False)  # compared token by token with fp32
    assert loaded.gamma == 3 and loaded.has_confidence and loaded.needs_layers == drafter.needs_layers
    params = SamplingParams(temperature=0)
    p1 = drafter.propose([observed_request(target, drafter, [3, 1, 4, 1, 5], 9, params)])
    p2 = loaded.propose([observed_request(target, loaded, [3, 1, 4, 1, 5], 9, params)])
    assert p2.tokens[0].tolist() == p1.tokens[0, :3].tolist()
    torch.testing.assert_close(p2.confidences[0], (p2.confidence_logits[0] / torch.tensor([1.0, 2.0, 3.0])).sigmoid())
    with pytest.raises(DrafterError, match="block size"):
        make_drafter(str(path), target=target, gamma=5)


def test_dflash_checkpoint_has_no_confidence(tmp_path, target):
    drafter = tiny_drafter(target, head="none", confidence=False)
    loaded = make_drafter(str(save(tmp_path, drafter, target)), target=target)
    assert loaded.name == "dflash" and not loaded.has_confidence
    prop = loaded.propose([observed_request(target, loaded, [1, 2], 3, SamplingParams())])
    assert prop.confidences is None and prop.probs.shape == (1, 4, 96)


def test_a_precision_suffix_sets_the_drafters_products(tmp_path, target):
    path = str(save(tmp_path, tiny_drafter(target, head="markov", block=4), target))
    assert make_drafter(path + "@fp32", target=target).bf16 is False
    assert "-bf16" in make_drafter(path + "@bf16", target=target).profile_id
    assert make_drafter(path + "@auto", target=target).bf16 == make_drafter(path, target=target).bf16
    with pytest.raises(DrafterError, match="DSpark/DFlash drafters, not 'ngram'"):
        make_drafter("ngram@fp32", target=target)
    with pytest.raises(DrafterError, match="given twice"):
        make_drafter(path + "@fp32", target=target, bf16=True)
    with pytest.raises(DrafterError, match="unknown drafter"):
        make_drafter(path + "@fp16", target=target)  # not a precision: read as a path, which does not exist


@pytest.mark.parametrize("change", [dict(vocab=80), dict(hidden=32), dict(layers=4), dict(seed=99)])
def test_a_drafter_made_for_another_target_is_refused(tmp_path, target, change):
    path = save(tmp_path, tiny_drafter(target), target)
    other = tiny_target(**{"scale": 3.0, "seed": 5, **change})
    with pytest.raises(DrafterError, match="another target|different embedding"):
        make_drafter(str(path), target=other)


@pytest.mark.parametrize("prefix,part", [("head.", "Markov/RNN head"), ("confidence.", "confidence head")])
def test_missing_head_weights_are_refused(tmp_path, target, prefix, part):
    from safetensors.torch import load_file, save_file

    path = save(tmp_path, tiny_drafter(target), target)
    tensors = load_file(str(path / "model.safetensors"))
    save_file({k: v for k, v in tensors.items() if not k.startswith(prefix)}, str(path / "model.safetensors"))
    with pytest.raises(DrafterError, match=part):
        make_drafter(str(path), target=target)


def test_init_from_target_copies_the_last_layers(target):
    model = DSparkModel(tiny_drafter(target, layers=2).model.arch, target)
    assert model.init_from_target(target) == [1, 2]
    torch.testing.assert_close(model.layers[1].qkv.weight, target.layers[2].qkv.weight)


@pytest.mark.parametrize("head", ["markov", "none"])
def test_greedy_batches_skip_the_distributions_and_draft_what_the_one_hot_path_drafts(target, head):
    """All-greedy proposals carry probs=None (point masses); beside a sampled request, the same greedy request
    gets the same tokens with one-hot rows on them — what verification would have been handed before."""
    drafter = tiny_drafter(target, head=head, head_scale=1.0, block=4)
    greedy, sampled = SamplingParams(temperature=0), SamplingParams(temperature=1.0)
    alone = drafter.propose([observed_request(target, drafter, [1, 2, 3, 4, 5], 6, greedy)])
    assert alone.probs is None
    mixed = drafter.propose([observed_request(target, drafter, [1, 2, 3, 4, 5], 6, greedy),
                             observed_request(target, drafter, [7, 8, 9], 10, sampled, seed=3)])
    assert torch.equal(mixed.tokens[0], alone.tokens[0])
    expected = torch.zeros_like(mixed.probs[0]).scatter_(-1, alone.tokens[0][:, None], 1.0)
    assert torch.equal(mixed.probs[0], expected)
    torch.testing.assert_close(mixed.confidences[0], alone.confidences[0])


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_shallow_proposal_is_the_first_slots_of_the_full_one(target, temperature):
    """propose(depth=g) drafts slots 1..g exactly as a full proposal does (same tokens, distributions and
    confidences; the same random draws, taken slot by slot), so a fixed-K policy can stop drafting at K."""
    drafter = tiny_drafter(target, head="markov", head_scale=1.0, block=4)
    params = SamplingParams(temperature=temperature)
    full = drafter.propose([observed_request(target, drafter, [1, 2, 3, 4, 5], 6, params, seed=9)])
    for depth in (1, 2):
        part = drafter.propose([observed_request(target, drafter, [1, 2, 3, 4, 5], 6, params, seed=9)], depth=depth)
        assert part.tokens.shape == (1, depth) and part.num_tokens.tolist() == [depth]
        assert torch.equal(part.tokens, full.tokens[:, :depth])
        torch.testing.assert_close(part.confidences, full.confidences[:, :depth])
        if temperature:
            torch.testing.assert_close(part.probs, full.probs[:, :depth])
    assert drafter.propose([observed_request(target, drafter, [1, 2], 6, params)], depth=99).tokens.shape[1] == 4


@pytest.mark.parametrize("layers", [1, 2])
def test_draft_states_equal_the_full_backbone_at_every_depth(target, layers):
    """The inference path (one cached qkv row for the mask slots, the last layer only for the slots kept) against
    the training path's `backbone` over the whole block, for a batch of requests with different contexts."""
    from dspark.drafters.dspark import STATE_KEY
    from dspark.drafters.dspark_context import DraftContext

    drafter = tiny_drafter(target, head="markov", block=5, layers=layers)
    params = SamplingParams(temperature=1.0)
    reqs = [observed_request(target, drafter, p, a, params, seed=i)
            for i, (p, a) in enumerate([([1, 2, 3, 4, 5], 6), ([9, 8, 7], 3), ([42] * 11, 17)])]
    ctxs = [r.state[STATE_KEY] for r in reqs]
    anchors = torch.tensor([c.length for c in ctxs])
    anchor_ids = torch.tensor([r.tokens[-1] for r in reqs])
    ctx_kv, visible = DraftContext.batch(ctxs, anchors)
    block_ids = torch.full((3, 1, 5), drafter.model.arch.mask_token_id)
    block_ids[:, 0, 0] = anchor_ids
    full = drafter.model.backbone(block_ids, anchors[:, None], ctx_kv, visible)[:, 0]  # [R, γ, d]
    for keep in range(1, 6):
        part = drafter.model.draft_states(anchor_ids, anchors, ctx_kv, visible, keep=keep)
        assert part.shape == (3, keep, full.shape[-1])
        torch.testing.assert_close(part, full[:, :keep], rtol=1e-5, atol=1e-5)
    with torch.no_grad():  # the cached mask row follows a change of the weights it was made from
        drafter.model.layers[0].qkv.weight.mul_(1.5)
    full = drafter.model.backbone(block_ids, anchors[:, None], ctx_kv, visible)[:, 0]
    torch.testing.assert_close(drafter.model.draft_states(anchor_ids, anchors, ctx_kv, visible, keep=5), full,
                               rtol=1e-5, atol=1e-5)
