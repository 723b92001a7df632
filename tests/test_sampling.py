"""Sampling, filtering, schedule and unmask selection on hand-made tensors."""
import torch

from kstep.decoding.masked_diffusion import unmask_top
from kstep.decoding.sampling import filter_logits, sample_tokens
from kstep.decoding.schedule import num_transfer_tokens


def test_schedule_matches_even_split():
    out = num_transfer_tokens(torch.tensor([8, 16, 5]), 3)
    assert out.tolist() == [[3, 3, 2], [6, 5, 5], [2, 2, 1]]
    assert out.sum(1).tolist() == [8, 16, 5]


def test_top_k_and_top_p_filters():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    assert torch.isinf(filter_logits(logits, 2, None)).tolist() == [[False, False, True, True]]
    # Nucleus 0.7: 0.5 alone is short of it, 0.5 + 0.3 reaches it.
    assert torch.isinf(filter_logits(logits, None, 0.7)).tolist() == [[False, False, True, True]]
    assert torch.isinf(filter_logits(logits, None, 0.4)).tolist() == [[False, True, True, True]]


def test_gumbel_max_samples_softmax_at_temperature():
    probs = torch.tensor([0.6, 0.3, 0.1])
    logits = probs.log().expand(20000, 3)
    gen = torch.Generator().manual_seed(0)
    counts = torch.bincount(sample_tokens(logits, 1.0, gen), minlength=3) / 20000
    torch.testing.assert_close(counts, probs, atol=0.015, rtol=0)
    # Temperature 0.5 sharpens to softmax(log p / 0.5) ∝ p².
    counts = torch.bincount(sample_tokens(logits, 0.5, gen), minlength=3) / 20000
    torch.testing.assert_close(counts, probs**2 / (probs**2).sum(), atol=0.015, rtol=0)
    assert sample_tokens(logits[:2], 0.0).tolist() == [0, 0]


def test_unmask_top_picks_most_confident_masked_per_row():
    block = torch.tensor([[9, 9, 9, 4], [9, 9, 9, 9]])  # 9 = mask
    candidates = torch.tensor([[1, 2, 3, 0], [5, 6, 7, 8]])
    confidence = torch.tensor([[0.1, 0.9, 0.5, 1.0], [0.2, 0.1, 0.4, 0.3]])
    unmask_top(block, candidates, confidence, block == 9, torch.tensor([1, 2]), 2)
    # Row 0: position 3 is not masked (confidence 1.0 ignored); best masked is 1. Row 1: positions 2, 3.
    assert block.tolist() == [[9, 2, 9, 4], [9, 9, 7, 8]]
