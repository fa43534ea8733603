"""A training-only form of the chunked gated delta rule: same math as the reference, fewer and larger kernels.

The reference (`onestream.worker.layers.deltanet.chunked_delta_rule`) is written for clarity and serving:
per chunk it indexes six `[B, H, N, C, d]` tensors, so autograd's backward of every index allocates and
zero-fills a whole-sequence gradient (quadratic in the number of chunks; on a 2048-token window that is most
of a training step), and its two batched triangular solves are slow on the GPU. Here:

- the unit-lower-triangular system is inverted once per chunk with batched matmuls (block forward
  substitution, 64 -> 32 -> ... -> 1), and both right-hand sides are multiplied by that inverse;
- the state recurrence across chunks is rewritten as S_{i+1} = M_i S_i + C_i with
  M_i = e^{c_C} I - K_end^T W_k and C_i = K_end^T W_v computed for all chunks at once, so the sequential
  loop is one matmul-add per chunk over `unbind` views (one backward node for all chunks);
- outputs and writes use the stacked chunk-start states in two batched matmuls after the loop.

Equal to the reference in exact arithmetic; tests/test_default_model.py checks outputs and gradients.
"""

from __future__ import annotations

import torch
from onestream.worker.layers import deltanet


def unit_lower_inverse(matrix: torch.Tensor) -> torch.Tensor:
    """`(I + L)^-1` for L the strictly lower part of `matrix [..., C, C]` (C a power of two).

    Block forward substitution, batched: diagonal blocks of size s are inverted for every chunk at once,
    then pairs are joined, [[P, 0], [X, Q]]^-1 = [[P^-1, 0], [-Q^-1 X P^-1, Q^-1]], until s = C.
    """
    size_c = matrix.shape[-1]
    if size_c & (size_c - 1):
        raise ValueError(f"chunk size must be a power of two, got {size_c}")
    lead = matrix.shape[:-2]
    lower = matrix.tril(-1)
    inverse = torch.ones(*lead, size_c, 1, 1, dtype=matrix.dtype, device=matrix.device)
    size = 1
    while size < size_c:
        pairs = size_c // (2 * size)
        grid = lower.reshape(*lead, pairs, 2, size, pairs, 2, size)
        # block (second half, first half) of each diagonal 2s-block: [..., pairs, s, s]
        below = torch.diagonal(grid[..., :, 1, :, :, 0, :], dim1=-4, dim2=-2).movedim(-1, -3)
        first, second = inverse[..., 0::2, :, :], inverse[..., 1::2, :, :]
        joined_low = -(second @ below @ first)
        top = torch.cat((first, torch.zeros_like(first)), dim=-1)
        bottom = torch.cat((joined_low, second), dim=-1)
        inverse = torch.cat((top, bottom), dim=-2)
        size *= 2
    return inverse[..., 0, :, :]


def chunked_delta_rule_for_training(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_state: torch.Tensor | None = None,
    chunk: int = deltanet.CHUNK,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Drop-in for `deltanet.chunked_delta_rule` (same arguments, shapes and fp32 results)."""
    b, h, t, dk = k.shape
    dv = v.shape[-1]
    q, k, v, beta, cum, decay = deltanet.split_chunks(q, k, v, g, beta, chunk)
    n = q.shape[2]
    kb = k * beta.unsqueeze(-1)
    inverse = unit_lower_inverse((kb @ k.transpose(-1, -2)) * decay)
    writes_v = inverse @ (v * beta.unsqueeze(-1))  # W_v: the writes if the chunk started from S = 0
    writes_k = inverse @ (kb * cum.exp().unsqueeze(-1))  # W_k: u = W_v - W_k S
    scores = (q @ k.transpose(-1, -2)) * decay
    q_decayed = q * cum.exp().unsqueeze(-1)
    k_end = (k * (cum[..., -1:] - cum).exp().unsqueeze(-1)).transpose(-1, -2)  # [b, h, n, dk, C]
    eye = torch.eye(dk, dtype=q.dtype, device=q.device)
    transition = cum[..., -1].exp()[..., None, None] * eye - k_end @ writes_k  # M_i [b, h, n, dk, dk]
    injection = k_end @ writes_v  # C_i [b, h, n, dk, dv]

    state = q.new_zeros(b, h, dk, dv) if initial_state is None else initial_state.float()
    starts = []
    for step, add in zip(transition.unbind(2), injection.unbind(2), strict=True):
        starts.append(state)
        state = torch.matmul(step, state) + add
    start_states = torch.stack(starts, dim=2)  # S at the start of each chunk [b, h, n, dk, dv]
    u = writes_v - writes_k @ start_states
    out = q_decayed @ start_states + scores @ u
    return out.reshape(b, h, n * chunk, dv)[:, :, :t], state
