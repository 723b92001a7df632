"""A decode step's transformer block in one C call (cpu_decode.c), on a CPU in float32: the pass
of one token against a KV cache, which an AR model runs once per generated token.

Why: the block's GEMVs read the weights at memory speed (cpu_kernels), but the ~20 torch ops around
them each cost 10-40 us right after a GEMV has streamed the weights through the caches, about 10 ms
of a 0.5B model's ~95 ms step on this project's 2-core AVX2 EPYC; in C they cost a few us per layer.
The C block runs the same GEMVs and norms as the torch path (float32 or int8 weights), so the two
agree up to the order of the sums in the attention and the exp in SiLU and softmax (tested).

`plan` says where it applies: one row of one sequence (batch 1, one token) with a plain KV cache and
no mask (an AR decode step; also a speculative draft's), float32 activations, a Block of kstep's
own Attention and SwiGLU (SiLU) with RMSNorms at least cpu_kernels.NORM_MIN_DIM wide (a small model's
tests pinned torch's tokens), no tensor parallelism, and float32 or int8 projections. Everything else
runs the torch path, unchanged. Where every layer of a pass runs in C, `plan_stack` makes them one
call (one OpenMP team for the whole step, one ctypes call).

The ctypes structs below mirror cpu_kernels.h's by hand: at first use the library reports how its
compiler laid them out (kstep_decode_layout), and where that differs the C block stays off, after a
notice, rather than read misplaced pointers.
"""
import ctypes
import os
import sys
import weakref

import torch
import torch.nn.functional as F
from torch import nn

from kstep.layers import cpu_kernels
from kstep.layers.attention import Attention, Segment
from kstep.layers.mlp import SwiGLU
from kstep.layers.norm import RMSNorm
from kstep.layers.quantized import Int4Linear, Int8Linear

MAX_PARTS = 7  # cpu_kernels.h: q/k/v (up to 3), o, gate/up (up to 2), down
# KSTEP_CPU_DECODE=0 runs the torch block over the same kernels (to measure what this file gains);
# KSTEP_CPU_KERNELS=0 turns off both.
ENABLED = os.environ.get("KSTEP_CPU_DECODE", "1") != "0"


