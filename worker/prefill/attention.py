"""Gated full attention over a prompt piece, continuing from the KV cache, through fused SDPA kernels.

The reference (`GatedAttention.step`) passes SDPA an explicit boolean mask, which rules out the flash and
cuDNN kernels; here a piece at position 0 is plain causal attention, and a later piece (a long prompt's next
piece, a session's next turn) attends over the cache with the causal mask aligned to the bottom right
(`causal_lower_right`), which the fused kernels take without a materialised mask.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.bias import causal_lower_right

from ..errors import InvalidRequestError
from ..layers.attention import GatedAttention
from ..state import KVCache
from .elementwise import Elementwise

SDPA_ENV = "ONESTREAM_PREFILL_SDPA"  # pins SDPA's kernel: flash, cudnn, efficient, math, or auto (its choice)
SDPA_BACKENDS = {
    "flash": SDPBackend.FLASH_ATTENTION,
    "cudnn": SDPBackend.CUDNN_ATTENTION,
    "efficient": SDPBackend.EFFICIENT_ATTENTION,
    "math": SDPBackend.MATH,
}


def sdpa_choice(name: str | None = None) -> str:
    name = name or os.environ.get(SDPA_ENV, "auto")
    if name != "auto" and name not in SDPA_BACKENDS:
        raise InvalidRequestError(
            f"SDPA backend must be auto or one of {sorted(SDPA_BACKENDS)}, got {name!r}"
        )
    return name


@contextlib.contextmanager
def sdpa_backend(name: str) -> Iterator[None]:
    """Restrict SDPA to one kernel (an error if it cannot run the shapes), or leave it its choice."""
    if name == "auto":
        yield
        return
    with sdpa_kernel([SDPA_BACKENDS[name]]):
        yield


def expand_kv_heads(x: torch.Tensor, num_heads: int) -> torch.Tensor:
    """`[B, nKV, S, D]` -> `[B, nH, S, D]`, query head h reading key head h // (nH / nKV) (SDPA's GQA).
    Every fused kernel takes equal head counts; not all of them take grouped ones."""
    rep = num_heads // x.shape[1]
    return x if rep == 1 else x.repeat_interleave(rep, dim=1)


def causal_attention(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float, backend: str = "auto"
) -> torch.Tensor:
    """q `[1, nH, T, D]` at the last T of the S positions of keys/values `[1, nKV, S, D]` (S >= T): each query
    sees the keys up to its own position."""
    t, s = q.shape[2], keys.shape[2]
    nh = q.shape[1]
    keys, values = expand_kv_heads(keys, nh), expand_kv_heads(values, nh)
    with sdpa_backend(backend):
        if s == t:
            return F.scaled_dot_product_attention(q, keys, values, is_causal=True, scale=scale)
        mask = causal_lower_right(t, s)
        return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=scale)


def attention_prefill(
    layer: GatedAttention,
    x: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    cache: KVCache,
    start: int,
    ops: Elementwise,
    backend: str = "auto",
) -> torch.Tensor:
    """The mixer over `x [T, H]` (normed) at positions `start..start+T-1`, writing the piece's keys and values
    into `cache` (the layout `GatedAttention.step` and the megakernel read). Returns `[T, H]`. The heads' norms,
    RoPE and output gate are `ops`' (elementwise.py)."""
    x = x.unsqueeze(0)
    q, k, v, gate = ops.attention_heads(layer, layer.q_proj(x), layer.k_proj(x), layer.v_proj(x), cos, sin)
    keys, values = cache.write(start, k[0], v[0])
    if start == 0:  # the fresh keys are the whole context: no need to read them back from the cache
        attn = causal_attention(q, k, v, layer.scale, backend)
    else:
        attn = causal_attention(q, keys.unsqueeze(0), values.unsqueeze(0), layer.scale, backend)
    return layer.o_proj(ops.attention_gate(layer, attn, gate))[0]
