"""Unmask rules: the confidence score that decides which masked positions are unmasked first.

`low_confidence` and `random` are LLaDA's remasking strategies (`generate.py`); `margin` and
`entropy` are Dream's `topk_margin` and `entropy` algorithms (top-1 minus top-2 probability,
negative entropy). Higher confidence is unmasked first.
"""
from collections.abc import Callable

import torch

ConfidenceRule = Callable[[torch.Tensor, torch.Tensor, torch.Generator | None], torch.Tensor]


def low_confidence(logits, candidates, generator):
    probs = logits.float().softmax(-1)  # (B, T, V)
    return probs.gather(-1, candidates.unsqueeze(-1)).squeeze(-1)  # (B, T)


def random_confidence(logits, candidates, generator):
    return torch.rand(candidates.shape, generator=generator, device=candidates.device)


def margin(logits, candidates, generator):
    top2 = logits.float().softmax(-1).topk(2, dim=-1).values  # (B, T, 2)
    return top2[..., 0] - top2[..., 1]


def entropy(logits, candidates, generator):
    logp = logits.float().log_softmax(-1)
    return (logp.exp() * logp).sum(-1)  # negative entropy, (B, T)


UNMASK_RULES: dict[str, ConfidenceRule] = {
    "low_confidence": low_confidence, "random": random_confidence, "margin": margin, "entropy": entropy,
}


def confidence_rule(name: str) -> ConfidenceRule:
    if name not in UNMASK_RULES:
        raise ValueError(f"remasking {name!r} is not a known unmask rule (choose from {', '.join(UNMASK_RULES)})")
    return UNMASK_RULES[name]


# --- How many to unmask: the unmask policies ------------------------------------------------------
# Each returns a (B, T) bool choice among the masked positions of the block, given their confidence
# (-inf where not masked). All are batched: no per-row loop, no host sync.

def choose_top(confidence: torch.Tensor, num_unmask: torch.Tensor, max_unmask: int) -> torch.Tensor:
    """The `num_unmask[b]` most confident positions of each row (torch.topk order, as the references)."""
    top = confidence.topk(min(max_unmask, confidence.shape[-1]), dim=-1).indices  # (B, k)
    keep = torch.arange(top.shape[-1], device=confidence.device) < num_unmask.unsqueeze(1)  # (B, k)
    return torch.zeros_like(confidence, dtype=torch.bool).scatter_(-1, top, keep)


def choose_threshold(confidence: torch.Tensor, threshold: float) -> torch.Tensor:
    """Fast-dLLM's threshold rule: every masked position with confidence >= threshold, and always the
    single most confident one (so each pass unmasks at least one token)."""
    best = torch.zeros_like(confidence, dtype=torch.bool).scatter_(-1, confidence.argmax(-1, keepdim=True), True)
    return (confidence >= threshold) | best


def choose_factor(confidence: torch.Tensor, factor: float) -> torch.Tensor:
    """Fast-dLLM's factor rule (`get_transfer_index_dynamic`): sort the masked confidences; the n-th
    (1-based) passes if it is >= 1 - factor / (n + 1), the first always passes; unmask the run before
    the first failure. Quirk kept for parity: a failure at the last masked position unmasks all."""
    num_masked = torch.isfinite(confidence).sum(-1, keepdim=True)  # (B, 1)
    ordered = confidence.sort(dim=-1, descending=True).values  # (B, T)
    n = torch.arange(1, confidence.shape[-1] + 1, device=confidence.device)
    bar = (1 - factor / (n + 1)).to(ordered.dtype)
    bar[0] = float("-inf")
    fails = (ordered < bar) & (n <= num_masked)  # (B, T)
    first_fail = torch.where(fails.any(-1, keepdim=True), fails.float().argmax(-1, keepdim=True), num_masked)
    count = torch.where(first_fail >= num_masked - 1, num_masked, first_fail).squeeze(-1)  # (B,)
    return choose_top(confidence, count, confidence.shape[-1])
