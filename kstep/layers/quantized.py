"""Weight-only quantization of the linear layers, applied at load time (`--quantize int8|int4`).

int8: symmetric, one scale per output channel (a tied LM head gets its own int8 copy of the
embedding); int4: asymmetric, a scale and a minimum per group of `group_size` input channels, two
codes per byte. Activations stay in the compute dtype.

Kernels for int8 on the CPU, by rows:
- up to 4 rows (a decode step): kstep's GEMV (cpu_kernels), the activations rounded to 16 bits per
  block of 256 (llama.cpp's Q8_0 rounds them to 8 bits per 32), the int8 weight read as is; on a
  2-core AVX2 EPYC a 0.5B model's int8 step takes 52 ms against 1,094 ms dequantizing per matmul;
- more rows, where the CPU has bf16 instructions (oneDNN's bf16 probe): torch's
  `_weight_int8pack_mm` (the kernel gpt-fast and torchao call), activations rounded to bf16;
  measured on one 9728 x 896 weight (a 0.5B model's gate/up): 8.7 ms at 64 rows against 51 ms
  dequantizing it per matmul;
- more rows elsewhere: the weight dequantized to float32 a slice at a time into a reused buffer
  (`linear_widened`).
On CUDA, and for int4 everywhere, every matmul dequantizes its layer's weight first: the weights rest
at 1 (int8) or 0.5 (int4) bytes each, which is what quantization buys there, and the time per pass
goes up (see `kstep bench quant`).
"""
from types import SimpleNamespace

import torch
import torch.nn.functional as F
from torch import nn

from kstep.layers import cpu_kernels
from kstep.layers.linear import linear_widened


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
        w = linear.weight.detach()
        with torch.inference_mode(False):  # buffers a later grad-enabled forward may read
            done = cpu_kernels.quantize_int8(w)
            if done is not None:
                codes, scales = done
            else:  # per 64K-row slice: a float32 copy of a whole 150K-row LM head would be a transient 0.5-2 GB
                scales = torch.cat([(part.float().abs().amax(dim=1) / 127).clamp(min=1e-12)
                                    for part in w.split(65536)])
                codes = torch.cat([(part.float() / s[:, None]).round().clamp(-127, 127).to(torch.int8)
                                   for part, s in zip(w.split(65536), scales.split(65536))])
        self.register_buffer("weight_int8", codes)  # (out, in): the int8 kernels' layout
        self.register_buffer("scales", scales.to(linear.weight.dtype))  # (out,)
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach(), requires_grad=False)
        self.out_features, self.in_features = w.shape

    def dequantized(self, dtype: torch.dtype) -> torch.Tensor:
        """The (out, in) weight."""
        return self.weight_int8.to(dtype) * self.scales.to(dtype)[:, None]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not x.is_cuda and cpu_kernels.takes_int8(x, self.weight_int8):  # a decode step's few rows
            return cpu_kernels.gemv_int8(x, self.weight_int8, self.scales, self.bias)
        # torch 2.13's AVX-512 kernel reads past the rows where in_features is not a multiple of 16
        # (a segfault at 2+ rows, measured on a Xeon with AVX-512 BF16): those take the widened path
        if HAS_INT8_KERNEL and not x.is_cuda and self.in_features % 16 == 0:
            flat = x.reshape(-1, self.in_features).to(torch.bfloat16)
            out = torch.ops.aten._weight_int8pack_mm(flat, self.weight_int8, self.scales.to(torch.bfloat16))
            out = out.to(x.dtype).view(*x.shape[:-1], self.out_features)
        elif not x.is_cuda and not torch.is_grad_enabled():  # dequantized a slice at a time into a reused buffer
            out = linear_widened(x, self._fill_rows, self.out_features)
        else:
            out = F.linear(x, self.dequantized(x.dtype))
        return out if self.bias is None else out + self.bias

    def _fill_rows(self, start: int, stop: int, into: torch.Tensor) -> None:
        into.copy_(self.weight_int8[start:stop])
        into.mul_(self.scales[start:stop, None])


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
        if not x.is_cuda and not torch.is_grad_enabled() and \
                cpu_kernels.takes_int4(x, self.packed, self.scale, self.low, self.group_size):  # a decode step's rows
            return cpu_kernels.gemv_int4(x, self.packed, self.scale, self.low, self.bias)
        return F.linear(x, self.dequantized(x.dtype), self.bias)


QUANTIZATIONS = ("int8", "int4")


def quantize_model(model: nn.Module, mode: str, group_size: int = 32) -> dict[str, int]:
    """Replace every nn.Linear (attention, MLP, an untied LM head) in place; returns counts per kind.
    A layer int4 cannot take (in_features not a multiple of the group) becomes int8. A head tied to
    the embedding gets an int8 copy of it as its own head (int4 too, on a CPU) (as llama.cpp's Q8_0 quantizes
    the embedding): a decode step then reads a quarter of the float32 head's bytes (a 0.5B model:
    136 MB against 545), for those 136 MB more memory, since the lookups still read the float rows."""
    if mode not in QUANTIZATIONS:
        raise ValueError(f"quantize {mode!r} is not supported (choose from {', '.join(QUANTIZATIONS)})")
    counts = {"int8": 0, "int4": 0}
    for module in model.modules():  # fused float weights would keep the originals alive
        for name in ("fused", "fused_out", "fused_down"):
            if hasattr(module, name):
                setattr(module, name, None)
        module.__dict__.pop("_cpu_decode", None)  # cpu_decode's description points into them too
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
    embed = getattr(model, "embed", None)
    if getattr(model, "lm_head", False) is None and isinstance(embed, nn.Embedding) and \
            (mode == "int8" or embed.weight.device.type == "cpu"):  # int8 for int4 too on a CPU, whose kernel
        # reads it (llama.cpp's Q4 files keep the embedding in Q8_0 or Q6_K: the head's precision shows)
        model.lm_head = Int8Linear(SimpleNamespace(weight=embed.weight, bias=None))  # the transformer's tied head
        counts["int8"] += 1
    return counts


def model_bytes(model: nn.Module) -> int:
    """Bytes of the weights as held in memory (parameters and buffers, quantized ones included)."""
    tensors = [t for name, t in [*model.named_parameters(), *model.named_buffers()] if not name.startswith("rotary.")]
    return sum(t.numel() * t.element_size() for t in tensors)
