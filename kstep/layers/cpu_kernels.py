"""kstep's own CPU kernels (cpu_kernels.c) for a decode step's few rows, where a pass is bound by
reading the weights: matrix-vector products over float32, bfloat16 and int8 weights, the RMSNorm
(with the residual add before it), and the int8 quantization done at load time.

Why not torch's: on this project's 2-core AVX2 EPYC, torch's GEMV paths (MKL's `mv`, `F.linear`,
oneDNN, oneDNN on packed weights) read float32 weights at 11-14 GB/s, against 20-24 GB/s for a
`sum` over the same bytes; these read them at 18-22 GB/s, about 90% of that `sum` in the same run.
torch has no fast bf16 GEMV on an AVX2 CPU (oneDNN's needs AVX-512 BF16) and no fast int8 one
(`_weight_int8pack_mm` wants bf16 instructions; without them an int8 layer dequantized its weight
per call). A norm costs torch two or three dispatches, each ~100 us right after a GEMV has streamed
the weights through the caches (a 0.5B model's 49 norms: 6 ms of a 115 ms step; 1 ms in C).
llama.cpp's kernels are built the same way (AVX2 dot products, rows split over the threads); `kstep
bench llamacpp` measures the two engines against each other.

The C files are built on first use (cpu_build.py) and loaded with ctypes, which drops the GIL
around each call. They link the OpenMP runtime torch runs on (libgomp.so.1, already loaded by
torch), so the two share one thread pool. Where there is no compiler, no AVX2/FMA, or
KSTEP_CPU_KERNELS=0, `available()` is False and kstep runs torch's kernels as before, quietly; where a
build was tried and failed, the same after cpu_build.py's one notice.
"""
import ctypes
import os

import torch

from kstep.layers.cpu_build import build, cpu_has_avx2_fma, notice

# Up to this many rows a call reads each weight row once and runs every x row against it while it is
# in cache (a 0.5B model's projections at 4 rows: 1.3x the time of 1 row). More rows (a prefill, a
# diffusion block) go to oneDNN/MKL's blocked matrix-matrix kernels.
MAX_ROWS = 4
# Weights below this many elements stay on torch's kernels: a small model's weights sit in cache,
# where MKL's `x @ W` is already fast, and its tests' reference tokens were pinned with it. A 576-wide
# model's 576 x 576 (SmolLM2-135M: 332K, its 540 MB of float32 far from cache) takes the GEMV: its
# float32 decode went from 20.6 to ~58 tok/s (its whole step then in one C call, cpu_decode.py).
MIN_WEIGHT = 300_000

_P, _L, _I, _F = ctypes.c_void_p, ctypes.c_long, ctypes.c_int, ctypes.c_float
# The exports' (argument types, result type), as cpu_kernels.h declares them (tests/test_cpu_interface.py
# checks the two agree, and that the header declares every function the C files export).
EXPORTS = {
    "kstep_gemv_f32": ([_P, _L, _P, _P, _P, _L, _L, _I], None),
    "kstep_gemv_bf16": ([_P, _L, _P, _P, _P, _L, _L, _I], None),
    "kstep_gemv_i8": ([_P, _L, _P, _P, _P, _P, _L, _L, _I], None),
    "kstep_gemv_i4": ([_P, _L, _P, _P, _P, _P, _P, _L, _L, _I], None),
    "kstep_rms_norm_f32": ([_P, _P, _P, _P, _P, _L, _L, _F], None),
    "kstep_rms_norm_bf16": ([_P, _P, _P, _P, _P, _L, _L, _F], None),
    "kstep_quantize_i8": ([_P, _L, _L, _P, _P, _I], None),
    "kstep_decode_layers": ([_P, _L, _P, _P, _P, _P, _P, _P, _P, _L, _L, _I], None),
    "kstep_decode_layout": ([_P, _L], _L),
    "kstep_draw": ([_P, _P, _L, _L, _P], _L),
    "kstep_argmax_rows": ([_P, _L, _L, _P, _I], None),
}

_lib = None
_tried = False  # one attempt per process: a failed build is reported once, never retried here


