"""Losses on hand-computed cases: weights, TV, soft confidence labels, valid-prefix masking, α."""
import math

import torch
import torch.nn.functional as F

from dspark.training.losses import block_terms, combine, slot_weights, tau_estimate


class LogitModel:
    """A stand-in drafter whose 'hidden state' IS its logits (identity LM head), with a fixed confidence."""

    head = None

    def __init__(self, conf_logit=None, vocab_ids=None):
        self.conf_logit, self.vocab_ids = conf_logit, vocab_ids

    def base_logits(self, h, full=False):
        return h.float()

    def to_local(self, tokens):
        if self.vocab_ids is None:
            return tokens
        table = torch.full((int(self.vocab_ids.max()) + 2,), -1)
        table[self.vocab_ids] = torch.arange(len(self.vocab_ids))
        return table[tokens.clamp_max(len(table) - 1)]

    def confidence_logits(self, h, prev):
        return None if self.conf_logit is None else torch.full(h.shape[:-1], self.conf_logit)


def test_slot_weights():
    torch.testing.assert_close(slot_weights(3, 4.0), torch.tensor([1.0, math.exp(-0.25), math.exp(-0.5)]))


def test_hand_case():
    # slot 1: q = (1/2, 1/2), p = (3/4, 1/4), label 0; slot 2: q = p; slot 3 invalid (masked out entirely).
    h = torch.tensor([[[0.0, 0.0], [1.0, 2.0], [5.0, -5.0]]])
    th = torch.tensor([[[math.log(3.0), 0.0], [1.0, 2.0], [-9.0, 9.0]]])
    labels = torch.tensor([[0, 1, 0]])
    valid = torch.tensor([[True, True, False]])
    w = slot_weights(3, 4.0)
    t = block_terms(LogitModel(conf_logit=0.3), h, torch.zeros(1, 3, dtype=torch.long), labels, valid, th, w)
    log_q2 = F.log_softmax(torch.tensor([1.0, 2.0]), -1)[1]
    assert math.isclose(float(t["ce"]), math.log(2) - float(w[1]) * float(log_q2), rel_tol=1e-6)
    assert math.isclose(float(t["tv"]), 0.5, rel_tol=1e-6)  # ‖q−p‖₁ = 0.5 on slot 1, 0 on slot 2
    bce = lambda label: float(F.binary_cross_entropy_with_logits(torch.tensor(0.3), torch.tensor(label)))  # noqa
    assert math.isclose(float(t["conf"]), bce(0.75) + float(w[1]) * bce(1.0), rel_tol=1e-6)  # soft labels
    assert math.isclose(t["den"], 1 + float(w[1]), rel_tol=1e-6)
    assert t["accept"].tolist() == [0.75, 1.0, 0.0] and t["count"].tolist() == [1, 1, 0]
    loss = combine(t, t["den"], (0.1, 0.9, 1.0))
    expected = (0.1 * float(t["ce"]) + 0.9 * 0.5 + float(t["conf"])) / t["den"]
    assert math.isclose(float(loss), expected, rel_tol=1e-6)


def test_soft_cross_entropy_term():
    # q = (1/2, 1/2), p = (3/4, 1/4): −Σ p log q = log 2, whatever the label; weighted by w_k like the others.
    h = torch.tensor([[[0.0, 0.0], [0.0, 0.0]]], requires_grad=True)
    th = torch.tensor([[[math.log(3.0), 0.0], [math.log(3.0), 0.0]]])
    w = slot_weights(2, 4.0)
    t = block_terms(LogitModel(), h, torch.zeros(1, 2, dtype=torch.long), torch.tensor([[1, 1]]),
                    torch.tensor([[True, True]]), th, w)
    assert math.isclose(float(t["soft"].detach()), math.log(2) * (1 + float(w[1])), rel_tol=1e-6)
    base = combine(t, t["den"], (0.1, 0.9, 1.0))
    assert float(combine(t, t["den"], (0.1, 0.9, 1.0, 0.0)).detach()) == float(base.detach())
    loss = combine(t, t["den"], (0.0, 0.0, 0.0, 1.0))
    assert math.isclose(float(loss.detach()), math.log(2), rel_tol=1e-6)
    loss.backward()  # ∂/∂logit = q − p = (−1/4, +1/4) per slot, scaled by w_k / Σ w
    expected = torch.tensor([-0.25, 0.25]) * (w / w.sum()).unsqueeze(-1)
    torch.testing.assert_close(h.grad[0], expected)


def test_hand_case_with_a_draft_vocabulary():
    # V = 3, the drafter covers tokens {0, 2}: q = (1/2, 1/2) there; p = (1/2, 1/4, 1/4) over all three.
    # ‖q − p‖₁ = 0 + 1/4 (token 1, which the drafter cannot propose) + 1/4 = 1/2; label 1 has no CE term.
    model = LogitModel(vocab_ids=torch.tensor([0, 2]))
    h = torch.zeros(1, 1, 2)
    th = torch.log(torch.tensor([[[0.5, 0.25, 0.25]]]))
    t = block_terms(model, h, torch.zeros(1, 1, dtype=torch.long), torch.tensor([[1]]),
                    torch.tensor([[True]]), th, slot_weights(1, 4.0))
    assert math.isclose(float(t["tv"]), 0.5, rel_tol=1e-6) and t["accept"].tolist() == [0.75]
    assert float(t["ce"]) == 0.0 and t["top1"] == 0.0
    t = block_terms(model, h, torch.zeros(1, 1, dtype=torch.long), torch.tensor([[2]]),
                    torch.tensor([[True]]), th, slot_weights(1, 4.0))
    assert math.isclose(float(t["ce"]), math.log(2), rel_tol=1e-6)  # token 2 is draft position 1


def test_gradient_flows_only_through_the_draft():
    h = torch.randn(2, 3, 5, requires_grad=True)
    th = torch.randn(2, 3, 5)
    t = block_terms(LogitModel(0.0), h, torch.zeros(2, 3, dtype=torch.long), torch.zeros(2, 3, dtype=torch.long),
                    torch.ones(2, 3, dtype=torch.bool), th, slot_weights(3, 4.0))
    combine(t, t["den"], (0.1, 0.9, 1.0)).backward()
    assert h.grad is not None and torch.isfinite(h.grad).all()


def test_tau_estimate():
    assert math.isclose(tau_estimate(torch.tensor([1.0, 0.5]), torch.tensor([2.0, 1.0])), 1 + 0.5 + 0.25)
