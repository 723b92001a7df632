"""Rotary position embeddings (RoFormer, arXiv:2104.09864) in the half-split layout LLaMA and LLaDA use.

Owns the cos/sin tables (float32, computed once per device); positions are explicit per row so that
left-padded rows see the same positions as when they run alone. Also the position-dependent query
scale of Llama 4 / Ministral 3 (`llama_4_scaling_beta` in the rope parameters), which only the
positions decide.
"""
import math

import torch
from torch import nn


def rope_inv_freq(head_dim: int, theta: float, scaling: dict | None) -> torch.Tensor:
    """Inverse frequencies, with the optional `llama3` / `linear` / `yarn` scaling of the HF configs."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    if not scaling:
        return inv_freq
    kind = scaling["rope_type"]
    if kind == "yarn":
        return yarn_inv_freq(head_dim, theta, scaling)
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
    raise ValueError(f"unsupported rope scaling type {kind!r} (supported: linear, llama3, yarn)")


def yarn_inv_freq(head_dim: int, theta: float, scaling: dict) -> torch.Tensor:
    """YaRN (arXiv:2309.00071) as transformers' `_compute_yarn_parameters`: the dims that turn fewer
    than `beta_slow` times over the original context are interpolated (divided by `factor`), those
    that turn more than `beta_fast` times kept, a linear ramp between (bounds floored/ceiled unless
    `truncate` is false)."""
    factor, old_len = scaling["factor"], scaling["original_max_position_embeddings"]
    beta_fast, beta_slow = scaling.get("beta_fast") or 32, scaling.get("beta_slow") or 1

    def dim_of(rotations: float) -> float:  # the dim that turns `rotations` times over old_len
        return head_dim * math.log(old_len / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = dim_of(beta_fast), dim_of(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001  # no zero-width ramp
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp  # 1: extrapolate (keep the frequency), 0: interpolate
    pos_freqs = theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)  # as transformers: same bits
    return 1.0 / (factor * pos_freqs) * (1 - keep) + 1.0 / pos_freqs * keep


def rope_attention_factor(scaling: dict | None) -> float:
    """YaRN's scale on cos and sin (`attention_factor`, else from `mscale` / `mscale_all_dim` and
    `factor` as transformers infers it); 1 for the other kinds."""
    if not scaling or scaling["rope_type"] != "yarn":
        return 1.0
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    factor, m, m_all = scaling["factor"], scaling.get("mscale"), scaling.get("mscale_all_dim")
    return mscale(factor, m) / mscale(factor, m_all) if m and m_all else mscale(factor)


class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, max_positions: int, theta: float, scaling: dict | None = None):
        super().__init__()
        if torch.empty(0).is_meta:
            # Built on the meta device before loading (weights.build_model), whose reset_rotary makes
            # the real tables: arange's meta kernel alone costs 0.4-1.9 s of start-up (torch._refs).
            width = 2 * len(range(0, head_dim, 2))
            self.register_buffer("cos", torch.empty(max_positions, width), persistent=False)
            self.register_buffer("sin", torch.empty(max_positions, width), persistent=False)
        else:
            inv_freq = rope_inv_freq(head_dim, theta, scaling)
            freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq)
            angles = torch.cat([freqs, freqs], dim=-1)  # (P, hd)
            factor = rope_attention_factor(scaling)
            self.register_buffer("cos", angles.cos() * factor, persistent=False)
            self.register_buffer("sin", angles.sin() * factor, persistent=False)
        # Llama 4 / Ministral 3: queries times 1 + beta log(1 + floor(position / original context)).
        beta = (scaling or {}).get("llama_4_scaling_beta")
        self.query_beta = None if beta is None else (float(beta), scaling["original_max_position_embeddings"])

    def tables(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin for positions of any shape (...,) -> (..., hd).

        Positions are not range-checked here (that would sync the device every pass): callers
        check prompt + max_tokens against the context before generating."""
        return self.cos[positions], self.sin[positions]

    def query_scales(self, positions: torch.Tensor) -> torch.Tensor | None:
        """(...,) positions -> (...,) float32 factors on the queries after rotary, as Ministral 3's
        `get_llama_4_attn_scale` (exactly 1 below the original context); None without that scaling."""
        if self.query_beta is None:
            return None
        beta, old_len = self.query_beta
        return 1 + beta * torch.log(1 + torch.floor(positions / old_len))


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
