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
