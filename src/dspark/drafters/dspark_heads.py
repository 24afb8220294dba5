"""Sequential heads of DSpark (Markov, RNN) and its confidence head.

The parallel backbone drafts all γ slots at once, so slot k cannot see which token was drawn at slot k−1.
A sequential head adds a cheap correction that depends on that token: a rank-r bias added to the base logits
U_k. Training teacher-forces the previous token (the ground truth y_{k−1}); inference feeds the token actually
sampled, left to right. Both paths go through the same `step` so they cannot drift apart.
"""
from __future__ import annotations

import torch
from torch import nn

from .draft_kernels import linear

HEAD_TYPES = ("markov", "rnn", "none")


class MarkovHead(nn.Module):
    """bias_k = W1[x_{k−1}] · W2: a low-rank bigram table on top of the backbone."""

    kind = "markov"

    def __init__(self, vocab_size: int, rank: int, hidden_size: int, out_size: int | None = None):
        super().__init__()
        del hidden_size  # the Markov bias ignores h_k; the signature is shared with RNNHead
        self.rank = rank
        self.w1 = nn.Embedding(vocab_size, rank)  # W1: [V, r] (the previous token may be any target token)
        self.w2 = nn.Linear(rank, out_size or vocab_size, bias=False)  # W2ᵀ: [Vd, r] (the drafter's vocabulary)
        nn.init.normal_(self.w1.weight, std=0.02)
        nn.init.normal_(self.w2.weight, std=0.02)

    def prev_embedding(self, prev: torch.Tensor) -> torch.Tensor:
        """prev: [...] token ids -> W1[prev]: [..., r] (also the confidence head's token feature)."""
        return self.w1(prev)

    def init_state(self, batch_shape: tuple[int, ...], like: torch.Tensor) -> torch.Tensor | None:
        return None  # memoryless

    def step(self, state, prev: torch.Tensor, h: torch.Tensor):
        """prev: [...]; h: [..., d] -> (state, bias [..., Vd])."""
        return state, linear(self, "w2", self.w1(prev))

    def block_bias(self, prev: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        """Teacher-forced biases of a whole block. prev: [..., γ]; h: [..., γ, d] -> [..., γ, V]."""
        return self.w2(self.w1(prev))


class RNNHead(nn.Module):
    """A gated recurrent state over the block: s_k = σ(g)⊙s_{k−1} + (1−σ(g))⊙tanh(c), bias = tanh(o)·W2.

    Unlike the Markov head, slot k sees the whole drafted prefix x_1..x_{k−1} (through s_{k−1}) and its own
    backbone state h_k. One Linear(2r + d → 3r) yields the gate g, candidate c and output o.
    """

    kind = "rnn"

    def __init__(self, vocab_size: int, rank: int, hidden_size: int, out_size: int | None = None):
        super().__init__()
        self.rank = rank
        self.w1 = nn.Embedding(vocab_size, rank)
        self.w2 = nn.Linear(rank, out_size or vocab_size, bias=False)
        self.joint = nn.Linear(2 * rank + hidden_size, 3 * rank)
        for w in (self.w1.weight, self.w2.weight, self.joint.weight):
            nn.init.normal_(w, std=0.02)
        nn.init.zeros_(self.joint.bias)

    def prev_embedding(self, prev: torch.Tensor) -> torch.Tensor:
        return self.w1(prev)

    def init_state(self, batch_shape: tuple[int, ...], like: torch.Tensor) -> torch.Tensor:
        return like.new_zeros(*batch_shape, self.rank)  # s_0 = 0

    def step(self, state: torch.Tensor, prev: torch.Tensor, h: torch.Tensor):
        """state: [..., r]; prev: [...]; h: [..., d] -> (new state [..., r], bias [..., V])."""
        z = torch.cat([state, self.w1(prev), h], dim=-1)  # [..., 2r + d]
        g, c, o = self.joint(z).chunk(3, dim=-1)
        gate = torch.sigmoid(g)
        state = gate * state + (1 - gate) * torch.tanh(c)
        return state, linear(self, "w2", torch.tanh(o))

    def block_bias(self, prev: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        state = self.init_state(prev.shape[:-1], h)
        biases = []
        for k in range(prev.shape[-1]):
            state, bias = self.step(state, prev[..., k], h[..., k, :])
            biases.append(bias)
        return torch.stack(biases, dim=-2)  # [..., γ, V]


def make_sequential_head(kind: str, vocab_size: int, rank: int, hidden_size: int,
                         out_size: int | None = None) -> nn.Module | None:
    """vocab_size: ids of previous tokens (the target's); out_size: the biased logits (the draft vocabulary)."""
    if kind not in HEAD_TYPES:
        raise ValueError(f"unknown sequential head {kind!r}; choose one of {', '.join(HEAD_TYPES)}")
    if kind == "none":
        return None
    if rank < 1:
        raise ValueError(f"a {kind} head needs rank >= 1, got {rank}")
    cls = MarkovHead if kind == "markov" else RNNHead
    return cls(vocab_size, rank, hidden_size, out_size)


class ConfidenceHead(nn.Module):
    """c_k = σ(w·[h_k ; W1[x_{k−1}]] + b): the chance that slot k survives given slots < k did.

    Returns the raw logit; calibration (per-slot temperatures) is applied outside, so one trained head can be
    re-calibrated without retraining. Its inputs exist before x_k is drawn, which keeps any truncation based on
    it non-anticipating (invariant 3).
    """

    def __init__(self, hidden_size: int, token_dim: int):
        super().__init__()
        self.token_dim = token_dim
        self.proj = nn.Linear(hidden_size + token_dim, 1)
        nn.init.normal_(self.proj.weight, std=0.02)
        nn.init.zeros_(self.proj.bias)

    def forward(self, h: torch.Tensor, prev_embedding: torch.Tensor | None) -> torch.Tensor:
        """h: [..., d]; prev_embedding: [..., r] or None -> logits [...] (fp32)."""
        x = h if prev_embedding is None else torch.cat([h, prev_embedding], dim=-1)
        return self.proj(x).squeeze(-1).float()
