"""Gated full attention of Qwen3.5: q/k RMSNorm per head, partial NeoX RoPE, GQA, sigmoid output gate."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..config import ModelConfig
from ..state import KVCache
from .norms import ZeroCenteredRMSNorm


class RotaryEmbedding:
    """cos/sin tables for the first `rotary_dim` dims of each head (the text-only mrope reduces to 1-D RoPE).

    Not an nn.Module on purpose: `inv_freq` must stay fp32 when the model is cast to bf16/fp16.
    """

    def __init__(self, config: ModelConfig) -> None:
        dim = config.rotary_dim
        self._inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
        self._per_device: dict[torch.device, torch.Tensor] = {}

    def __call__(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin `[len(positions), rotary_dim]` in `dtype` (computed in fp32, as transformers does)."""
        inv_freq = self._per_device.get(positions.device)
        if inv_freq is None:
            inv_freq = self._per_device[positions.device] = self._inv_freq.to(positions.device)
        freqs = positions.float()[:, None] * inv_freq
        cos, sin = freqs.cos(), freqs.sin()
        return torch.cat((cos, cos), -1).to(dtype), torch.cat((sin, sin), -1).to(dtype)


def apply_partial_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE on the leading `cos.shape[-1]` dims of `x [..., T, D]`; the rest pass through."""
    rot = cos.shape[-1]
    x_rot, x_pass = x[..., :rot], x[..., rot:]
    half = rot // 2
    rotated = torch.cat((-x_rot[..., half:], x_rot[..., :half]), -1)
    return torch.cat((x_rot * cos + rotated * sin, x_pass), -1)


class GatedAttention(nn.Module):
    """Full softmax attention; `q_proj` emits `[query | gate]` per head, output is `o_proj(attn * sigmoid(gate))`."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        h, d = config.hidden_size, config.head_dim
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = d
        self.scale = d**-0.5
        self.q_proj = nn.Linear(h, self.num_heads * d * 2, bias=False)
        self.k_proj = nn.Linear(h, self.num_kv_heads * d, bias=False)
        self.v_proj = nn.Linear(h, self.num_kv_heads * d, bias=False)
        self.o_proj = nn.Linear(self.num_heads * d, h, bias=False)
        self.q_norm = ZeroCenteredRMSNorm(d, eps=config.rms_norm_eps)
        self.k_norm = ZeroCenteredRMSNorm(d, eps=config.rms_norm_eps)

    def _project(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """x `[B, T, H]` -> q `[B, nH, T, D]`, k, v `[B, nKV, T, D]`, gate `[B, T, nH*D]`."""
        return self._heads(self.q_proj(x), self.k_proj(x), self.v_proj(x), cos, sin)

    def _heads(
        self, qg: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """The projections `[B, T, *]` -> q `[B, nH, T, D]` and k (normed, rotated), v `[B, nKV, T, D]`, gate."""
        b, t, _ = qg.shape
        d = self.head_dim
        q, gate = qg.view(b, t, self.num_heads, 2 * d).chunk(2, dim=-1)
        q = self.q_norm(q).transpose(1, 2)
        k = self.k_norm(k.view(b, t, self.num_kv_heads, d)).transpose(1, 2)
        v = v.view(b, t, self.num_kv_heads, d).transpose(1, 2)
        return apply_partial_rope(q, cos, sin), apply_partial_rope(k, cos, sin), v, gate.reshape(b, t, -1)

    def _finish(self, attn: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        """attn `[B, nH, T, D]` -> `[B, T, H]`."""
        return self.o_proj(self._gated(attn, gate))

    def _gated(self, attn: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        """attn `[B, nH, T, D]` * sigmoid(gate), heads side by side: `[B, T, nH*D]`."""
        b, _, t, _ = attn.shape
        return attn.transpose(1, 2).reshape(b, t, -1) * torch.sigmoid(gate)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Stateless causal attention over `x [B, T, H]` at positions `0..T-1` (cos/sin `[T, rotary_dim]`)."""
        q, k, v, gate = self._project(x, cos, sin)
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scale, enable_gqa=self._gqa)
        return self._finish(attn, gate)

    def step(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: KVCache, start: int
    ) -> torch.Tensor:
        """Attention of `x [T, H]` at positions `start..start+T-1` over the cache, which it extends."""
        t = x.shape[0]
        q, k, v, gate = self._project(x.unsqueeze(0), cos, sin)
        keys, values = cache.write(start, k[0], v[0])
        mask = None
        if t > 1:
            # query i sits at position start+i and sees keys 0..start+i
            key_pos = torch.arange(start + t, device=x.device)
            query_pos = torch.arange(start, start + t, device=x.device)
            mask = key_pos[None, :] <= query_pos[:, None]
        attn = F.scaled_dot_product_attention(
            q, keys.unsqueeze(0), values.unsqueeze(0), attn_mask=mask, scale=self.scale, enable_gqa=self._gqa
        )
        return self._finish(attn, gate)[0]

    @property
    def _gqa(self) -> bool:
        return self.num_heads != self.num_kv_heads
