"""A decode step's transformer block in one C call (cpu_decode.c), on a CPU in float32: the pass
of one token against a KV cache, which an AR model runs once per generated token.

Why: the block's GEMVs read the weights at memory speed (cpu_kernels), but the ~20 torch ops around
them each cost 10-40 us right after a GEMV has streamed the weights through the caches, about 10 ms
of a 0.5B model's ~95 ms step on this project's 2-core AVX2 EPYC; in C they cost a few us per layer.
The C block runs the same GEMVs and norms as the torch path (float32 or int8 weights), so the two
agree up to the order of the sums in the attention and the exp in SiLU and softmax (tested).

`plan` says where it applies: one row of one sequence (batch 1, one token) with a plain KV cache and
no mask (an AR decode step; also a speculative draft's), float32 activations, a Block of kstep's
own Attention and SwiGLU (SiLU) with RMSNorms, no tensor parallelism, and projections that take
kstep's GEMVs (float32 weights of cpu_kernels.MIN_WEIGHT elements or more, or int8 ones). Everything
else runs the torch path, unchanged.

The ctypes structs below mirror cpu_kernels.h's by hand: at first use the library reports how its
compiler laid them out (kstep_decode_layout), and where that differs the C block stays off, after a
notice, rather than read misplaced pointers.
"""
import ctypes
import os
import sys

import torch
import torch.nn.functional as F
from torch import nn

from kstep.layers import cpu_kernels
from kstep.layers.attention import Attention, Segment
from kstep.layers.mlp import SwiGLU
from kstep.layers.norm import RMSNorm
from kstep.layers.quantized import Int8Linear

MAX_PARTS = 7  # cpu_kernels.h: q/k/v (up to 3), o, gate/up (up to 2), down
# KSTEP_CPU_DECODE=0 runs the torch block over the same kernels (to measure what this file gains);
# KSTEP_CPU_KERNELS=0 turns off both.
ENABLED = os.environ.get("KSTEP_CPU_DECODE", "1") != "0"


class _Proj(ctypes.Structure):
    _fields_ = [("weight", ctypes.c_void_p), ("scales", ctypes.c_void_p), ("bias", ctypes.c_void_p),
                ("out", ctypes.c_long)]


class _Layer(ctypes.Structure):
    _fields_ = [("dim", ctypes.c_long), ("heads", ctypes.c_long), ("kv_heads", ctypes.c_long),
                ("head_dim", ctypes.c_long), ("rotary_width", ctypes.c_long), ("ffn", ctypes.c_long),
                ("norm_eps", ctypes.c_float), ("qk_norm_eps", ctypes.c_float),
                ("attn_norm", ctypes.c_void_p), ("mlp_norm", ctypes.c_void_p), ("q_norm", ctypes.c_void_p),
                ("k_norm", ctypes.c_void_p), ("qkv_parts", ctypes.c_int), ("gate_up_parts", ctypes.c_int),
                ("proj", _Proj * MAX_PARTS)]


def _layout(*structs: type[ctypes.Structure]) -> list[tuple[str, int]]:
    """Each struct's size, then its fields' (offset, size) in order, as kstep_decode_layout returns them,
    each with its name."""
    out = []
    for struct in structs:
        out.append((f"sizeof({struct.__name__})", ctypes.sizeof(struct)))
        for name, _ in struct._fields_:
            field, label = getattr(struct, name), f"{struct.__name__}.{name}"
            out += [(f"{label}'s offset", field.offset), (f"{label}'s size", field.size)]
    return out


def layout_mismatch(lib: ctypes.CDLL, proj: type[ctypes.Structure] | None = None,
                    layer: type[ctypes.Structure] | None = None) -> str | None:
    """Where the C library lays kstep_proj and kstep_layer out otherwise than these ctypes mirrors
    (default: _Proj, _Layer), the first difference; None where they agree."""
    want = _layout(proj or _Proj, layer or _Layer)
    got = (ctypes.c_long * len(want))()
    count = lib.kstep_decode_layout(got, len(want))
    for (name, expected), actual in zip(want, got[:count]):
        if actual != expected:
            return f"{name} is {actual} in cpu_kernels.h's struct, {expected} in cpu_decode.py's ctypes mirror"
    if count != len(want):
        return f"cpu_kernels.h's structs have {count} sizes and offsets, cpu_decode.py's ctypes mirrors {len(want)}"
    return None


_layout_checked: bool | None = None  # whether the C block's structs match (checked once, at first use)


