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


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x (..., in) @ weight (out, in).T (+ bias) -> (..., out), by the kernel `weight`'s storage says."""
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
    return F.linear(x, weight, bias)
