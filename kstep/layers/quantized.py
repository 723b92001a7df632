"""Weight-only quantization of the linear layers, applied at load time (`--quantize int8|int4`).

int8: symmetric, one scale per output channel; int4: asymmetric, a scale and a minimum per group
of `group_size` input channels, two codes per byte. Activations stay in the compute dtype.

Kernels: torch's packed CPU kernels (`_weight_int8pack_mm`, `_weight_int4pack_mm_for_cpu`, the
ones gpt-fast and torchao call) were measured on this project's CPU at 8-60x slower than the fp32
matmul at our shapes (e.g. 32 x 256 -> 704: fp32 0.2 ms, int8 kernel 12.4 ms, dequantize + fp32
matmul 0.4 ms), so every device takes the fallback: dequantize the layer's weight for each matmul.
The weights rest at 1 (int8) or 0.5 (int4) bytes each, which is what quantization buys here; the
time per pass goes up, not down (see `kstep bench quant`). A GPU with real low-bit kernels would
gain time as well, since decoding there is bound by weight bandwidth.
"""
import torch
import torch.nn.functional as F
from torch import nn


class Int8Linear(nn.Module):
    def __init__(self, linear: nn.Linear):
        super().__init__()
        w = linear.weight.detach().float().contiguous()  # fused weights are transposed views
        scales = (w.abs().amax(dim=1) / 127).clamp(min=1e-12)  # (out,)
        codes = (w / scales[:, None]).round().clamp(-127, 127).to(torch.int8)
        # Stored (in, out), as the float layers (kstep.layers.attention.fuse_linears): x @ W is the
        # faster matmul at decode shapes, and dequantizing keeps the layout.
        self.register_buffer("weight_int8", codes.t().contiguous())
        self.register_buffer("scales", scales.to(linear.weight.dtype)[None, :])  # (1, out)
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach(), requires_grad=False)
        self.out_features, self.in_features = w.shape

    def dequantized(self, dtype: torch.dtype) -> torch.Tensor:
        """The (out, in) weight (a transposed view)."""
        return (self.weight_int8.to(dtype) * self.scales.to(dtype)).t()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = x @ self.dequantized(x.dtype).t()
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
