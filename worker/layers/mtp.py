"""The multi-token-prediction head: fuses the next token's embedding with the main model's post-norm hidden
state, then runs one full-attention decoder layer (vLLM's convention; see docs/ and qwen3_5.md)."""

from __future__ import annotations

import torch
from torch import nn

from ..config import FULL_ATTENTION, ModelConfig
from .decoder import DecoderLayer
from .norms import ZeroCenteredRMSNorm


class MTPHead(nn.Module):
    """Parameters named as in checkpoints: `fc`, `pre_fc_norm_embedding`, `pre_fc_norm_hidden`, `layers.0`, `norm`."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        h, eps = config.hidden_size, config.rms_norm_eps
        self.fc = nn.Linear(2 * h, h, bias=False)
        self.pre_fc_norm_embedding = ZeroCenteredRMSNorm(h, eps=eps)
        self.pre_fc_norm_hidden = ZeroCenteredRMSNorm(h, eps=eps)
        self.layers = nn.ModuleList(
            [DecoderLayer(config, FULL_ATTENTION) for _ in range(config.mtp_num_hidden_layers)]
        )
        self.norm = ZeroCenteredRMSNorm(h, eps=eps)

    @property
    def layer(self) -> DecoderLayer:
        return self.layers[0]  # type: ignore[return-value]

    def fuse(self, embeds: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """`fc(cat(norm(embedding), norm(hidden)))`, embedding half first."""
        return self.fc(
            torch.cat((self.pre_fc_norm_embedding(embeds), self.pre_fc_norm_hidden(hidden)), dim=-1)
        )
