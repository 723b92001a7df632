"""Gated feed-forward (Shazeer 2020): down(act(gate(x)) * up(x)); SwiGLU (act = SiLU) unless a
model says otherwise (DiffusionGemma's GeGLU: tanh-approximated GELU)."""
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from kstep.layers.attention import fuse_linears, project


class SwiGLU(nn.Module):
    def __init__(self, d_model: int, hidden: int, bias: bool,
                 activation: Callable[[torch.Tensor], torch.Tensor] = F.silu):
        super().__init__()
        self.activation = activation
        self.gate_proj = nn.Linear(d_model, hidden, bias=bias)
        self.up_proj = nn.Linear(d_model, hidden, bias=bias)
        self.down_proj = nn.Linear(hidden, d_model, bias=bias)
        self.fused: tuple[torch.Tensor, torch.Tensor | None] | None = None
        self.fused_down: tuple[torch.Tensor, torch.Tensor | None] | None = None
        self.fuse_groups = (("gate_proj", "up_proj"),)  # weights.allocate lays these out as `fuse` joins them
        self.reduce: Callable[[torch.Tensor], torch.Tensor] | None = None  # tensor parallel: sum the ranks' units

    def fuse(self) -> None:
        """For inference: gate and up as one matmul, all in the transposed layout (see fuse_linears)."""
        self.fused = fuse_linears(self.gate_proj, self.up_proj)
        self.fused_down = fuse_linears(self.down_proj)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fused is not None and not torch.is_grad_enabled():
            gate, up = project(x, self.fused).chunk(2, dim=-1)
            hidden = self.activation(gate) * up
            out = self.down_proj(hidden) if self.fused_down is None else project(hidden, self.fused_down)
        else:
            out = self.down_proj(self.activation(self.gate_proj(x)) * self.up_proj(x))
        return out if self.reduce is None else self.reduce(out)