def _runs_in_c() -> bool:
    """Whether the C block is built and its structs match cpu_decode.py's; says once where they do not."""
    global _layout_checked
    if _layout_checked is None:
        mismatch = layout_mismatch(cpu_kernels.library()) if cpu_kernels.available() else None
        if mismatch is not None:  # passing it misplaced pointers would corrupt memory
            sys.stderr.write(f"kstep: its C decode block is off, the torch block runs instead: {mismatch} "
                             "(a bug in kstep: cpu_kernels.h and cpu_decode.py must change together)\n")
        _layout_checked = cpu_kernels.available() and mismatch is None
    return _layout_checked


def _is_f32(t: torch.Tensor | None) -> bool:
    return t is None or (t.dtype == torch.float32 and t.device.type == "cpu" and t.is_contiguous()
                         and not t.is_mkldnn)


def _parts(fused: tuple | None, linears: list[nn.Module]) -> list[tuple] | None:
    """[(tensors to keep alive, weight ptr, scales ptr, bias ptr, rows)] for one stage's projections:
    the fused weight where there is one, else each linear; None where one of them cannot run in C."""
    if fused is not None:
        weight, bias = fused
        if not (_is_f32(weight) and _is_f32(bias) and weight.numel() >= cpu_kernels.MIN_WEIGHT):
            return None
        return [((weight, bias), weight.data_ptr(), None, cpu_kernels._ptr(bias), weight.shape[0])]
    out = []
    for m in linears:
        if type(m) is nn.Linear and _is_f32(m.weight) and _is_f32(m.bias) and m.weight.numel() >= cpu_kernels.MIN_WEIGHT:
            out.append(((m.weight, m.bias), m.weight.data_ptr(), None, cpu_kernels._ptr(m.bias), m.out_features))
        elif type(m) is Int8Linear and m.weight_int8.is_contiguous() and _is_f32(m.scales) and _is_f32(m.bias):
            out.append(((m.weight_int8, m.scales, m.bias), m.weight_int8.data_ptr(), m.scales.data_ptr(),
                        cpu_kernels._ptr(m.bias), m.out_features))
        else:
            return None
    return out


def _describe(block: nn.Module) -> tuple | None:
    """(the C layer description, the tensors it points into) of a Block, or None where its shape is
    not one cpu_decode.c computes."""
    attn, mlp = block.attn, block.mlp
    norms = (block.attn_norm, block.mlp_norm)
    if type(attn) is not Attention or type(mlp) is not SwiGLU or mlp.activation is not F.silu \
            or attn.reduce is not None or mlp.reduce is not None \
            or any(type(n) is not RMSNorm or not _is_f32(n.weight) for n in norms) or norms[0].eps != norms[1].eps \
            or norms[0].weight.shape[0] < cpu_kernels.NORM_MIN_DIM:
        return None
    stages = [_parts(attn.fused, [attn.q_proj, attn.k_proj, attn.v_proj]), _parts(attn.fused_out, [attn.o_proj]),
              _parts(mlp.fused, [mlp.gate_proj, mlp.up_proj]), _parts(mlp.fused_down, [mlp.down_proj])]
    if any(s is None for s in stages):
        return None
    layer = _Layer(dim=norms[0].weight.shape[0], heads=attn.n_heads, kv_heads=attn.n_kv_heads,
                   head_dim=attn.head_dim, ffn=mlp.down_proj.in_features, norm_eps=norms[0].eps,
                   attn_norm=norms[0].weight.data_ptr(), mlp_norm=norms[1].weight.data_ptr(),
                   qkv_parts=len(stages[0]), gate_up_parts=len(stages[2]))
    keep = [n.weight for n in norms]
    if attn.q_norm is not None:
        if not all(type(n) is RMSNorm and _is_f32(n.weight) for n in (attn.q_norm, attn.k_norm)) \
                or attn.q_norm.eps != attn.k_norm.eps:
            return None
        layer.q_norm, layer.k_norm, layer.qk_norm_eps = attn.q_norm.weight.data_ptr(), attn.k_norm.weight.data_ptr(), \
            attn.q_norm.eps
        keep += [attn.q_norm.weight, attn.k_norm.weight]
    for i, (tensors, weight, scales, bias, rows) in enumerate(p for stage in stages for p in stage):
        layer.proj[i] = _Proj(weight, scales, bias, rows)
        keep += [t for t in tensors if t is not None]
    return layer, keep


def _key(block: nn.Module) -> tuple:
    """The objects holding the block's weights now (replaced when it is fused or quantized)."""
    attn, mlp = block.attn, block.mlp
    return (attn.fused, attn.fused_out, mlp.fused, mlp.fused_down, attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj,
            mlp.gate_proj, mlp.up_proj, mlp.down_proj, block.attn_norm.weight, block.mlp_norm.weight, attn.q_norm)


