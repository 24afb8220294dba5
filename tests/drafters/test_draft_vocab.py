"""Draft vocabularies: a drafter whose LM head covers a subset of the target's tokens stays lossless.

The drafter cannot propose tokens outside the subset, so the target's choice there must come from the residual
max(0, p − q): greedy outputs must equal plain greedy, the T = 1 law must equal the target's, and the ids must
survive a bf16 checkpoint round trip.
"""
import pytest
import torch

from dspark.decoding import SamplingParams
from dspark.drafters.base import DrafterError
from dspark.drafters.dspark import DSparkDrafter, load_dspark
from dspark.drafters.dspark_checkpoint import save_drafter
from dspark.drafters.dspark_model import DrafterArch, DSparkModel
from dspark.drafters.eagle3 import Eagle3Drafter
from dspark.drafters.eagle3_model import Eagle3Model
from dspark.training.draft_vocab import coverage, select_draft_vocab
from dspark.training.features import TokenizedData
from dspark_testlib import speculative, tiny_target
from test_dspark_exactness import (FIRST, PROMPT, V, _engine_run, assert_first_tokens_match_target,
                                   assert_seeded_engine_reproducible, plain_greedy)

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py


def vocab_drafter(target, ids, *, kind="dspark", block=4, head_scale=None, seed=1):
    L, Vt = target.config.num_layers, target.config.vocab_size
    plain = kind != "dspark"
    arch = DrafterArch(drafter_type=kind, layer_ids=tuple(range(L)), num_layers=1, block_size=block,
                       mask_token_id=Vt - 1, head="none" if plain else "markov", rank=0 if plain else 6,
                       confidence=not plain, draft_vocab=len(ids))
    torch.manual_seed(seed)
    model = (Eagle3Model if kind == "eagle3" else DSparkModel)(arch, target)
    model.init_from_target(target)
    model.set_draft_vocab(torch.tensor(ids))
    if head_scale is not None:
        with torch.no_grad():
            model.head.w1.weight.normal_(0, head_scale)
            model.head.w2.weight.normal_(0, head_scale)
    cls = Eagle3Drafter if kind == "eagle3" else DSparkDrafter
    return cls(model.eval().requires_grad_(False), target)


def test_proposals_stay_inside_the_draft_vocabulary():
    target = tiny_target(seed=4, scale=2.0)
    ids = list(range(0, 96, 3))
    drafter = vocab_drafter(target, ids)
    from dspark.drafters.base import DraftRequest
    from dspark.decoding import make_generator
    from dspark.models.transformer import Segment

    prompt = [5, 17, 33, 2, 9]
    cache = target.new_cache(capacity=32)
    out = target.forward(torch.tensor(prompt), [Segment(cache, 0, len(prompt))], hidden_layers=drafter.needs_layers)
    request = DraftRequest(tokens=prompt + [4], params=SamplingParams(temperature=1.0), generator=make_generator(0))
    drafter.observe(request, out.hidden, len(prompt))
    proposal = drafter.propose([request])
    assert all(int(t) in ids for t in proposal.tokens[0])
    # the distributions stay in the draft vocabulary (verification reads them there: verify.DraftVocab)
    assert proposal.probs.shape == (1, 4, len(ids)) and torch.equal(proposal.vocab.ids, torch.tensor(ids))
    full = proposal.full_probs()
    assert full.shape == (1, 4, 96) and float(full[0][:, [i for i in range(96) if i not in ids]].abs().sum()) == 0
    assert torch.allclose(full[0].sum(-1), torch.ones(4)) and torch.equal(full[0][:, ids], proposal.probs[0])
    model = drafter.model
    assert torch.equal(model.to_full(model.to_local(torch.tensor(ids))), torch.tensor(ids))
    assert model.to_local(torch.tensor([1, 2, 4])).tolist() == [-1, -1, -1]
    probs = model.scatter_probs(torch.full((2, len(ids)), 1 / len(ids)))
    assert probs.shape == (2, 96) and float(probs[:, [1, 2]].abs().sum()) == 0 and torch.allclose(probs.sum(-1),
                                                                                                torch.ones(2))


