"""Weight-only quantization of the linear layers, applied at load time (`--quantize int8|int4`).

int8: symmetric, one scale per output channel; int4: asymmetric, a scale and a minimum per group
of `group_size` input channels, two codes per byte. Activations stay in the compute dtype.

Kernels: int8 on the CPU runs torch's `_weight_int8pack_mm` (the kernel gpt-fast and torchao call)
where the CPU has bf16 instructions (oneDNN's bf16 probe): activations rounded to bf16 (as
llama.cpp's Q8_0 rounds them to 8 bits), the int8 weight read as is. Measured on one 9728 x 896
weight (a 0.5B model's gate/up) called repeatedly: 0.26 ms at one row against 25.5 ms for
dequantizing it to float32 per matmul, 8.7 against 51 ms at 64 rows. Elsewhere (CUDA, a CPU without bf16, int4) every matmul
dequantizes its layer's weight first: the weights rest at 1 (int8) or 0.5 (int4) bytes each, which
is what quantization buys there, and the time per pass goes up (see `kstep bench quant`).
"""
import torch
import torch.nn.functional as F
from torch import nn


def _probe_int8_kernel() -> bool:
    """Whether torch's int8 weight kernel runs here on the CPU with bf16 activations, fast: only
    where the CPU has bf16 instructions (on an AVX2 CPU it was measured 8-60x slower than float32)."""
    try:
        if not torch.ops.mkldnn._is_mkldnn_bf16_supported():
            return False
        out = torch.ops.aten._weight_int8pack_mm(torch.ones(1, 32, dtype=torch.bfloat16),
                                                 torch.ones(8, 32, dtype=torch.int8), torch.ones(8, dtype=torch.bfloat16))
        return bool((out == 32).all())
    except (AttributeError, RuntimeError):
        return False


HAS_INT8_KERNEL = _probe_int8_kernel()


class Int8Linear(nn.Module):
    def __init__(self, linear: nn.Linear):
        super().__init__()
        w = linear.weight.detach().float().contiguous()  # fused weights are transposed views
        scales = (w.abs().amax(dim=1) / 127).clamp(min=1e-12)  # (out,)
        codes = (w / scales[:, None]).round().clamp(-127, 127).to(torch.int8)
        self.register_buffer("weight_int8", codes)  # (out, in): the int8 kernel's layout
        self.register_buffer("scales", scales.to(linear.weight.dtype))  # (out,)
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach(), requires_grad=False)
        self.out_features, self.in_features = w.shape

    def dequantized(self, dtype: torch.dtype) -> torch.Tensor:
        """The (out, in) weight."""
        return self.weight_int8.to(dtype) * self.scales.to(dtype)[:, None]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if HAS_INT8_KERNEL and not x.is_cuda:
            flat = x.reshape(-1, self.in_features).to(torch.bfloat16)
            out = torch.ops.aten._weight_int8pack_mm(flat, self.weight_int8, self.scales.to(torch.bfloat16))
            out = out.to(x.dtype).view(*x.shape[:-1], self.out_features)
        else:
            out = F.linear(x, self.dequantized(x.dtype))
        return out if self.bias is None else out + self.bias


class Int4Linear(nn.Module):
    def __init__(self, linear: nn.Linear, group_size: int = 32):
        super().__init__()
        w = linear.weight.detach().float().contiguous()  # fused weights are transposed views
        out_f, in_f = w.shape
        groups = w.view(out_f, in_f // group_size, group_size)
        low, high = groups.amin(-1, keepdim=True), groups.amax(-1, keepdim=True)
        scale = ((high - low) / 15).clamp(min=1e-12)
        codes = ((groups - low) / scale).round().clamp(0, 15).to(torch.uint8).view(out_f, in_f)
        self.register_buffer("packed", codes[:, 0::2] | (codes[:, 1::2] << 4))  # (out, in/2): two per byte
        self.register_buffer("scale", scale.to(linear.weight.dtype))  # (out, in/g, 1)
        self.register_buffer("low", low.to(linear.weight.dtype))
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach(), requires_grad=False)
        self.out_features, self.in_features, self.group_size = out_f, in_f, group_size

    @staticmethod
    def fits(linear: nn.Linear, group_size: int) -> bool:
        return linear.in_features % group_size == 0 and group_size % 2 == 0

    def dequantized(self, dtype: torch.dtype) -> torch.Tensor:
        codes = torch.stack([self.packed & 15, self.packed >> 4], -1).view(self.out_features, -1, self.group_size)
        w = codes.to(dtype) * self.scale.to(dtype) + self.low.to(dtype)
        return w.view(self.out_features, self.in_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.dequantized(x.dtype), self.bias)


QUANTIZATIONS = ("int8", "int4")


def quantize_model(model: nn.Module, mode: str, group_size: int = 32) -> dict[str, int]:
    """Replace every nn.Linear (attention, MLP, an untied LM head) in place; returns counts per kind.
    A layer int4 cannot take (in_features not a multiple of the group) becomes int8."""
    if mode not in QUANTIZATIONS:
        raise ValueError(f"quantize {mode!r} is not supported (choose from {', '.join(QUANTIZATIONS)})")
    counts = {"int8": 0, "int4": 0}
    for module in model.modules():  # fused float weights would keep the originals alive
        for name in ("fused", "fused_out", "fused_down"):
            if hasattr(module, name):
                setattr(module, name, None)
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if not isinstance(child, nn.Linear):
                continue
            if mode == "int4" and Int4Linear.fits(child, group_size):
                setattr(parent, name, Int4Linear(child, group_size))
                counts["int4"] += 1
            else:
                setattr(parent, name, Int8Linear(child))
                counts["int8"] += 1
    return counts


def model_bytes(model: nn.Module) -> int:
    """Bytes of the weights as held in memory (parameters and buffers, quantized ones included)."""
    tensors = [t for name, t in [*model.named_parameters(), *model.named_buffers()] if not name.startswith("rotary.")]
    return sum(t.numel() * t.element_size() for t in tensors)
