"""A linear layer whose stored columns are a permutation of ours: llama.cpp stores `ssm_out`'s value heads in
tiled order, and a K-quant block spans two heads, so the blocks cannot be permuted back; the layer keeps the
file's columns and permutes its input instead (exact: the same products, summed in another order)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ..quant import QuantizedLinear, QuantizedWeight


@dataclass(frozen=True)
class PermutedInputWeight:
    """`weight`'s columns are ours permuted: our layer computes `weight @ x[..., index]`."""

    weight: QuantizedWeight
    index: torch.Tensor

    @property
    def nbytes(self) -> int:
        return self.weight.nbytes


class PermutedInputLinear(nn.Module):
    def __init__(
        self, weight: PermutedInputWeight, dtype: torch.dtype, dequantize_once: bool = False
    ) -> None:
        super().__init__()
        self.inner = QuantizedLinear(weight.weight, dtype, dequantize_once=dequantize_once)
        self.out_features, self.in_features = weight.weight.shape
        self.register_buffer("index", weight.index, persistent=False)

    @property
    def weight(self) -> torch.Tensor:
        """Our weight (columns in our order) in the compute dtype, dequantized now."""
        return self.inner.weight.index_select(1, torch.argsort(self.index))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x.index_select(-1, self.index))