@pytest.mark.parametrize("kind", ["dspark", "dflash", "eagle3"])
def test_greedy_with_draft_vocabulary_equals_plain(kind):
    from dspark.scheduling.registry import make_policy

    target = tiny_target(seed=4, scale=6.0)  # greedy repeats tokens: drafts inside the subset get accepted
    prompts = [[3, 4, 5, 3, 4, 5, 3, 4], [5, 17, 33, 2, 9], [40, 41]]
    ids = sorted({*range(0, 96, 2), 3, 5})  # half the vocabulary: some greedy tokens are outside it
    drafter = vocab_drafter(target, ids, kind=kind)
    params = [SamplingParams(temperature=0, max_new_tokens=24, ignore_eos=True)] * len(prompts)
    reqs = _engine_run(target, drafter, make_policy("fixed-4"), prompts, params)
    outside = 0
    for prompt, req in zip(prompts, reqs):
        assert req.error is None and req.output == plain_greedy(target, prompt, 24)
        outside += sum(t not in ids for t in req.output)
    assert outside > 0  # the target did emit tokens the drafter cannot propose
    if kind == "dspark":
        assert sum(r.accepted for r in reqs) > 0


@pytest.mark.parametrize("kind", ["dspark", "eagle3"])
def test_t1_law_with_draft_vocabulary(kind):
    target = tiny_target(vocab=V, hidden=32, layers=2, seed=11, scale=3.0)
    ids = [0, 2, 3, 5, 7, 8, 10, 11]  # 8 of 12 tokens
    drafter = vocab_drafter(target, ids, kind=kind, block=3, head_scale=1.0 if kind == "dspark" else None)
    n, stats = 20_000, {}
    outs = []
    for start in range(0, n, 5000):
        outs += speculative(target, drafter, [PROMPT] * 5000, SamplingParams(temperature=1.0), FIRST,
                            seeds=list(range(start, start + 5000)), capacity=16, stats=stats)
    assert 0 < stats["accepted"]
    assert any(o[0] not in ids for o in outs)  # tokens outside the subset still appear, via the residual
    assert_first_tokens_match_target(target, outs, n)


def test_inference_builds_no_copy_of_the_lm_head_and_training_still_can():
    """Drafting reads the target's head rows through its own kernel; the frozen head copies (fp32 in the head dtype:
    for a bf16 SmolLM2, 144 MiB of copies nothing read) are built only when training or the reference path asks,
    and a copy first asked for under inference mode still takes part in autograd afterwards."""
    target = tiny_target(seed=4, scale=2.0)
    drafter = vocab_drafter(target, list(range(0, 96, 3)))
    from dspark.drafters.base import DraftRequest
    from dspark.decoding import make_generator
    from dspark.models.transformer import Segment

    prompt = [5, 17, 33, 2, 9]
    cache = target.new_cache(capacity=32)
    out = target.forward(torch.tensor(prompt), [Segment(cache, 0, len(prompt))], hidden_layers=drafter.needs_layers)
    request = DraftRequest(tokens=prompt + [4], params=SamplingParams(temperature=1.0), generator=make_generator(0))
    drafter.observe(request, out.hidden, len(prompt))
    drafter.propose([request])
    model = drafter.model
    assert model.frozen.draft_head is None and model.frozen.full_head is None
    h = torch.randn(3, target.config.hidden_size)
    with torch.inference_mode():
        reference = model.base_logits(h)  # the reference path builds its copy here
    tol = dict(atol=0.05, rtol=0.02) if drafter.bf16 else dict(atol=1e-5, rtol=1e-5)  # bf16 head products
    torch.testing.assert_close(drafter.draft_logits(h), reference, **tol)
    model.requires_grad_(True)
    x = h.clone().requires_grad_(True)
    model.base_logits(x).logsumexp(-1).sum().backward()  # the copy made under inference mode, used with autograd
    assert x.grad is not None and torch.isfinite(x.grad).all()


def test_seeded_engine_with_draft_vocabulary():
    target = tiny_target(seed=4, scale=2.0)
    assert_seeded_engine_reproducible(target, vocab_drafter(target, list(range(0, 96, 2))))


def test_checkpoint_keeps_the_ids_in_bf16(tmp_path):
    target = tiny_target(seed=4, scale=2.0)
    ids = [1, 7, 300 % 96, 50, 51, 95] + list(range(60, 90))
    drafter = vocab_drafter(target, sorted(set(ids)))
    save_drafter(tmp_path / "d", drafter.model, target, target_name="tiny", dtype=torch.bfloat16)
    loaded = load_dspark(tmp_path / "d", target)
    assert torch.equal(loaded.model.vocab_ids, drafter.model.vocab_ids)
    assert loaded.model.draft_rows().shape == (len(set(ids)), target.config.hidden_size)
    assert torch.equal(loaded.model.draft_rows(), target.lm_head.weight[loaded.model.vocab_ids])
    from dspark.drafters.deepspec_layout import export_deepspec
    with pytest.raises(DrafterError, match="draft vocabulary"):
        export_deepspec(tmp_path / "d", tmp_path / "hf", target)


