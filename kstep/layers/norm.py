"""RMSNorm as LLaMA and LLaDA compute it: statistics in float32, scale in the input dtype."""
import torch
import torch.nn.functional as F
from torch import nn

from kstep.layers import cpu_kernels


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not x.is_cuda and cpu_kernels.takes_norm(x, self.weight):  # a decode step's few wide rows
            return cpu_kernels.rms_norm(x, self.weight, self.eps)[1]
        if x.dtype == torch.float32 and self.weight.dtype == torch.float32:
            # the weight inside the one op: bit-identical to the multiply after it in float32, and one
            # dispatch instead of two (a 0.5B model's decode step runs 49 norms)
            return F.rms_norm(x, self.weight.shape, self.weight, eps=self.eps)
        # One fused op for x * rsqrt(mean(x^2) + eps) in float32; both references cast back before the
        # weight multiply, and doing the same keeps bf16 parity.
        return self.weight * F.rms_norm(x.float(), self.weight.shape, eps=self.eps).to(x.dtype)


def add_rms_norm(x: torch.Tensor, delta: torch.Tensor, norm: RMSNorm) -> tuple[torch.Tensor, torch.Tensor]:
    """(x + delta, norm(x + delta)): a block's residual add and the norm after it, one call on a
    decode step's rows where the CPU kernel takes them."""
    if not x.is_cuda and isinstance(norm, RMSNorm) and cpu_kernels.takes_norm(x, norm.weight):
        return cpu_kernels.rms_norm(x, norm.weight, norm.eps, delta)
    total = x + delta
    return total, norm(total)
