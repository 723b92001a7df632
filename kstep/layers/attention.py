"""Grouped-query attention through torch's scaled_dot_product_attention, over packed sequences.

One module serves causal (AR) and bidirectional (diffusion) models; the caller passes the masks.
A forward pass may pack several sequences (the engine's continuous batch): the projections run
once on all their tokens, the attention runs per sequence (`Segment`), each against its own
preallocated KV cache owned by the model runner.
"""
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from kstep.layers.labels import labelled
from kstep.layers.linear import inference_layout, linear
from kstep.layers.norm import RMSNorm
from kstep.layers.paged_kv import PagedKV
from kstep.layers.rotary import apply_rotary

KVCache = PagedKV  # a cache in the model's KV pool (runner/kv_pool.py), read and written through page tables


@dataclass(slots=True)
class Segment:
    """One sequence's share of a packed pass: `batch` rows of `length` tokens, contiguous from
    `offset` in the packed tokens.

    mask: bool (batch, 1, length|1, S), True = may attend, or None. With a cache, this pass's
    keys/values are written at [cache_start, cache_start + length) and the queries attend to cache
    slots [0, cache_len) (default: up to this pass's end); slots past the written window hold keys
    from an earlier pass (Fast-dLLM's DualCache suffix). With `cache_slots` (batch, length), each
    row writes at its own slots instead (rows of different lengths: speculative decoding)."""
    offset: int
    batch: int
    length: int
    mask: torch.Tensor | None = None
    cache: KVCache | None = None
    cache_start: int = 0
    cache_len: int | None = None
    cache_slots: torch.Tensor | None = None

    @property
    def rows(self) -> slice:
        return slice(self.offset, self.offset + self.batch * self.length)


def joined_rows(weights: list[torch.Tensor]) -> torch.Tensor:
    """torch.cat(weights), without the copy where they already lie one after another in one tensor
    (as `weights.allocate` lays out a `fuse_groups` group: the checkpoint is then read straight into
    the fused layout, and fusing costs nothing at start-up)."""
    first = weights[0]
    at = first.storage_offset()
    for w in weights:
        if not w.is_contiguous() or w.untyped_storage().data_ptr() != first.untyped_storage().data_ptr() \
                or w.storage_offset() != at or w.shape[1:] != first.shape[1:]:
            return torch.cat(weights)
        at += w.numel()
    rows = sum(w.shape[0] for w in weights)
    return first.as_strided((rows, *first.shape[1:]), first.stride())


def fuse_linears(*linears: nn.Linear) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """One (sum of outputs, in) weight for the linears, and its bias: their parameters become views
    of it (no extra memory), so one matmul computes all of them (fewer, larger matmuls: the per-call
    overhead dominates small models' decode steps). `project` applies it through `linear`, stored
    in the layout its kernel wants (kstep/layers/linear.py). None when a layer is not a plain
    nn.Linear (e.g. quantized)."""
    if not all(type(m) is nn.Linear for m in linears):
        return None
    weight = inference_layout(joined_rows([m.weight.data for m in linears]))  # (out, in), stored as linear() wants
    bias = None if linears[0].bias is None else torch.cat([m.bias.data for m in linears])
    offset = 0
    for m in linears:
        rows = slice(offset, offset + m.out_features)
        m.weight.data = weight[rows]
        if bias is not None:
            m.bias.data = bias[rows]
        offset += m.out_features
    return weight, bias


def project(x: torch.Tensor, fused: tuple[torch.Tensor, torch.Tensor | None]) -> torch.Tensor:
    """x (..., in) through a `fuse_linears` weight -> (..., out)."""
    weight, bias = fused
    return linear(x, weight, bias)