def _layer(block: nn.Module) -> tuple | None:
    """The block's cached description, rebuilt when its weights were replaced (fused, quantized) or
    their memory was (`.to()` and `param.data = ...` keep the Parameter and swap its tensor)."""
    key = _key(block)
    cached = block.__dict__.get("_cpu_decode")
    if cached is None or len(cached[0]) != len(key) or any(a is not b for a, b in zip(cached[0], key)) \
            or any(t.data_ptr() != at for t, at in cached[2]):
        described = _describe(block) if _runs_in_c() else None
        tensors = [] if described is None else described[1]
        # the pointers are checked against each tensor's on every call, and the memory they were
        # taken from is held (detached views) while cached, so it is never freed or reused under the C
        cached = (key, described, [(t, t.data_ptr()) for t in tensors], [t.detach() for t in tensors])
        block.__dict__["_cpu_decode"] = cached  # not a submodule or buffer: invisible to state_dict and .to()
    return cached[1]


def _slots_in_a_row(cache: torch.Tensor) -> bool:
    """(Hkv, S, hd) with each head's S slots contiguous and heads a whole number of slots apart."""
    hd = cache.shape[2]
    return cache.stride(2) == 1 and cache.stride(1) == hd and cache.stride(0) % hd == 0


def plan(block: nn.Module, x: torch.Tensor, segments: list[Segment], layer_idx: int,
         q_scale: torch.Tensor | None) -> _Layer | None:
    """The C description of the block where `forward` runs this pass of it (see the module's
    docstring), else None: the torch path runs it."""
    if not ENABLED or x.shape[0] != 1 or x.dtype != torch.float32 or x.device.type != "cpu" or q_scale is not None \
            or len(segments) != 1 or torch.is_grad_enabled():
        return None
    seg = segments[0]
    if seg.batch != 1 or seg.length != 1 or seg.cache is None or seg.mask is not None \
            or seg.cache_slots is not None or seg.cache_len is not None:
        return None
    if type(block.attn) is not Attention or type(block.mlp) is not SwiGLU:  # e.g. a sparse MoE layer
        return None
    kv = seg.cache
    # the C writes at slot cache_start of one sequence's cache without bounds checks: anything else (a
    # slot past the end, a shared page, a cache of several rows) gets the torch path and its errors.
    if kv.batch != 1 or not kv.shared_until <= seg.cache_start < kv.length:
        return None
    views = kv.layer(layer_idx)
    # A view (1, Hkv, S, hd) whose heads' slots lie one after another (heads further apart); else the
    # storage (Hkv, slots, hd) itself, walked through the row's physical slot index.
    k_cache, v_cache = (views[0][0], views[1][0]) if views is not None else kv.storage[layer_idx]
    if not (k_cache.dtype == torch.float32 and v_cache.dtype == torch.float32 and _slots_in_a_row(k_cache)
            and k_cache.stride() == v_cache.stride() and k_cache.device.type == "cpu" and k_cache.shape == v_cache.shape
            and k_cache.shape[0] == block.attn.n_kv_heads and k_cache.shape[2] == block.attn.head_dim
            and (views is not None or (kv.slots.dtype == torch.int64 and kv.slots.is_contiguous()))):
        return None
    described = _layer(block)
    return None if described is None else described[0]


def forward(layer: _Layer, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, seg: Segment,
            layer_idx: int) -> torch.Tensor:
    """The block `layer` describes (from `plan`) on x (1, D) for the token at cache slot
    seg.cache_start, writing its keys and values there and attending to the slots before it;
    cos, sin (1, rotary width): the token's rotary rows."""
    layer.rotary_width = cos.shape[-1]
    kv = seg.cache
    views = kv.layer(layer_idx)
    k_cache, v_cache = (views[0][0], views[1][0]) if views is not None else kv.storage[layer_idx]
    x = x.contiguous()
    cos, sin = cos.float().contiguous(), sin.float().contiguous()
    y = torch.empty_like(x)
    cpu_kernels.library().kstep_decode_layer(ctypes.byref(layer), x.data_ptr(), y.data_ptr(), cos.data_ptr(),
                                             sin.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(),
                                             k_cache.stride(0) // k_cache.shape[2],
                                             None if views is not None else kv.slots.data_ptr(), seg.cache_start,
                                             seg.cache_start + 1, torch.get_num_threads())
    return y
