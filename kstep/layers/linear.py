"""The matmul every inference projection goes through: `linear(x, weight, bias)` with the weight
kept as nn.Linear keeps it, (out, in), and the kernel chosen for the device, dtype and rows.

On a CPU, a weight of 500K elements and more:
- up to 4 rows (a decode step), float32 or bf16: kstep's own GEMV (cpu_kernels), 1.3-1.6x faster
  than torch's GEMV paths in float32 and the only fast bf16 one on an AVX2 CPU (a CPU with AVX-512
  BF16 keeps bf16 weights packed for oneDNN's bf16 kernel, `pack`, measured there, not here);
- more rows in float32 (a prefill, a diffusion block): oneDNN's inner product
  (`torch.ops.mkldnn._linear_pointwise`, the kernel torch.compile's CPU backend emits for linear
  layers), measured 1.1-2.2x faster than MKL's matmul at 1-32 rows of a 1.5B model's projections
  and no slower at 128 (docs/benchmarks.md, "One pass at real sizes");
- more rows in bf16 on a CPU without AVX-512 BF16: the weight widened to float32 a slice at a time
  (`linear_widened`), since torch's bf16 matmul there runs at a quarter of float32's speed.
Where kstep's kernels are not built, float32 weights are packed into oneDNN's blocked layout at
load (`pack_fused_weights`) and weights under 1.2M elements are stored (in, out) for MKL's `x @ W`
(`inference_layout`). Small weights and everything else (CUDA; fp16) go to `F.linear`, whose bf16
path wants this (out, in) layout: an (in, out) contiguous bf16 weight is 20-30x slower on an AVX2 CPU.
"""
import torch
import torch.nn.functional as F

from kstep.layers import cpu_kernels


def _probe_onednn() -> bool:
    """Whether this torch has oneDNN's float32 inner product on the CPU (and it runs here)."""
    try:
        out = torch.ops.mkldnn._linear_pointwise(torch.ones(2, 8), torch.ones(4, 8), None, "none", [], "")
        return bool(torch.equal(out, torch.full((2, 4), 8.0)))
    except (AttributeError, RuntimeError):
        return False


HAS_ONEDNN = _probe_onednn()
# Weights below this many elements: oneDNN's fixed cost per call (60-100 us here) outweighs its
# faster kernel, and MKL's `x @ W` with W stored (in, out) is the fastest at the few rows of a small
# model's decode step (192 x 576 at one row: 17 us, against 25 us for F.linear and 69 us for oneDNN).
ONEDNN_MIN_WEIGHT = 1_200_000


def _gemv_reads(weight: torch.Tensor) -> bool:
    """Whether kstep's own CPU GEMV (cpu_kernels) runs this weight's decode rows: it reads (out, in)."""
    return not weight.is_cuda and weight.numel() >= cpu_kernels.MIN_WEIGHT and cpu_kernels.available()


def wants_in_out(weight: torch.Tensor) -> bool:
    """Whether `linear` runs this (out, in) weight fastest stored transposed, (in, out): a small
    float32 weight on the CPU (MKL's `x @ W`)."""
    return weight.dtype == torch.float32 and not weight.is_cuda and weight.numel() < ONEDNN_MIN_WEIGHT \
        and not _gemv_reads(weight)


def inference_layout(weight: torch.Tensor) -> torch.Tensor:
    """The (out, in) `weight` stored as its kernel wants it (a view of the same logical matrix)."""
    return weight.t().contiguous().t() if wants_in_out(weight) else weight.contiguous()


def _probe_onednn_bf16() -> bool:
    try:
        return HAS_ONEDNN and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False


HAS_ONEDNN_BF16 = _probe_onednn_bf16()


# Packed, oneDNN beats MKL's `x @ W` from about this size (a 0.5B model's 1152 x 896 q/k/v at one
# row: 207 us against 276, interleaved).
PACK_MIN_WEIGHT = 500_000


def wants_packed(weight: torch.Tensor) -> bool:
    """Whether `pack` would store this (out, in) weight in oneDNN's blocked layout: a large float32
    weight on a CPU where kstep's GEMV is not built (that kernel reads the plain layout, and reads it
    faster: cpu_kernels), or a bfloat16 one where the CPU runs oneDNN's bf16."""
    f32_ok = weight.dtype == torch.float32 and HAS_ONEDNN and not _gemv_reads(weight)
    dtype_ok = f32_ok or (weight.dtype == torch.bfloat16 and HAS_ONEDNN_BF16)
    return dtype_ok and not weight.is_cuda and not weight.is_mkldnn and weight.numel() >= PACK_MIN_WEIGHT


