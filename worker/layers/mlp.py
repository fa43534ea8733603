"""SwiGLU feed-forward block."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class SwiGLU(nn.Module):
    """`down(silu(gate(x)) * up(x))`, no biases."""

    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate = self.gate_proj(x)
        if torch.is_grad_enabled():
            return self.down_proj(F.silu(gate) * self.up_proj(x))
        # Without autograd the silu and the product run in place: one [*, intermediate] tensor fewer at a long
        # prefill's peak, with the same roundings (the same bits).
        return self.down_proj(F.silu(gate, inplace=True).mul_(self.up_proj(x)))
