"""Cache-less whole sequences (training features) attend as one padded batch: the same hidden states and logits
as the per-sequence path with caches, in every family (sliding windows, soft-capping, GQA)."""
import pytest
import torch

from dspark.models.transformer import Segment
from helpers import TINY, hf_model, ours_from_hf


@pytest.mark.parametrize("kind", sorted(TINY))
def test_cacheless_batch_equals_per_sequence_forward(kind):
    model = ours_from_hf(hf_model(kind))
    g = torch.Generator().manual_seed(1)
    seqs = [torch.randint(0, 96, (n,), generator=g) for n in (13, 1, 40, 7)]  # windows of 5-6 tokens bite
    tokens = torch.cat(seqs)
    layers = tuple(range(model.config.num_layers))
    ref = model.forward(tokens, [Segment(model.new_cache(64), 0, len(s)) for s in seqs], hidden_layers=layers)
    dense = model.forward(tokens, [Segment(None, 0, len(s)) for s in seqs], hidden_layers=layers)
    for i in layers:
        assert torch.allclose(dense.hidden[i], ref.hidden[i], atol=1e-5, rtol=1e-5), (kind, i)
    assert torch.allclose(dense.logits, ref.logits, atol=1e-4, rtol=1e-5)


def test_cacheless_segments_must_be_whole_sequences_alone():
    model = ours_from_hf(hf_model("llama"))
    with pytest.raises(ValueError, match="whole sequences"):
        model.forward(torch.zeros(5, dtype=torch.long), [Segment(None, 2, 5)])
    with pytest.raises(ValueError, match="whole sequences"):
        model.forward(torch.zeros(6, dtype=torch.long), [Segment(None, 0, 3), Segment(model.new_cache(8), 0, 3)])