def pack(weight: torch.Tensor) -> torch.Tensor:
    """The weight reordered once into oneDNN's blocked layout for its inner product (what
    torch.compile's CPU backend does to frozen linear weights), with the same results at one row.
    Measured interleaved at one row, 2 threads, a 0.5B model's shapes, 24 weights each: bf16 takes
    0.63-0.72x F.linear's time (its kernel before); float32 0.77x oneDNN on the plain weight for
    q/k/v-sized weights (0.70-0.75x MKL's `x @ W`, their kernel before), about the same (0.93-1.05x)
    for the large ones. An opaque tensor: only `linear` reads it."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), 1)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x (..., in) @ weight (out, in).T (+ bias) -> (..., out), by the kernel `weight`'s storage says."""
    if weight.is_mkldnn:  # packed (`pack`)
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        out = torch.ops.mkldnn._linear_pointwise(flat if flat.is_contiguous() else flat.contiguous(), weight, bias,
                                                 "none", [], "")
        return out.view(*shape[:-1], weight.shape[0])
    if weight.stride(0) == 1 and weight.stride(1) != 1:  # stored (in, out): MKL's matmul (no view made to ask)
        out = x @ weight.t()
        return out if bias is None else out + bias
    if not x.is_cuda and cpu_kernels.takes(x, weight):  # a decode step's few rows
        return cpu_kernels.gemv(x, weight, bias)
    if x.dtype == torch.bfloat16 and not x.is_cuda and not HAS_ONEDNN_BF16 and not torch.is_grad_enabled() \
            and x.numel() > cpu_kernels.MAX_ROWS * x.shape[-1] and weight.numel() >= cpu_kernels.MIN_WEIGHT:
        return _widened(x, weight, bias)
    if HAS_ONEDNN and x.dtype == torch.float32 and not x.is_cuda and weight.numel() >= PACK_MIN_WEIGHT \
            and not torch.is_grad_enabled():
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        if not flat.is_contiguous():
            flat = flat.contiguous()
        out = torch.ops.mkldnn._linear_pointwise(flat, weight.contiguous(), bias, "none", [], "")
        return out.view(*shape[:-1], weight.shape[0])
    # As rows: a strided 3-D input (the last position of a prefill) would take bmm's path on the CPU,
    # which copies the whole weight first (600 ms for a 0.5B model's bf16 LM head)
    shape = x.shape
    return F.linear(x.reshape(-1, shape[-1]), weight, bias).view(*shape[:-1], weight.shape[0])


# Rows of a weight widened at a time by `linear_widened` (16 MB of float32 at most): the scratch
# buffer is allocated once and reused, since a fresh one per call costs its page faults (a 9728 x
# 896 weight: 2.6 ms to widen into a reused buffer, 16 ms with `.float()`).
WIDEN_ELEMENTS = 4 * 1024 * 1024
_scratch: dict[str, torch.Tensor] = {}


def linear_widened(x: torch.Tensor, fill_rows, out_f: int, bias: torch.Tensor | None = None,
                   out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """x (..., in) @ W.T (+ bias) for a weight W (out_f, in) that is not float32 in memory (bf16,
    int8 codes): `fill_rows(start, stop, into)` writes rows start:stop of W as float32 into `into`, a
    slice of rows at a time, into a reused buffer; float32 sums, the result in `out_dtype` (x's).
    Inference only: the buffer is overwritten by the next call, so nothing may keep it for a backward."""
    shape = x.shape
    flat = x.reshape(-1, shape[-1]).float()
    in_f = shape[-1]
    out = torch.empty(flat.shape[0], out_f, dtype=out_dtype or x.dtype)
    step = max(1, WIDEN_ELEMENTS // in_f)
    need = min(out_f, step) * in_f
    scratch = _scratch.get("widen")
    if scratch is None or scratch.numel() < need:
        with torch.inference_mode(False):  # a normal tensor: it is written to in and out of inference mode
            scratch = _scratch["widen"] = torch.empty(need)
    for start in range(0, out_f, step):
        stop = min(out_f, start + step)
        wide = scratch[: (stop - start) * in_f].view(stop - start, in_f)
        fill_rows(start, stop, wide)
        out[:, start:stop] = linear(flat, wide, None if bias is None else bias[start:stop].float())
    return out.view(*shape[:-1], out_f)


def _widened(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """A bf16 `linear` over many rows (a prefill, a diffusion block) on a CPU without bf16 matmul
    instructions, where torch's bf16 matmul runs at a quarter of float32's speed (a 0.5B model's
    64-token prefill: 2.6 s against 0.57 in float32; widened, 0.68 s)."""
    return linear_widened(x, lambda start, stop, into: into.copy_(weight[start:stop]), weight.shape[0], bias,
                          torch.bfloat16)


FUSED_WEIGHTS = ("fused", "fused_out", "fused_down")  # the (weight, bias) pairs fuse_linears made (attention, mlp)


def pack_fused_weights(model: torch.nn.Module) -> int:
    """Inference on the CPU: every fused projection weight that `wants_packed`, packed in place; the
    nn.Linear parameters that were views of it become meta tensors of their shape (their storage
    is freed, sizes still count; the packed weight is the only copy). Returns how many were packed."""
    packed = set()
    for module in model.modules():
        for name in FUSED_WEIGHTS:
            fused = getattr(module, name, None)
            if fused is not None and wants_packed(fused[0]):
                packed.add(fused[0].untyped_storage().data_ptr())
                setattr(module, name, (pack(fused[0]), fused[1]))
    for module in model.modules():
        if isinstance(module, torch.nn.Linear) and not module.weight.is_meta \
                and module.weight.untyped_storage().data_ptr() in packed:
            module.weight = torch.nn.Parameter(torch.empty(module.weight.shape, dtype=module.weight.dtype,
                                                           device="meta"), requires_grad=False)
    return len(packed)
