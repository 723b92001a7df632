"""Sampling, filtering, schedule and unmask selection on hand-made tensors."""
import torch

from kstep.decoding.masked_diffusion import fill_after_stop
from kstep.decoding.sampling import filter_logits, sample_tokens
from kstep.decoding.schedule import num_transfer_tokens
from kstep.decoding.unmask import choose_factor, choose_threshold, choose_top


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


INF = float("-inf")


def test_choose_top_picks_most_confident_per_row():
    confidence = torch.tensor([[0.1, 0.9, 0.5, INF], [0.2, 0.1, 0.4, 0.3]])  # -inf: not masked
    chosen = choose_top(confidence, torch.tensor([1, 2]), 2)
    assert chosen.tolist() == [[False, True, False, False], [False, False, True, True]]


def test_choose_threshold_takes_all_above_and_at_least_one():
    confidence = torch.tensor([[0.95, 0.2, 0.91, INF], [0.3, 0.5, 0.1, INF], [INF, INF, INF, INF]])
    chosen = choose_threshold(confidence, 0.9) & torch.isfinite(confidence)
    assert chosen.tolist() == [[True, False, True, False], [False, True, False, False], [False] * 4]


def fast_dllm_factor_count(conf: list[float], factor: float) -> int:
    """Fast-dLLM's `get_transfer_index_dynamic` loop, restated for one row of masked confidences."""
    ordered = sorted(conf, reverse=True)
    bars = [-1.0] + [1 - factor / (n + 1) for n in range(2, len(ordered) + 1)]
    top_i = 0
    for top_i in range(len(bars)):
        if ordered[top_i] < bars[top_i]:
            break
    return top_i + 1 if top_i in (0, len(bars) - 1) else top_i


def test_choose_factor_matches_fast_dllm_loop():
    gen = torch.Generator().manual_seed(0)
    for trial in range(200):
        n = int(torch.randint(1, 9, (1,), generator=gen))
        conf = torch.rand(n, generator=gen) ** 0.3  # skewed towards confident
        row = torch.cat([conf, torch.full((9 - n,), INF)])[torch.randperm(9, generator=gen)]
        factor = float(torch.rand(1, generator=gen)) * 2
        chosen = choose_factor(row[None], factor)[0] & torch.isfinite(row)
        assert int(chosen.sum()) == fast_dllm_factor_count(conf.tolist(), factor), (conf, factor)
        count = int(chosen.sum())
        assert set(torch.topk(row, count).indices.tolist()) == set(chosen.nonzero().flatten().tolist())


def test_fill_after_stop_only_when_nothing_masked_before():
    M, E = 9, 2  # mask, end-of-sequence
    canvas = torch.tensor([[5, E, M, M, 6], [5, M, E, M, M], [5, 6, 7, M, M]])
    fill_after_stop(canvas, torch.tensor([E]), M)
    assert canvas.tolist() == [[5, E, E, E, 6], [5, M, E, M, M], [5, 6, 7, M, M]]


def test_quality_metrics_on_hand_made_completions():
    from kstep.eval.metrics import distinct_ratio, parses
    prompt = 'def f(x):\n    """Double x."""\n'
    assert parses(prompt, "    y = x * 2\n    return y\n")
    assert parses(prompt, "    return x * 2\n    if x")  # the partial last line is dropped
    assert not parses(prompt, "    return (x *\n    ]\n")
    assert not parses(prompt, "")  # no code at all is a failure, though a docstring alone is valid Python
    assert not parses(prompt, "\n\n")
    assert distinct_ratio([1, 1, 1, 1]) == 0.25 and distinct_ratio([1, 2, 3]) == 1.0
