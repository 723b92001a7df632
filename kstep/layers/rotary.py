"""Rotary position embeddings (RoFormer, arXiv:2104.09864) in the half-split layout LLaMA and LLaDA use.

Owns the cos/sin tables (float32, computed once per device); positions are explicit per row so that
left-padded rows see the same positions as when they run alone.
"""
import math

import torch
from torch import nn


def rope_inv_freq(head_dim: int, theta: float, scaling: dict | None) -> torch.Tensor:
    """Inverse frequencies, with the optional `llama3` / `linear` scaling of the HF configs."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    if not scaling:
        return inv_freq
    kind = scaling["rope_type"]
    if kind == "linear":
        return inv_freq / scaling["factor"]
    if kind == "llama3":
        # Meta's Llama 3.1 recipe: leave high frequencies, divide low ones by `factor`, blend in between.
        factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
        old_len = scaling["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv_freq
        smooth = (old_len / wavelen - low) / (high - low)
        blended = (1 - smooth) * inv_freq / factor + smooth * inv_freq
        out = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        is_mid = (wavelen <= old_len / low) & (wavelen >= old_len / high)
        return torch.where(is_mid, blended, out)
    raise ValueError(f"unsupported rope scaling type {kind!r} (supported: linear, llama3)")


class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, max_positions: int, theta: float, scaling: dict | None = None):
        super().__init__()
        inv_freq = rope_inv_freq(head_dim, theta, scaling)
        freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq)
        angles = torch.cat([freqs, freqs], dim=-1)  # (P, hd)
        self.register_buffer("cos", angles.cos(), persistent=False)
        self.register_buffer("sin", angles.sin(), persistent=False)

    def tables(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin for positions of any shape (...,) -> (..., hd).

        Positions are not range-checked here (that would sync the device every pass): callers
        check prompt + max_tokens against the context before generating."""
        return self.cos[positions], self.sin[positions]


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate (..., hd) in float32 (LLaDA's rope_full_precision), return in x's dtype. Tables
    narrower than hd (partial rotary, LLaDA2) rotate the first dims, half-split within them; the
    rest pass through."""
    width = cos.shape[-1]
    if width < x.shape[-1]:
        return torch.cat([apply_rotary(x[..., :width], cos, sin), x[..., width:]], dim=-1)
    x32 = x.float()
    half = x32.shape[-1] // 2
    rotated = torch.cat([-x32[..., half:], x32[..., :half]], dim=-1)
    return (x32 * cos + rotated * sin).to(x.dtype)
