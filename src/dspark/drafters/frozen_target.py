"""What a drafter shares with its target without training or saving it: embedding, LM head, rotary table.

Both network families (DSpark/DFlash in dspark_model.py, Eagle3 in eagle3_model.py) mix in DraftVocabMixin,
so the LM-head path, and the optional draft vocabulary, exist once.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from ..decoding.verify import DraftVocab
from ..models.layers import RotaryTable


@dataclass
class FrozenTarget:
    """The target tensors the drafter shares but never trains or saves: embedding, LM head, rotary table."""

    embed: torch.Tensor  # [V, d]
    lm_head: torch.Tensor  # [V, d]
    embed_scale: float | None
    softcap: float | None
    rope: RotaryTable = field(repr=False)
    head_dtype: torch.dtype | None = None  # training: run the head products in this precision
    # built on first use (DraftVocabMixin.draft_rows / full_rows; None: not yet): only training and the reference
    # path read them, and for a bf16 target they are fp32 copies (144 MiB for SmolLM2) that inference never reads
    draft_head: torch.Tensor | None = field(default=None, repr=False)  # [Vd, d] the drafter's rows of lm_head
    full_head: torch.Tensor | None = field(default=None, repr=False)  # [V, d] lm_head in head_dtype


class DraftVocabMixin:
    """The frozen-target parts shared by DSpark/DFlash and Eagle3 networks: rotary lookups, the block embedding,
    and the LM head, optionally restricted to a draft vocabulary.

    A draft vocabulary (as in EAGLE-3) is a fixed subset of Vd target tokens: the drafter's logits cover only
    those rows of the target's LM head, which divides the dominant cost of drafting and of training by V/Vd.
    It is lossless: the draft distribution handed to verification is the subset's distribution scattered into
    the full vocabulary with zeros elsewhere, and rejection sampling never needs q > 0 where p > 0 (the residual
    max(0, p − q) covers the tokens the drafter cannot propose). The ids live in the buffer `vocab_ids`
    (saved with the weights); the head rows are gathered from the target at load time, never stored.
    """

    vocab_ids: torch.Tensor | None
    frozen: FrozenTarget

    def _init_draft_vocab(self, arch, vocab_size: int) -> None:
        if arch.draft_vocab and not 1 < arch.draft_vocab < vocab_size:
            raise ValueError(f"draft_vocab must be 0 (the whole vocabulary) or between 2 and {vocab_size - 1}, "
                             f"got {arch.draft_vocab}")
        ids = torch.arange(arch.draft_vocab, dtype=torch.long) if arch.draft_vocab else None
        self.register_buffer("vocab_ids", ids)
        # After load_state_dict replaces the ids, the gathered head rows must follow them.
        self.register_load_state_dict_post_hook(lambda module, _keys: module._refresh_heads())
        self._refresh_heads()

    @property
    def draft_vocab_size(self) -> int:
        return self.frozen.lm_head.shape[0] if self.vocab_ids is None else self.vocab_ids.numel()

    def set_draft_vocab(self, ids: torch.Tensor) -> None:
        """ids: [Vd] distinct target token ids (any order; stored sorted)."""
        ids = torch.as_tensor(ids, dtype=torch.long).flatten().sort().values
        V = self.frozen.lm_head.shape[0]
        if self.vocab_ids is None or ids.numel() != self.vocab_ids.numel():
            raise ValueError(f"this drafter's architecture has draft_vocab={self.arch.draft_vocab}; "
                             f"got {ids.numel()} ids")
        if ids.unique().numel() != ids.numel() or int(ids[0]) < 0 or int(ids[-1]) >= V:
            raise ValueError(f"draft vocabulary ids must be distinct and in [0, {V})")
        with torch.no_grad():
            self.vocab_ids.copy_(ids.to(self.vocab_ids.device))
        self._refresh_heads()

    def to_local(self, tokens: torch.Tensor) -> torch.Tensor:
        """Target token ids -> positions in the draft vocabulary (−1: not in it). Identity without one."""
        if self.vocab_ids is None:
            return tokens
        pos = torch.searchsorted(self.vocab_ids, tokens.clamp_min(0))
        pos = pos.clamp_max(self.vocab_ids.numel() - 1)
        return torch.where(self.vocab_ids[pos] == tokens, pos, torch.full_like(pos, -1))

    def to_full(self, local: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary positions -> target token ids."""
        return local if self.vocab_ids is None else self.vocab_ids[local]

    def draft_vocab(self) -> DraftVocab | None:
        """The draft vocabulary as verification reads it (None: the whole vocabulary), built once per set of ids."""
        if self.vocab_ids is None:
            return None
        key = (self.vocab_ids.data_ptr(), self.vocab_ids._version)
        cached = self.__dict__.get("_draft_vocab")
        if cached is None or cached[0] != key:
            cached = (key, DraftVocab.of(self.vocab_ids.cpu(), self.frozen.lm_head.shape[0]))
            self.__dict__["_draft_vocab"] = cached  # a plain attribute: not a parameter, buffer or state
        return cached[1]

    def scatter_probs(self, probs: torch.Tensor) -> torch.Tensor:
        """[..., Vd] -> [..., V] with zeros outside the draft vocabulary."""
        if self.vocab_ids is None:
            return probs
        out = probs.new_zeros(*probs.shape[:-1], self.frozen.lm_head.shape[0])
        # index_copy_ rather than out[..., ids] = probs (index_put): 121 -> 70 µs for one request's 7 slots
        # (scripts/greedy_draw_cost.py)
        return out.index_copy_(-1, self.vocab_ids.to(out.device), probs)

    def _refresh_heads(self) -> None:
        """Forget the head copies: the next draft_rows / full_rows builds them from the current ids and dtype."""
        self.frozen.draft_head = self.frozen.full_head = None

    def draft_rows(self) -> torch.Tensor:
        """[Vd, d]: the drafter's rows of the target's LM head in the head dtype (fp32 unless set_head_dtype)."""
        f = self.frozen
        if f.draft_head is None:
            f.draft_head = _head_copy(f.lm_head, self.vocab_ids, f.head_dtype)
        return f.draft_head

    def full_rows(self) -> torch.Tensor:
        """[V, d]: the target's whole LM head in the head dtype (training targets)."""
        f = self.frozen
        if f.full_head is None:
            f.full_head = _head_copy(f.lm_head, None, f.head_dtype)
        return f.full_head

    def set_head_dtype(self, dtype: torch.dtype) -> None:
        """Run the frozen LM-head products in `dtype` (training: bf16 halves the dominant cost on CPU; the
        logits and everything after them stay fp32)."""
        self.frozen.head_dtype = None if dtype == torch.float32 else dtype
        self._refresh_heads()

    def base_logits(self, h: torch.Tensor, full: bool = False) -> torch.Tensor:
        """h: [..., d] -> U: [..., Vd] fp32 through the drafter's rows of the frozen target LM head (softcap
        included); full=True: all V rows (the target's own distribution, for training targets)."""
        head = self.full_rows() if full else self.draft_rows()
        logits = F.linear(h.to(head.dtype), head).float()
        cap = self.frozen.softcap
        return torch.tanh(logits / cap) * cap if cap else logits

    def rope(self, positions: torch.Tensor):
        """positions: [N] -> (cos, sin) [N, 1, hd] in fp32."""
        top = int(positions.max()) if positions.numel() else 0
        return self.frozen.rope.lookup(positions, top)

    def embed_block(self, block_ids: torch.Tensor) -> torch.Tensor:
        x = F.embedding(block_ids, self.frozen.embed).to(self.fuse.weight.dtype)
        return x * self.frozen.embed_scale if self.frozen.embed_scale is not None else x


