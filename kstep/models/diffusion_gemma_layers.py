"""DiffusionGemma's layer (transformers 5.24 `modeling_diffusion_gemma.py`, the text path): one set
of weights run in two modes, encoder (causal, writes the KV cache) and decoder (bidirectional over
[cached prefix; canvas], reads it). Inference only.

Owns the per-layer geometry (sliding-window layers and full-attention layers each with their own head
dim, KV heads and rotary), the attention of both modes over kstep's preallocated cache, the router
(rms without weight, times a learned scale and H^-0.5, softmax, top-k, renormalised, times a learned
per-expert scale) and the layer's dense MLP + MoE block. The experts themselves are kstep's MoE layer
(layers/moe.py, GeGLU). It does not decide which passes run (the decoder) nor build the stack.

Which keys a canvas sees follows transformers' DynamicCache: a sliding layer keeps the last W - 1
prefix tokens, so a decoder pass's sliding layers attend to those plus the whole canvas (one window
for every canvas row, not vLLM's per-query band, which diverges from transformers: vLLM PR #49202);
its full layers attend to the whole prefix and the canvas. A decoder pass writes its keys into the
cache slots the canvas will occupy once committed, as scratch: the commit's encoder pass overwrites
them before anything reads them as prefix.
"""
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from kstep.layers.attention import Segment
from kstep.layers.labels import labelled
from kstep.layers.mlp import SwiGLU
from kstep.layers.moe import Experts, Routing
from kstep.layers.rotary import apply_rotary

SLIDING, FULL = "sliding_attention", "full_attention"
ENCODER, DECODER = "encoder", "decoder"  # a pass's mode
ACTIVATIONS = {"gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"), "gelu": F.gelu}


def rms(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """Gemma's RMSNorm: x * (mean(x^2) + eps)^-0.5 in float32, times `weight` (not 1 + weight) when
    given, cast back. The reference writes pow(-0.5); torch's fused rms_norm gives the same bits on
    the CPU (the parity tests compare them) in one kernel."""
    out = F.rms_norm(x.float(), (x.shape[-1],), eps=eps)
    return (out if weight is None else out * weight.float()).type_as(x)


class Norm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms(x, self.weight, self.eps)


@dataclass(slots=True)
class KeyView:
    """What one segment's queries attend to in one kind of layer: cache slots [lo, hi), with `mask`
    (b, 1, T|1, hi - lo) bool, True = may attend, or None (all of them; causal when `is_causal`)."""
    lo: int
    hi: int
    mask: torch.Tensor | None
    is_causal: bool = False


def key_views(seg: Segment, mode: str, window: int, device: torch.device) -> dict[str, KeyView]:
    """The segment's view per layer kind. `seg.mask` is its key padding (b, 1, 1, >= hi) or None;
    its T tokens sit at slots [cache_start, cache_start + T)."""
    start, T = seg.cache_start, seg.length
    hi = start + T
    views = {}
    for kind, lo in ((FULL, 0), (SLIDING, max(0, start - (window - 1)))):
        pad = None if seg.mask is None else seg.mask[..., lo:hi]  # (b, 1, 1, S)
        if mode == DECODER:  # bidirectional: every key of the view, pads excepted
            views[kind] = KeyView(lo, hi, pad)
            continue
        if pad is None and start == 0 and (kind == FULL or T <= window):
            views[kind] = KeyView(lo, hi, None, is_causal=True)
            continue
        query = torch.arange(start, hi, device=device)[:, None]  # (T, 1) slots
        key = torch.arange(lo, hi, device=query.device)[None, :]  # (1, S)
        allowed = key <= query
        if kind == SLIDING:
            allowed = allowed & (key > query - window)
        if pad is not None:  # a left-pad query sees itself: no all-masked row (NaN)
            allowed = (allowed & pad) | (key == query)
        views[kind] = KeyView(lo, hi, allowed)  # (T, S) or (b, 1, T, S)
    return views


class Attention(nn.Module):
    """q/k/v projections (no v on full layers: their values are the raw keys), q and k normed per
    head with learned scales, v normed without one, rotary on q and k after their norms, and no
    1/sqrt(d) scaling (scale 1, as the normed q and k are trained for)."""

    def __init__(self, d_model: int, n_heads: int, n_kv_heads: int, head_dim: int, has_v: bool, eps: float):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim, self.eps = n_heads, n_kv_heads, head_dim, eps
        self.q_proj = nn.Linear(d_model, n_heads * head_dim, bias=False)
        self.k_proj = nn.Linear(d_model, n_kv_heads * head_dim, bias=False)
        self.v_proj = nn.Linear(d_model, n_kv_heads * head_dim, bias=False) if has_v else None
        self.o_proj = nn.Linear(n_heads * head_dim, d_model, bias=False)
        self.q_norm = Norm(head_dim, eps)
        self.k_norm = Norm(head_dim, eps)
        self.reduce: Callable[[torch.Tensor], torch.Tensor] | None = None  # tensor parallel: sum the ranks' heads

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, segments: list[Segment],
                views: list[KeyView], layer_idx: int) -> torch.Tensor:
        """x (N, D) packed tokens, cos/sin (N, hd) -> (N, D); each segment's keys/values are written
        at its slots, then its queries attend to its view."""
        N, H, Hkv, hd = x.shape[0], self.n_heads, self.n_kv_heads, self.head_dim
        cos, sin = cos[:, None], sin[:, None]  # (N, 1, hd)
        q = apply_rotary(self.q_norm(self.q_proj(x).view(N, H, hd)), cos, sin)  # (N, H, hd)
        raw_k = self.k_proj(x).view(N, Hkv, hd)
        k = apply_rotary(self.k_norm(raw_k), cos, sin)
        v = rms(raw_k if self.v_proj is None else self.v_proj(x).view(N, Hkv, hd), None, self.eps)
        with labelled("kstep.attention"):
            outs = [self._attend(q, k, v, seg, view, layer_idx) for seg, view in zip(segments, views)]
        out = self.o_proj(outs[0] if len(outs) == 1 else torch.cat(outs))  # (N, D)
        return out if self.reduce is None else self.reduce(out)  # the sum before post_attn_norm: a norm is not linear

    def _attend(self, q, k, v, seg: Segment, view: KeyView, layer_idx: int) -> torch.Tensor:
        b, T = seg.batch, seg.length
        q, k, v = (t[seg.rows].view(b, T, t.shape[1], self.head_dim).transpose(1, 2) for t in (q, k, v))
        seg.cache.write(layer_idx, k, v, seg.cache_start)
        k_read, v_read = seg.cache.read(layer_idx, view.lo, view.hi)
        out = F.scaled_dot_product_attention(
            q, k_read, v_read, attn_mask=view.mask,
            is_causal=view.is_causal, scale=1.0, enable_gqa=self.n_heads != self.n_kv_heads)  # (b, H, T, hd)
        return out.transpose(1, 2).reshape(b * T, self.n_heads * self.head_dim)