class Attention(nn.Module):
    def __init__(self, d_model: int, n_heads: int, n_kv_heads: int, head_dim: int,
                 qkv_bias: bool, out_bias: bool, qk_norm_eps: float | None = None):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = n_heads, n_kv_heads, head_dim
        # Qwen3 / SDAR: RMSNorm over each head's query and key vector, before rotary.
        self.q_norm = None if qk_norm_eps is None else RMSNorm(head_dim, qk_norm_eps)
        self.k_norm = None if qk_norm_eps is None else RMSNorm(head_dim, qk_norm_eps)
        self.q_proj = nn.Linear(d_model, n_heads * head_dim, bias=qkv_bias)
        self.k_proj = nn.Linear(d_model, n_kv_heads * head_dim, bias=qkv_bias)
        self.v_proj = nn.Linear(d_model, n_kv_heads * head_dim, bias=qkv_bias)
        self.o_proj = nn.Linear(n_heads * head_dim, d_model, bias=out_bias)
        self.fused: tuple[torch.Tensor, torch.Tensor | None] | None = None
        self.fused_out: tuple[torch.Tensor, torch.Tensor | None] | None = None
        self.fuse_groups = (("q_proj", "k_proj", "v_proj"),)  # weights.allocate lays these out as `fuse` joins them
        self.reduce: Callable[[torch.Tensor], torch.Tensor] | None = None  # tensor parallel: sum the ranks' heads

    def fuse(self) -> None:
        """For inference: keep q/k/v's weights as slices of one tensor, so one matmul computes all
        three (fewer, larger matmuls: the per-call overhead dominates small models' decode steps).
        The parameters stay separate (loading, saving and training see no difference)."""
        self.fused = fuse_linears(self.q_proj, self.k_proj, self.v_proj)
        self.fused_out = fuse_linears(self.o_proj)

    def _heads(self, x: torch.Tensor, seg: Segment) -> torch.Tensor:
        """(N, h, hd) packed rows -> this segment's (b, h, T, hd)."""
        return x[seg.rows].view(seg.batch, seg.length, x.shape[1], self.head_dim).transpose(1, 2)

    def _attend(self, q, k, v, seg: Segment, layer_idx: int, is_causal: bool) -> torch.Tensor:
        q, k, v = self._heads(q, seg), self._heads(k, seg), self._heads(v, seg)  # (b, H|Hkv, T, hd)
        if seg.cache is not None:
            end = seg.cache_start + seg.length
            if seg.cache_slots is not None:
                seg.cache.write_at(layer_idx, k, v, seg.cache_slots)
            else:
                seg.cache.write(layer_idx, k, v, seg.cache_start)
            k, v = seg.cache.read(layer_idx, 0, end if seg.cache_len is None else seg.cache_len)
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=seg.mask, is_causal=is_causal and seg.mask is None and seg.length == k.shape[2],
            enable_gqa=self.n_heads != self.n_kv_heads)  # (b, H, T, hd)
        return out.transpose(1, 2).reshape(seg.batch * seg.length, self.n_heads * self.head_dim)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, segments: list[Segment],
                layer_idx: int, is_causal: bool, q_scale: torch.Tensor | None = None) -> torch.Tensor:
        """x (N, D) packed tokens; cos, sin (N, hd) at their positions -> (N, D). `q_scale` (N,): a
        factor on each token's queries after rotary (Llama 4 / Ministral 3's position scaling)."""
        N, H, Hkv, hd = x.shape[0], self.n_heads, self.n_kv_heads, self.head_dim
        cos, sin = cos[:, None], sin[:, None]  # (N, 1, hd): broadcast over heads
        # Projections and rotary run once over every sequence's tokens; only attention is per sequence.
        if self.fused is not None and not torch.is_grad_enabled():
            qkv = project(x, self.fused).view(N, H + 2 * Hkv, hd)
            if self.q_norm is None:
                qk = apply_rotary(qkv[:, :H + Hkv], cos, sin)  # (N, H + Hkv, hd)
                q, k = qk[:, :H], qk[:, H:]
            else:
                q = apply_rotary(self.q_norm(qkv[:, :H]), cos, sin)
                k = apply_rotary(self.k_norm(qkv[:, H:H + Hkv]), cos, sin)
            v = qkv[:, H + Hkv:]
        else:
            q, k = self.q_proj(x).view(N, H, hd), self.k_proj(x).view(N, Hkv, hd)  # (N, H|Hkv, hd)
            if self.q_norm is not None:
                q, k = self.q_norm(q), self.k_norm(k)
            q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
            v = self.v_proj(x).view(N, Hkv, hd)
        if q_scale is not None:
            q = q * q_scale[:, None, None].to(q.dtype)  # (N, H, hd)
        with labelled("kstep.attention"):
            outs = [self._attend(q, k, v, seg, layer_idx, is_causal) for seg in segments]
        out = outs[0] if len(outs) == 1 else torch.cat(outs)
        if self.fused_out is not None and not torch.is_grad_enabled():
            out = project(out, self.fused_out)
        else:
            out = self.o_proj(out)
        return out if self.reduce is None else self.reduce(out)
