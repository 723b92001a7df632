"""RMSNorm as LLaMA and LLaDA compute it: statistics in float32, scale in the input dtype."""
import torch
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        in_dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        # Both references cast back before the weight multiply; doing the same keeps bf16 parity.
        return self.weight * x32.to(in_dtype)