class Router(nn.Module):
    """Each token's top-k experts, read from the post-attention residual stream."""

    def __init__(self, d_model: int, num_experts: int, top_k: int, eps: float):
        super().__init__()
        self.top_k, self.eps = top_k, eps
        self.proj = nn.Linear(d_model, num_experts, bias=False)
        self.scale = nn.Parameter(torch.ones(d_model))
        self.expert_scale = nn.Parameter(torch.ones(num_experts))

    def forward(self, x: torch.Tensor) -> Routing:
        """x (N, D) -> experts (N, k) and float32 weights (N, k)."""
        z = rms(x, None, self.eps) * self.scale * x.shape[-1] ** -0.5
        probs = F.softmax(self.proj(z), dim=-1, dtype=torch.float32)  # (N, E)
        weights, ids = probs.topk(self.top_k, dim=-1)
        weights = weights / weights.sum(-1, keepdim=True)
        return Routing(ids, weights * self.expert_scale[ids])


class Layer(nn.Module):
    """Attention, then a dense GeGLU MLP and the MoE block side by side on the same residual
    stream, each normed before and after; the whole stream is multiplied by the mode's layer scalar
    (`scalars` (2, 1): [encoder; decoder])."""
    keeps_float32 = ("scalars",)

    def __init__(self, d_model: int, n_heads: int, n_kv_heads: int, head_dim: int, has_v: bool, ffn_dim: int,
                 num_experts: int, top_k: int, expert_dim: int, activation: str, eps: float):
        super().__init__()
        act = ACTIVATIONS[activation]
        self.attn_norm, self.post_attn_norm = Norm(d_model, eps), Norm(d_model, eps)
        self.attn = Attention(d_model, n_heads, n_kv_heads, head_dim, has_v, eps)
        self.mlp_norm, self.post_mlp_norm = Norm(d_model, eps), Norm(d_model, eps)
        self.mlp = SwiGLU(d_model, ffn_dim, bias=False, activation=act)
        self.moe_norm, self.post_moe_norm = Norm(d_model, eps), Norm(d_model, eps)
        self.router = Router(d_model, num_experts, top_k, eps)
        self.experts = Experts(num_experts, d_model, expert_dim, activation=act)
        self.post_ffn_norm = Norm(d_model, eps)
        self.scalars = nn.Parameter(torch.ones(2, 1))
        self.keep_routing = False  # benchmarks: keep the latest pass's expert choices
        # Expert parallel: sum the ranks' expert shares (float32) before post_moe_norm, then cast.
        self.reduce: Callable[[torch.Tensor], torch.Tensor] | None = None
        self.last_routing: Routing | None = None

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, segments: list[Segment],
                views: list[KeyView], layer_idx: int, modes: torch.Tensor) -> torch.Tensor:
        """x (N, D); modes (N,) long, 0 = encoder token, 1 = decoder token -> (N, D)."""
        x = x + self.post_attn_norm(self.attn(self.attn_norm(x), cos, sin, segments, views, layer_idx))
        dense = self.post_mlp_norm(self.mlp(self.mlp_norm(x)))
        with labelled("kstep.moe"):
            routing = self.router(x)
            if self.keep_routing:
                self.last_routing = routing
            routed = self.experts(self.moe_norm(x), routing)  # (N, D); a rank's share: float32
            if self.reduce is not None:
                routed = self.reduce(routed).to(x.dtype)
            sparse = self.post_moe_norm(routed)
        x = x + self.post_ffn_norm(dense + sparse)
        return (x.float() * self.scalars[modes]).to(x.dtype)  # (N, 1) per token: its mode's scalar