class _Proj(ctypes.Structure):
    _fields_ = [("weight", ctypes.c_void_p), ("scales", ctypes.c_void_p), ("low", ctypes.c_void_p),
                ("bias", ctypes.c_void_p), ("out", ctypes.c_long)]


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
    """[(tensors to keep alive, weight ptr, scales ptr, low ptr, bias ptr, rows)] for one stage's projections:
    the fused weight where there is one, else each linear; None where one of them cannot run in C."""
    if fused is not None:
        weight, bias = fused
        if not (_is_f32(weight) and _is_f32(bias)):
            return None
        return [((weight, bias), weight.data_ptr(), None, None, cpu_kernels._ptr(bias), weight.shape[0])]
    out = []
    for m in linears:
        if type(m) is nn.Linear and _is_f32(m.weight) and _is_f32(m.bias):
            out.append(((m.weight, m.bias), m.weight.data_ptr(), None, None, cpu_kernels._ptr(m.bias),
                        m.out_features))
        elif type(m) is Int8Linear and m.weight_int8.is_contiguous() and _is_f32(m.scales) and _is_f32(m.bias):
            out.append(((m.weight_int8, m.scales, m.bias), m.weight_int8.data_ptr(), m.scales.data_ptr(), None,
                        cpu_kernels._ptr(m.bias), m.out_features))
        elif type(m) is Int4Linear and m.group_size == cpu_kernels.INT4_GROUP and m.packed.is_contiguous() \
                and _is_f32(m.scale) and _is_f32(m.low) and _is_f32(m.bias):
            out.append(((m.packed, m.scale, m.low, m.bias), m.packed.data_ptr(), m.scale.data_ptr(), m.low.data_ptr(),
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
    for i, (tensors, weight, scales, low, bias, rows) in enumerate(p for stage in stages for p in stage):
        layer.proj[i] = _Proj(weight, scales, low, bias, rows)
        keep += [t for t in tensors if t is not None]
    return layer, keep


def _key(block: nn.Module) -> tuple:
    """The objects holding the block's weights now (replaced when it is fused or quantized). Read from
    the modules' dicts: nn.Module's attribute lookup made this check 13 us a layer, a step's 0.4 ms on
    a 30-layer model."""
    attn, mlp = block._modules["attn"], block._modules["mlp"]
    a, m = attn.__dict__, mlp.__dict__
    return (a.get("fused"), a.get("fused_out"), m.get("fused"), m.get("fused_down"), *attn._modules.values(),
            *mlp._modules.values(), block._modules["attn_norm"]._parameters["weight"],
            block._modules["mlp_norm"]._parameters["weight"])


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


def _one_token(x: torch.Tensor, segments: list[Segment], q_scale: torch.Tensor | None) -> bool:
    """Whether the pass is one token of one sequence against a plain KV cache (see the module's docstring)."""
    if not ENABLED or x.shape[0] != 1 or x.dtype != torch.float32 or x.device.type != "cpu" or q_scale is not None \
            or len(segments) != 1 or torch.is_grad_enabled():
        return False
    seg = segments[0]
    if seg.batch != 1 or seg.length != 1 or seg.cache is None or seg.mask is not None \
            or seg.cache_slots is not None or seg.cache_len is not None:
        return False
    kv = seg.cache
    # the C writes at slot cache_start of one sequence's cache without bounds checks: anything else (a
    # slot past the end, a shared page, a cache of several rows) gets the torch path and its errors.
    return kv.batch == 1 and kv.shared_until <= seg.cache_start < kv.length


def _layer_cache(kv, layer_idx: int, block: nn.Module) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Layer `layer_idx`'s (keys, values) as the C reads them, or None where it cannot: a view (Hkv, S, hd)
    whose heads' slots lie one after another (heads further apart); else the storage (Hkv, slots, hd)
    itself, walked through the row's physical slot index."""
    views = kv.layer(layer_idx)
    k_cache, v_cache = (views[0][0], views[1][0]) if views is not None else kv.storage[layer_idx]
    if not (k_cache.dtype == torch.float32 and v_cache.dtype == torch.float32 and _slots_in_a_row(k_cache)
            and k_cache.stride() == v_cache.stride() and k_cache.device.type == "cpu" and k_cache.shape == v_cache.shape
            and k_cache.shape[0] == block.attn.n_kv_heads and k_cache.shape[2] == block.attn.head_dim
            and (views is not None or (kv.slots.dtype == torch.int64 and kv.slots.is_contiguous()))):
        return None
    return k_cache, v_cache


def plan(block: nn.Module, x: torch.Tensor, segments: list[Segment], layer_idx: int,
         q_scale: torch.Tensor | None) -> _Layer | None:
    """The C description of the block where `forward` runs this pass of it (see the module's
    docstring), else None: the torch path runs it."""
    if not _one_token(x, segments, q_scale) or type(block.attn) is not Attention or type(block.mlp) is not SwiGLU:
        return None  # (a sparse MoE layer, for one)
    if _layer_cache(segments[0].cache, layer_idx, block) is None:
        return None
    described = _layer(block)
    return None if described is None else described[0]


class _Stack:
    """What one C call over a run of layers takes: their descriptions side by side and each layer's
    cache, as the ctypes arrays kstep_decode_layers reads."""

    def __init__(self, layers: list[_Layer], caches: list[tuple[torch.Tensor, torch.Tensor]], slots: torch.Tensor | None):
        n = len(layers)
        self.layers, self.n = (_Layer * n)(*layers), n
        self.k = (ctypes.c_void_p * n)(*(k.data_ptr() for k, _ in caches))
        self.v = (ctypes.c_void_p * n)(*(v.data_ptr() for _, v in caches))
        self.cache_slots = (ctypes.c_long * n)(*(k.stride(0) // k.shape[2] for k, _ in caches))
        self.slots = None if slots is None else slots.data_ptr()
        self.holds = (caches, slots)  # the caches' memory stays while this points into it
        self.rotary_width = None


_stacks: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # a cache -> (its key, its _Stack)


def plan_stack(blocks: nn.ModuleList, x: torch.Tensor, segments: list[Segment],
               q_scale: torch.Tensor | None) -> _Stack | None:
    """The C call over all of `blocks` where every one of them runs this pass in C (`plan`), else None.
    Checked each pass; what is built from the cache and the descriptions is kept while neither changes
    (a cache recomputes its slot index, a new tensor, when its page tables change)."""
    if not _one_token(x, segments, q_scale):
        return None
    if any(type(b._modules["attn"]) is not Attention or type(b._modules["mlp"]) is not SwiGLU for b in blocks):
        return None  # (a sparse MoE layer, for one)
    described = [_layer(block) for block in blocks]
    if any(d is None for d in described):
        return None
    kv = segments[0].cache
    key = (kv.slots, blocks, *described)
    kept = _stacks.get(kv)
    if kept is not None and len(kept[0]) == len(key) and all(a is b for a, b in zip(kept[0], key)):
        return kept[1]
    caches = [_layer_cache(kv, i, block) for i, block in enumerate(blocks)]
    if any(c is None for c in caches):
        return None
    stack = _Stack([layer for layer, _ in described], caches, None if kv.layer(0) is not None else kv.slots)
    _stacks[kv] = (key, stack)
    return stack


def forward_stack(stack: _Stack, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, seg: Segment) -> torch.Tensor:
    """The layers `stack` describes (from `plan_stack`) on x (1, D) for the token at cache slot
    seg.cache_start, writing its keys and values there and attending to the slots before it;
    cos, sin (1, rotary width): the token's rotary rows."""
    if stack.rotary_width != cos.shape[-1]:
        stack.rotary_width = cos.shape[-1]
        for layer in stack.layers:
            layer.rotary_width = stack.rotary_width
    x = x.contiguous().clone()  # updated in place
    cos, sin = cos.float().contiguous(), sin.float().contiguous()
    cpu_kernels.library().kstep_decode_layers(stack.layers, stack.n, x.data_ptr(), cos.data_ptr(), sin.data_ptr(),
                                              stack.k, stack.v, stack.cache_slots, stack.slots, seg.cache_start,
                                              seg.cache_start + 1, torch.get_num_threads())
    return x


def forward(layer: _Layer, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, seg: Segment,
            layer_idx: int) -> torch.Tensor:
    """The block `layer` describes (from `plan`) on x (1, D), as `forward_stack` runs a run of them."""
    kv, views = seg.cache, seg.cache.layer(layer_idx)
    cache = (views[0][0], views[1][0]) if views is not None else kv.storage[layer_idx]
    return forward_stack(_Stack([layer], [cache], None if views is not None else kv.slots), x, cos, sin, seg)
