"""How many masks to unmask at each step of a block.

LLaDA (arXiv:2502.09992, Eq. 8) uses a linear noise schedule, so the expected number of tokens
unmasked per step is constant: the block's masks are split evenly over its steps, the remainder
going to the earliest steps (LLaDA `generate.py`, `get_num_transfer_tokens`).
"""
import torch


def num_transfer_tokens(num_masked: torch.Tensor, steps: int) -> torch.Tensor:
    """(B,) masked counts -> (B, steps) tokens to unmask per step; each row sums to its count."""
    base = (num_masked // steps).unsqueeze(1)  # (B, 1)
    remainder = (num_masked % steps).unsqueeze(1)
    step_idx = torch.arange(steps, device=num_masked.device).unsqueeze(0)  # (1, steps)
    return base + (step_idx < remainder).long()  # (B, steps)