def _head_copy(lm_head: torch.Tensor, ids: torch.Tensor | None, dtype: torch.dtype | None) -> torch.Tensor:
    """lm_head's rows `ids` (None: all) in `dtype` (None: fp32). Made outside inference mode even when first asked
    for inside it: training may later read the copy with autograd on."""
    with torch.inference_mode(False), torch.no_grad():
        rows = lm_head if ids is None else lm_head[ids.to(lm_head.device)]
        return rows.to(dtype or torch.float32)


def inference_head(model: DraftVocabMixin, target, bf16: bool = False, c_rows: int | None = None):
    """The drafter's LM head for inference: h [..., d] -> fp32 logits [..., Vd]. Without a draft vocabulary it is
    the target's own head; with one, the draft rows through the same kernel as the target's head (pre-packed
    oneDNN on CPU: plain fp32 `linear` on a few rows is 2-3x slower there, see models/layers.py).
    `bf16`: a bf16 copy of those rows with bf16 activations (fp32 accumulation) at every row count: the head is
    bound by reading its weights, which takes half the time in bf16 (scripts/bf16_projection_cost.py); with
    `c_rows` (AVX2, draft_kernels.bf16_c_rows) only up to c_rows rows, by the bf16 C kernel, above as without."""
    from ..models.layers import Projection
    from .draft_kernels import bf16_projection

    cap = target.config.final_logit_softcap
    rows = target.lm_head.weight  # in the target's dtype: the head's products run there
    if model.vocab_ids is not None:
        rows = rows[model.vocab_ids.to(target.device)]  # [Vd, d]
    few = bf16_projection(rows, c_rows=c_rows) if bf16 and c_rows else None  # [<= c_rows, d] -> [.., Vd] bf16
    if bf16 and not c_rows:
        head, dtype = bf16_projection(rows), torch.bfloat16
    elif model.vocab_ids is None:
        head, dtype = None, target.dtype  # the target's head, softcap included
    else:
        head = Projection(rows.contiguous(), packed=target.lm_head.packed is not None, native=target.lm_head.native)
        head.native_rows = target.lm_head.native_rows  # the same kernel as the target's head for the same rows
        head.pad_to = dict(target.lm_head.pad_to)
        dtype = target.dtype

    def logits(h: torch.Tensor) -> torch.Tensor:
        flat = h.reshape(-1, h.shape[-1])
        if few is not None and flat.shape[0] <= c_rows:
            out = few(flat.to(torch.bfloat16)).float()
        elif head is None:
            return target.lm_logits(flat.to(dtype)).view(*h.shape[:-1], -1)
        else:
            out = head(flat.to(dtype)).float()
        out = out.view(*h.shape[:-1], -1)
        return torch.tanh(out / cap) * cap if cap else out

    logits.projection = head if few is None else few  # for benchmarks that switch its kernel (propose_cost.py)
    return logits
