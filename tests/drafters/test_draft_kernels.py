"""The drafter's inference kernels (drafters/draft_kernels.py) against its own nn.Linear products."""
import pytest
import torch

from dspark.decoding import SamplingParams, make_generator
from dspark.drafters import draft_kernels
from dspark.drafters.base import DraftRequest
from dspark.models.transformer import Segment
from dspark_testlib import tiny_drafter, tiny_target


@pytest.fixture(scope="module")
def target():
    return tiny_target(seed=3, scale=3.0)


def _observed(target, drafter, prompts, params, seed=0):
    """One observed request per prompt, with its own seeded generator."""
    requests = []
    for i, prompt in enumerate(prompts):
        cache = target.new_cache()
        out = target.forward(torch.tensor(prompt), [Segment(cache, 0, len(prompt))],
                             hidden_layers=drafter.needs_layers)
        req = DraftRequest(tokens=prompt + [int(out.logits[-1].argmax())], params=params,
                           generator=make_generator(seed + i))
        drafter.observe(req, out.hidden, len(prompt))
        requests.append(req)
    return requests


def _kernels_available(target) -> bool:
    return target.lm_head.packed is not None or target.lm_head.native


PROMPTS = [[5, 17, 33, 2, 9, 41], [8, 8, 60, 12], [70, 3, 3, 3, 21, 44, 19, 6, 1]]


@pytest.mark.parametrize("head", ["markov", "rnn"])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_kernels_draft_what_the_reference_drafts(target, head, temperature):
    """Same context, same seeds: the fast path and the nn.Linear path give the same tokens and (to float
    rounding) the same distributions and confidences, for 1 request (the C kernel's rows) and 3."""
    if not _kernels_available(target):
        pytest.skip("no fast CPU kernel in this build: the drafter runs its reference path only")
    drafter = tiny_drafter(target, head=head, head_scale=1.0, block=4)
    assert drafter.kernels > 0 and drafter.profile_id.endswith("-k")
    params = SamplingParams(temperature=temperature)
    for prompts in (PROMPTS[:1], PROMPTS):
        fast = drafter.propose(_observed(target, drafter, prompts, params))
        draft_kernels.detach(drafter.model)
        try:
            ref = drafter.propose(_observed(target, drafter, prompts, params))
        finally:
            draft_kernels.attach(drafter.model, packed=target.lm_head.packed is not None,
                                 native=target.lm_head.native)
        assert torch.equal(fast.tokens, ref.tokens)
        torch.testing.assert_close(fast.confidences, ref.confidences, atol=1e-5, rtol=1e-5)
        if temperature > 0:
            torch.testing.assert_close(fast.probs, ref.probs, atol=1e-5, rtol=1e-4)


def test_autograd_runs_the_modules_own_products(target):
    """With gradients on, the kernels stand aside: the result and every weight gradient are the reference's."""
    if not _kernels_available(target):
        pytest.skip("no fast CPU kernel in this build")
    drafter = tiny_drafter(target, head="markov", head_scale=1.0, block=4)
    model = drafter.model.requires_grad_(True)
    x = torch.randn(2, 3 * target.config.hidden_size)

    def grads():
        model.zero_grad()
        model.fuse_features(x.view(2, 3, -1)).square().sum().backward()
        return model.fuse.weight.grad.clone()

    with_kernels = grads()
    draft_kernels.detach(model)
    torch.testing.assert_close(with_kernels, grads(), atol=0, rtol=0)


def test_a_weight_changed_after_attach_is_never_read_stale(target):
    """An in-place update (an optimizer step, load_state_dict) moves the weight's version: the packed snapshot is
    then bypassed, so the output follows the new weight."""
    if not _kernels_available(target):
        pytest.skip("no fast CPU kernel in this build")
    drafter = tiny_drafter(target, head="markov", block=4)
    layer = drafter.model.layers[0]
    x = torch.randn(7, target.config.hidden_size)
    with torch.inference_mode():
        before = draft_kernels.linear(layer, "gate_up", x)
    with torch.no_grad():
        layer.gate_up.weight.mul_(2.0)
    with torch.inference_mode():
        after = draft_kernels.linear(layer, "gate_up", x)
        torch.testing.assert_close(after, layer.gate_up(x), atol=0, rtol=0)
    torch.testing.assert_close(after, 2 * before, atol=1e-5, rtol=1e-5)


def test_without_kernels_nothing_is_attached(target):
    model = tiny_drafter(target).model
    draft_kernels.detach(model)
    assert draft_kernels.attach(model, packed=False, native=False) == 0
    assert not any("fast_linears" in m.__dict__ for m in model.modules())


def _drafted_logits(drafter, monkeypatch, prompts, params):
    """Propose once for `prompts`, recording each slot's fp32 logits [R, Vd] as they reach `draw`."""
    from dspark.drafters import dspark as dspark_module

    seen, draw = [], dspark_module.draw
    monkeypatch.setattr(dspark_module, "draw", lambda logits, *a: seen.append(logits.clone()) or draw(logits, *a))
    proposal = drafter.propose(_observed(drafter.target, drafter, prompts, params))
    monkeypatch.setattr(dspark_module, "draw", draw)
    return proposal, torch.stack(seen, dim=1)  # [R, γ, Vd]


