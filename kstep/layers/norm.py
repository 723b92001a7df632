"""RMSNorm as LLaMA and LLaDA compute it: statistics in float32, scale in the input dtype."""
import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # One fused op for x * rsqrt(mean(x^2) + eps) in float32; both references cast back before the
        # weight multiply, and doing the same keeps bf16 parity.
        return self.weight * F.rms_norm(x.float(), self.weight.shape, eps=self.eps).to(x.dtype)