def test_invalid_draft_vocabularies_are_refused():
    target = tiny_target(seed=4)
    arch = DrafterArch(drafter_type="dflash", layer_ids=(0, 1), head="none", rank=0, confidence=False,
                       mask_token_id=95, draft_vocab=4)
    model = DSparkModel(arch, target)
    with pytest.raises(ValueError, match="4 ids|draft_vocab=4"):
        model.set_draft_vocab(torch.tensor([1, 2, 3]))
    with pytest.raises(ValueError, match="distinct"):
        model.set_draft_vocab(torch.tensor([1, 1, 2, 3]))
    with pytest.raises(ValueError, match="between 2"):
        DSparkModel(DrafterArch(drafter_type="dflash", layer_ids=(0,), head="none", rank=0, confidence=False,
                                draft_vocab=96), target)


def test_select_draft_vocab_ranks_answer_tokens_and_forces_eos():
    ids = [torch.tensor([9, 9, 9, 1, 2, 2, 4]), torch.tensor([8, 8, 8, 8, 1, 2])]
    masks = [torch.tensor([0, 0, 0, 1, 1, 1, 0], dtype=torch.bool), torch.tensor([0, 0, 0, 0, 1, 1], dtype=torch.bool)]
    data = TokenizedData(ids, masks)
    # answer counts: 2 ×3, 1 ×2; then whole-sequence counts break the tie: 8 (4) before 9 (3).
    assert select_draft_vocab(data, 3, 12).tolist() == [1, 2, 8]
    assert select_draft_vocab(data, 3, 12, always=(11,)).tolist() == [1, 2, 11]
    assert coverage(data, torch.tensor([2, 8])) == 3 / 5


def test_drafting_cost_profile_and_profile_ids():
    """`dspark profile --drafter` measures one propose() per request count; the cache key tells drafters apart."""
    from dspark.engine.profiling import drafter_step_fn
    from dspark.scheduling.profile_measure import measure_profile

    target = tiny_target(seed=4)
    sub = vocab_drafter(target, list(range(0, 96, 2)))
    prof = measure_profile(lambda b: None, (1, 2), repeats=1, draft_fn=drafter_step_fn(target, sub),
                           request_counts=(1, 3))
    assert prof.draft_requests == (1, 3) and all(s > 0 for s in prof.draft_seconds)
    full = vocab_drafter(target, list(range(0, 96, 2)), kind="dflash")
    assert sub.profile_id.startswith("dspark-g4-L1-markov6-v48-conf") and full.profile_id.startswith("dflash-g4-L1-none0-v48")


def test_saved_drafter_files_are_readable_by_others(tmp_path):
    """safetensors and mkstemp create owner-only files; a drafter directory is shared data (0644)."""
    target = tiny_target(seed=4)
    drafter = vocab_drafter(target, list(range(0, 96, 2)))
    out = save_drafter(tmp_path / "d", drafter.model, target, target_name="tiny")
    for name in ("model.safetensors", "config.json"):
        assert (out / name).stat().st_mode & 0o777 == 0o644, name


@pytest.mark.parametrize("packed", [False, True])
def test_inference_head_matches_the_training_head(packed):
    """The drafters' inference head (the target's kernel, pre-packed on CPU) against the plain product of
    DraftVocabMixin.base_logits that training uses."""
    from dspark.drafters.frozen_target import inference_head
    from dspark.models.layers import Projection

    target = tiny_target(seed=4)
    target.lm_head = Projection(target.lm_head.weight, packed=packed)
    for ids in (None, list(range(0, 96, 3))):
        drafter = vocab_drafter(target, ids) if ids else vocab_drafter(target, list(range(0, 96, 2)))
        model = drafter.model
        if ids is None:  # the full vocabulary: the target's own head
            model = DSparkModel(DrafterArch(drafter_type="dflash", layer_ids=(0, 1), head="none", rank=0,
                                            confidence=False, mask_token_id=95), target)
        h = torch.randn(3, 4, target.config.hidden_size)
        torch.testing.assert_close(inference_head(model, target)(h), model.base_logits(h), rtol=1e-5, atol=1e-5)