@pytest.mark.parametrize("head", ["markov", "rnn"])
def test_bf16_products_draft_what_fp32_drafts_up_to_near_ties(target, head, monkeypatch):
    """bf16 products move each logit by rounding only: until two greedy drafts part, every slot's logits and
    confidences agree to a bf16 tolerance, and where they part the fp32 path's top two logits are within that
    tolerance (a near-tie); for 1 request (the bf16 C kernel's rows in the heads, where the CPU has one) and 3
    (bf16 oneDNN from 3 rows)."""
    if not _kernels_available(target):
        pytest.skip("no fast CPU kernel in this build")
    fp32 = tiny_drafter(target, head=head, head_scale=1.0, block=4)
    bf16 = tiny_drafter(target, head=head, head_scale=1.0, block=4, bf16=True)
    suffix = f"-k-bf16{'c' if bf16.bf16_c else ''}{f'c{bf16.c_rows}' if bf16.c_rows else ''}"
    assert bf16.profile_id.endswith(suffix) and "-bf16" not in fp32.profile_id
    params, tolerance = SamplingParams(temperature=0.0), 0.05
    for prompts in (PROMPTS[:1], PROMPTS):
        ref, ref_logits = _drafted_logits(fp32, monkeypatch, prompts, params)
        got, got_logits = _drafted_logits(bf16, monkeypatch, prompts, params)
        assert (got_logits[:, 0] - ref_logits[:, 0]).abs().max() > 0  # bf16 really ran (slot 0: same prefix)
        for r in range(len(prompts)):
            parted = (got.tokens[r] != ref.tokens[r]).nonzero()
            last = int(parted[0]) if parted.numel() else got.tokens.shape[1] - 1  # slots up to here: same prefix
            assert (got_logits[r, :last + 1] - ref_logits[r, :last + 1]).abs().max() < tolerance
            torch.testing.assert_close(got.confidences[r, :last + 1], ref.confidences[r, :last + 1], atol=2e-2,
                                       rtol=0)
            if parted.numel():
                top2 = ref_logits[r, last].topk(2).values
                assert float(top2[0] - top2[1]) < 2 * tolerance


def test_bf16_products_of_few_rows_take_the_bf16_c_kernel_where_there_is_one(target, monkeypatch):
    """In bf16, 1-2 rows go to the bf16 C kernel where the CPU has one (its cold-weight products were the fastest
    there: results/bf16-projections-s46), 3 and more to bf16 oneDNN; where that C kernel is the only fast bf16
    product (AVX2), up to BF16_C_ROWS rows go to it and more to the fp32 kernels (results/bf16-projections-s54);
    without it, few rows stay on the fp32 kernels, as before. All give the reference product to bf16 rounding."""
    from dspark.models import native

    if not _kernels_available(target):
        pytest.skip("no fast CPU kernel in this build")
    drafter = tiny_drafter(target, head="markov", block=4, bf16=True)
    layer = drafter.model.layers[0]
    fast = draft_kernels.attached(layer, "gate_up")
    has_c = native.kernel_bf16() is not None and target.lm_head.native
    c_only = has_c and not draft_kernels.bf16_is_fast()
    assert fast.wide.native == has_c and drafter.bf16_c == (has_c and not c_only)  # the profile's key says so
    assert fast.c_rows == drafter.c_rows == (draft_kernels.BF16_C_ROWS if c_only else None)
    calls = []
    real = native.linear
    monkeypatch.setattr(native, "linear", lambda x, w, b=None: calls.append((x.shape[0], w.dtype)) or real(x, w, b))
    counts = (1, 2, 3, 7, draft_kernels.BF16_C_ROWS, draft_kernels.BF16_C_ROWS + 1)
    for rows in counts:
        x = torch.randn(rows, target.config.hidden_size)
        with torch.inference_mode():
            got = draft_kernels.linear(layer, "gate_up", x)
        torch.testing.assert_close(got, layer.gate_up(x), atol=0.05, rtol=0.02)
    if c_only:  # the largest count on the fp32 kernels: ours up to the target's limit, else oneDNN (no call here)
        assert calls[:5] == [(n, torch.bfloat16) for n in counts[:5]]
        assert all(dtype == torch.float32 for _, dtype in calls[5:])
    elif has_c:
        assert calls == [(1, torch.bfloat16), (2, torch.bfloat16)]
    else:
        assert all(dtype == torch.float32 for _, dtype in calls)
    # where bf16 serves every row count no fp32 product (and its packed weight copy) was built; one asked for
    # (benchmarks read it) is still the module's product
    fast_linears = [f for m in drafter.model.modules() for f in m.__dict__.get("fast_linears", {}).values()]
    assert all((f._projection is None) == (has_c and not c_only) for f in fast_linears)
    x = torch.randn(2, target.config.hidden_size)
    with torch.inference_mode():
        torch.testing.assert_close(fast.projection(x), layer.gate_up(x), atol=1e-4, rtol=1e-4)


def test_bf16_is_on_by_default_only_where_a_bf16_kernel_is_fast(target):
    from dspark.drafters.dspark import DSparkDrafter

    auto = DSparkDrafter(tiny_drafter(target).model, target, bf16=None)  # AVX2's few-row bf16: opt-in only
    assert auto.bf16 == (target.lm_head.packed is not None and draft_kernels.bf16_is_fast()) and not auto.c_rows
    assert ("-bf16" in auto.profile_id) == auto.bf16


def test_the_drafter_takes_the_targets_measured_row_limit(target):
    """kernel_choice measures the C kernel's crossover on the target; the drafter's projections and head follow it
    (the same kernel as the target for the same row count), whatever limit was measured."""
    if not target.lm_head.native:
        pytest.skip("no C kernel in this build: nothing to route")
    saved = target.lm_head.native_rows
    target.lm_head.native_rows = 11
    try:
        drafter = tiny_drafter(target, head_scale=1.0, block=4)
    finally:
        target.lm_head.native_rows = saved
    limits = {fast.projection.native_rows for m in drafter.model.modules()
              for fast in m.__dict__.get("fast_linears", {}).values()}
    head = getattr(drafter.draft_logits, "projection", None)
    assert limits == {11} and (head is None or head.native_rows == 11)
