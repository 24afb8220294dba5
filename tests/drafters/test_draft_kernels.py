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
