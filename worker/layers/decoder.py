"""One Qwen3.5 decoder layer: pre-norm mixer (full attention or Gated DeltaNet) and pre-norm SwiGLU MLP."""

from __future__ import annotations

import torch
from torch import nn

from ..config import FULL_ATTENTION, ModelConfig
from ..state import KVCache
from .attention import GatedAttention
from .deltanet import GatedDeltaNet
from .mlp import SwiGLU
from .norms import ZeroCenteredRMSNorm

DeltaNetHistory = tuple[torch.Tensor, torch.Tensor]


class DecoderLayer(nn.Module):
    """`h += mixer(input_layernorm(h)); h += mlp(post_attention_layernorm(h))`."""

    def __init__(self, config: ModelConfig, layer_type: str) -> None:
        super().__init__()
        self.is_full_attention = layer_type == FULL_ATTENTION
        if self.is_full_attention:
            self.self_attn = GatedAttention(config)
        else:
            self.linear_attn = GatedDeltaNet(config)
        self.mlp = SwiGLU(config.hidden_size, config.intermediate_size)
        self.input_layernorm = ZeroCenteredRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = ZeroCenteredRMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def _mlp_residual(self, h: torch.Tensor) -> torch.Tensor:
        return h + self.mlp(self.post_attention_layernorm(h))

    def forward(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Stateless: `h [B, T, H]` at positions `0..T-1`."""
        x = self.input_layernorm(h)
        mixed = self.self_attn(x, cos, sin) if self.is_full_attention else self.linear_attn(x)
        return self._mlp_residual(h + mixed)

    def step_attention(
        self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: KVCache, start: int
    ) -> torch.Tensor:
        """One sequence, `h [T, H]` at positions `start..`, extending `cache`."""
        return self._mlp_residual(h + self.self_attn.step(self.input_layernorm(h), cos, sin, cache, start))

    def step_deltanet(
        self, h: torch.Tensor, conv_state: torch.Tensor, recurrent: torch.Tensor, keep_states: bool
    ) -> tuple[torch.Tensor, DeltaNetHistory | None]:
        """One sequence, `h [T, H]`, updating the DeltaNet state in place (see `GatedDeltaNet.step`)."""
        mixed, history = self.linear_attn.step(
            self.input_layernorm(h), conv_state, recurrent, keep_states=keep_states
        )
        return self._mlp_residual(h + mixed), history