def _load():
    global _lib, _tried
    if _tried:
        return _lib
    _tried = True
    if os.environ.get("KSTEP_CPU_KERNELS", "1") == "0" or not cpu_has_avx2_fma():
        return None  # quiet: off by request, or nothing to fix on this CPU
    path = build()
    if path is None:
        return None
    try:
        lib = ctypes.CDLL(str(path))
        for name, (argtypes, restype) in EXPORTS.items():
            fn = getattr(lib, name)
            fn.argtypes, fn.restype = argtypes, restype
    except (OSError, AttributeError) as e:  # a cached file that is not this library (CC=true, a truncated copy)
        path.unlink(missing_ok=True)  # so the next process builds it again
        notice(f"{path} did not load: {e}", "check that CC is a working C compiler")
        return None
    _lib = lib
    return lib


def library():
    """The loaded kernels' library (ctypes), or None where they are not built (see `available`)."""
    return _load()


def available() -> bool:
    """Whether the kernels are built and loaded here (builds them on first use)."""
    return _load() is not None


_DTYPES = (torch.float32, torch.bfloat16)


def takes(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether `gemv` runs x (..., in) @ weight (out, in).T: a float32 or bf16 weight of MIN_WEIGHT
    elements or more, contiguous (out, in), on the CPU, in inference, at most MAX_ROWS rows of x."""
    return (weight.dtype in _DTYPES and x.dtype == weight.dtype and weight.device.type == "cpu"
            and not weight.is_mkldnn and weight.numel() >= MIN_WEIGHT and weight.is_contiguous()
            and x.numel() <= MAX_ROWS * weight.shape[1] and not torch.is_grad_enabled() and available())


def _ptr(t: torch.Tensor | None):
    return None if t is None else t.data_ptr()


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x (..., in) @ weight (out, in).T (+ bias), float32 or bf16 (as `takes` says); float32 sums."""
    out_f, in_f = weight.shape
    flat = x.reshape(-1, in_f).contiguous()
    y = torch.empty(flat.shape[0], out_f, dtype=x.dtype)
    if bias is not None:
        bias = bias.to(x.dtype).contiguous()
    lib = _load()
    fn = lib.kstep_gemv_f32 if x.dtype == torch.float32 else lib.kstep_gemv_bf16
    fn(flat.data_ptr(), flat.shape[0], weight.data_ptr(), _ptr(bias), y.data_ptr(), out_f, in_f,
       torch.get_num_threads())
    return y.view(*x.shape[:-1], out_f)


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """x.argmax(-1) of a 2-d tensor: in C (the same index: only comparisons) for a contiguous float32
    CPU tensor where the kernels are built, else torch's (its CPU reduction reads about 3 GB/s)."""
    lib = _load()
    if lib is None or x.dtype != torch.float32 or x.device.type != "cpu" or not x.is_contiguous() or x.dim() != 2 \
            or x.shape[1] == 0:
        return x.argmax(-1)
    out = torch.empty(x.shape[0], dtype=torch.long)
    lib.kstep_argmax_rows(x.data_ptr(), x.shape[0], x.shape[1], out.data_ptr(), torch.get_num_threads())
    return out


def takes_int8(x: torch.Tensor, codes: torch.Tensor) -> bool:
    """Whether `gemv_int8` runs x against these (out, in) int8 codes."""
    return (codes.device.type == "cpu" and x.dtype in _DTYPES and x.numel() <= MAX_ROWS * codes.shape[1]
            and codes.is_contiguous() and available())


def gemv_int8(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor,
              bias: torch.Tensor | None = None) -> torch.Tensor:
    """x (..., in) @ (codes (out, in) * scales (out,)[:, None]).T (+ bias), in x's dtype: x rounded to
    int16 per block of 256 (relative error < 2e-5 of the block's largest value), float32 sums."""
    out_f, in_f = codes.shape
    flat = x.reshape(-1, in_f).float().contiguous()
    y = torch.empty(flat.shape[0], out_f)
    scales = scales.float().contiguous()
    if bias is not None:
        bias = bias.float().contiguous()
    _load().kstep_gemv_i8(flat.data_ptr(), flat.shape[0], codes.data_ptr(), scales.data_ptr(), _ptr(bias),
                       y.data_ptr(), out_f, in_f, torch.get_num_threads())
    return y.to(x.dtype).view(*x.shape[:-1], out_f)


INT4_GROUP = 32  # cpu_kernels.h's I4GROUP: the group the int4 kernel reads


def takes_int4(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, low: torch.Tensor, group_size: int) -> bool:
    """Whether `gemv_int4` runs x against these int4 codes (Int4Linear's buffers): groups of INT4_GROUP,
    float32 scales and lows, at most MAX_ROWS rows of x, on the CPU."""
    return (packed.device.type == "cpu" and group_size == INT4_GROUP and x.dtype in _DTYPES
            and x.numel() <= MAX_ROWS * packed.shape[1] * 2 and packed.is_contiguous()
            and scale.dtype == torch.float32 and low.dtype == torch.float32 and scale.is_contiguous()
            and low.is_contiguous() and available())


def gemv_int4(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, low: torch.Tensor,
              bias: torch.Tensor | None = None) -> torch.Tensor:
    """x (..., in) @ W.T (+ bias) for Int4Linear's W (code * scale + low per group of INT4_GROUP), in x's
    dtype: x rounded to int16 per block of 256 as `gemv_int8` does, float32 sums."""
    out_f, in_f = packed.shape[0], packed.shape[1] * 2
    flat = x.reshape(-1, in_f).float().contiguous()
    y = torch.empty(flat.shape[0], out_f)
    if bias is not None:
        bias = bias.float().contiguous()
    _load().kstep_gemv_i4(flat.data_ptr(), flat.shape[0], packed.data_ptr(), scale.data_ptr(), low.data_ptr(),
                          _ptr(bias), y.data_ptr(), out_f, in_f, torch.get_num_threads())
    return y.to(x.dtype).view(*x.shape[:-1], out_f)


# Norms of rows at least this wide run in C (`rms_norm`): the widths of models whose weights take the
# GEMV; a small model's norms stay on torch's kernel, with which its tests' reference tokens were pinned.
NORM_MIN_DIM = 512


def takes_norm(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether `rms_norm` normalizes x (..., dim): float32 or bf16 (its weight too), at most MAX_ROWS
    rows of NORM_MIN_DIM or more, on the CPU, in inference."""
    return (x.dtype in _DTYPES and weight.dtype == x.dtype and x.device.type == "cpu"
            and x.shape[-1] >= NORM_MIN_DIM and x.numel() <= MAX_ROWS * x.shape[-1] and not torch.is_grad_enabled()
            and available())


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             delta: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(x + delta, rms_norm(x + delta) * weight), or (x, rms_norm(x) * weight) without delta; float32
    or bf16 (as `takes_norm` says), the same sums and roundings as kstep's torch path (RMSNorm) up to
    the order of the sums."""
    x = x.contiguous()
    y = torch.empty_like(x)
    if delta is not None:
        delta = delta.reshape(x.shape).contiguous()
        total = torch.empty_like(x)
    else:
        total = x
    lib = _load()
    fn = lib.kstep_rms_norm_f32 if x.dtype == torch.float32 else lib.kstep_rms_norm_bf16
    fn(x.data_ptr(), _ptr(delta), total.data_ptr() if delta is not None else None, weight.contiguous().data_ptr(),
       y.data_ptr(), x.numel() // x.shape[-1], x.shape[-1], eps)
    return total, y


def quantize_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(codes (out, in) int8, scales (out,) float32) of a float32 CPU weight, one scale per row, as
    Int8Linear's torch expression computes them (bit for bit); None where the kernels are not built."""
    if weight.dtype != torch.float32 or weight.device.type != "cpu" or not available():
        return None
    w = weight.contiguous()
    codes = torch.empty(w.shape, dtype=torch.int8)
    scales = torch.empty(w.shape[0])
    _load().kstep_quantize_i8(w.data_ptr(), w.shape[0], w.shape[1], codes.data_ptr(), scales.data_ptr(),
                              torch.get_num_threads())
    return codes, scales
