"""The matmul every inference projection goes through: `linear(x, weight, bias)` with the weight
kept as nn.Linear keeps it, (out, in), and the kernel chosen for the device and dtype.

On a CPU in float32 it is oneDNN's inner product (`torch.ops.mkldnn._linear_pointwise`, the kernel
torch.compile's CPU backend emits for linear layers) for weights of 1.2M elements and more:
measured 1.1-2.2x faster than MKL's matmul at the few-row shapes of decoding (1-32 rows, a 1.5B
model's projections, weights from DRAM) and no slower at 128 rows (docs/benchmarks.md, "One pass
at real sizes"); smaller weights are stored (in, out) for MKL's `x @ W` (`inference_layout`). Elsewhere (CUDA; bf16/fp16,
which this oneDNN build cannot run on a CPU without AVX-512 BF16) it is `F.linear`, whose bf16 path
wants this (out, in) layout: an (in, out) contiguous bf16 weight is 20-30x slower on an AVX2 CPU.
"""
import torch
import torch.nn.functional as F


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


def wants_in_out(weight: torch.Tensor) -> bool:
    """Whether `linear` runs this (out, in) weight fastest stored transposed, (in, out): a small
    float32 weight on the CPU (MKL's `x @ W`)."""
    return weight.dtype == torch.float32 and not weight.is_cuda and weight.numel() < ONEDNN_MIN_WEIGHT


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
    (or, where the CPU runs oneDNN's bf16, bfloat16) weight on the CPU."""
    dtype_ok = (weight.dtype == torch.float32 and HAS_ONEDNN) or (weight.dtype == torch.bfloat16 and HAS_ONEDNN_BF16)
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
    if HAS_ONEDNN and x.dtype == torch.float32 and not x.is_cuda and weight.numel() >= ONEDNN_MIN_WEIGHT \
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
