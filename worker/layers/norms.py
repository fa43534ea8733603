"""The two RMSNorms of Qwen3.5, computed in fp32 exactly as transformers does."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class ZeroCenteredRMSNorm(nn.Module):
    """`x * rsqrt(mean(x^2) + eps) * (1 + w)` in fp32, cast back; `w` is stored zero-centred."""

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (xf * (1.0 + self.weight.float())).to(x.dtype)


class GatedRMSNorm(nn.Module):
    """DeltaNet output norm: plain weight (initialised to ones), then `* silu(gate)`.

    The cast order follows transformers: normalise in fp32, cast to the input dtype, scale by the weight in
    that dtype, multiply by the fp32 gate, cast back.
    """

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        y = self.weight * xf.to(dtype)
        return (y * F.silu(gate.float())).to(dtype)
