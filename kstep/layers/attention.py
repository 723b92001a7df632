"""Grouped-query attention through torch's scaled_dot_product_attention.

One module serves causal (AR) and bidirectional (diffusion) models; the caller passes the mask.
Keys/values may be written into a preallocated cache owned by the model runner.
"""
import torch
import torch.nn.functional as F
from torch import nn

from kstep.layers.rotary import apply_rotary


class Attention(nn.Module):
    def __init__(self, d_model: int, n_heads: int, n_kv_heads: int, head_dim: int,
                 qkv_bias: bool, out_bias: bool):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = n_heads, n_kv_heads, head_dim
        self.q_proj = nn.Linear(d_model, n_heads * head_dim, bias=qkv_bias)
        self.k_proj = nn.Linear(d_model, n_kv_heads * head_dim, bias=qkv_bias)
        self.v_proj = nn.Linear(d_model, n_kv_heads * head_dim, bias=qkv_bias)
        self.o_proj = nn.Linear(n_heads * head_dim, d_model, bias=out_bias)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor | None,
                is_causal: bool, cache: tuple[torch.Tensor, torch.Tensor] | None = None,
                cache_start: int = 0, cache_len: int | None = None) -> torch.Tensor:
        """x (B, T, D); mask bool (B, 1, T|1, S), True = may attend; cache (k, v) each (B, Hkv, S_max, hd).

        With a cache, this pass's keys/values are written at [cache_start, cache_start + T) and the
        queries attend to cache slots [0, cache_len) (default: up to this pass's end). Slots past the
        written window hold keys from an earlier pass (Fast-dLLM's DualCache suffix)."""
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, self.n_heads, self.head_dim).transpose(1, 2)  # (B, H, T, hd)
        k = self.k_proj(x).view(B, T, self.n_kv_heads, self.head_dim).transpose(1, 2)  # (B, Hkv, T, hd)
        v = self.v_proj(x).view(B, T, self.n_kv_heads, self.head_dim).transpose(1, 2)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        if cache is not None:
            k_cache, v_cache = cache
            end = cache_start + T
            k_cache[:, :, cache_start:end] = k
            v_cache[:, :, cache_start:end] = v
            length = end if cache_len is None else cache_len
            k, v = k_cache[:, :, :length], v_cache[:, :, :length]  # views: no copy
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=is_causal and mask is None and T == k.shape[2],
            enable_gqa=self.n_heads != self.n_kv_heads)  # (B, H, T, hd)
        return self.o_proj(out.transpose(1, 2).reshape(B, T, self.n_heads * self.head_dim))
