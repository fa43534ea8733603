"""The K-quant super-block formats: Q4_K, Q5_K, Q6_K (256 weights per block).

Layouts (little-endian), per super-block of 256 weights:
- Q4_K: fp16 d, fp16 dmin, 12 bytes of eight 6-bit (scale, min) pairs, 128 bytes of nibbles. Sub-block j
  (32 weights) is w = d sc_j q - dmin m_j, q in 0..15. The 12 bytes: bytes 0-3 hold sc_0..3 in their low 6
  bits, bytes 4-7 m_0..3; sub-blocks 4-7 keep their low nibbles in bytes 8-11 (sc low, m high) and their
  top 2 bits in the top bits of bytes 0-3 (sc) and 4-7 (m). Each 64 weights share 32 bytes of nibbles:
  the low nibbles are the first 32 weights, the high nibbles the next 32.
- Q5_K: as Q4_K with q in 0..31; 32 bytes after the scales hold bit 4: bit k of byte l is weight 32k + l.
- Q6_K: 128 bytes of low nibbles, 64 bytes of 2-bit high parts, 16 int8 scales, fp16 d. Sub-block j (16
  weights) is w = d sc_j (q - 32), q in 0..63. Each half (128 weights) has 64 low-nibble bytes and 32
  high bytes: weight 32k + l of the half (k = 0..3) has its low nibble in byte 32 (k % 2) + l (low nibble
  for k < 2, high for k >= 2) and its high part in bits 2k, 2k+1 of high byte l.

Quantizing: each sub-block's scale (and min) is searched in floats (search.py), the super-block's fp16
scales are set from the largest, the 6/8-bit sub-block scales rounded against them, and then each sub-block
tries its rounded scale (and min) one step up and down, keeping what fits its weights best.
"""

from __future__ import annotations

import itertools

import torch

from .bits import (
    high_nibbles,
    join_nibbles,
    low_nibbles,
    pack_bits,
    read_fp16,
    round_fp16,
    unpack_bits,
    write_fp16,
)
from .search import (
    fit_affine,
    fit_symmetric,
    identity,
    keep_better,
    nearest_affine,
    nearest_symmetric,
    safe_reciprocal,
    squared_error,
)

SUPER = 256
SCALE_MAX = 63  # the 6-bit sub-block scales and mins of Q4_K / Q5_K
STEPS = (-1, 0, 1)


# ---- Q4_K / Q5_K shared parts ---------------------------------------------------------------------------


def _unpack_scales(packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """12 bytes -> (sc, m), each `[N, 8]` int32."""
    p = packed.to(torch.int32)
    first, second, low = p[:, 0:4], p[:, 4:8], p[:, 8:12]
    sc = torch.cat((first & 63, (low & 0xF) | ((first >> 6) << 4)), dim=-1)
    m = torch.cat((second & 63, (low >> 4) | ((second >> 6) << 4)), dim=-1)
    return sc, m


def _pack_scales(sc: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    first = sc[:, :4] | ((sc[:, 4:] >> 4) << 6)
    second = m[:, :4] | ((m[:, 4:] >> 4) << 6)
    low = (sc[:, 4:] & 0xF) | ((m[:, 4:] & 0xF) << 4)
    return torch.cat((first, second, low), dim=-1).to(torch.uint8)


def _low_levels(packed: torch.Tensor) -> torch.Tensor:
    """128 bytes -> `[N, 8, 32]` low 4-bit levels per sub-block."""
    chunks = packed.unflatten(-1, (4, 32))
    return torch.stack((low_nibbles(chunks), high_nibbles(chunks)), dim=2).flatten(1, 2)


def _pack_low_levels(levels: torch.Tensor) -> torch.Tensor:
    pairs = (levels & 0xF).unflatten(1, (4, 2))
    return join_nibbles(pairs[:, :, 0], pairs[:, :, 1]).flatten(1)


def _dequantize_affine(blocks: torch.Tensor, levels: torch.Tensor) -> torch.Tensor:
    d, dmin = read_fp16(blocks[:, 0:2]), read_fp16(blocks[:, 2:4])
    sc, m = _unpack_scales(blocks[:, 4:16])
    scale = (d.unsqueeze(-1) * sc.float()).unsqueeze(-1)
    offset = (dmin.unsqueeze(-1) * m.float()).unsqueeze(-1)
    return (scale * levels.float() - offset).flatten(1)


def _fit_affine_super(
    x: torch.Tensor, qmax: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """`x [N, 256]` -> (d, dmin `[N]`, sc, m `[N, 8]` int32, levels `[N, 8, 32]` int32)."""
    sub = x.unflatten(-1, (8, 32))
    s, b = fit_affine(sub, qmax, identity, nonpositive_offset=True)
    mins = -b
    d = round_fp16(s.amax(-1) / SCALE_MAX)
    dmin = round_fp16(mins.amax(-1) / SCALE_MAX)
    sc = (s * safe_reciprocal(d).unsqueeze(-1)).round().clamp(0, SCALE_MAX)
    m = (mins * safe_reciprocal(dmin).unsqueeze(-1)).round().clamp(0, SCALE_MAX)
    best: tuple[torch.Tensor, ...] = (torch.full_like(s, float("inf")), sc, m)
    for step_sc, step_m in itertools.product(STEPS, STEPS):
        try_sc = (sc + step_sc).clamp(0, SCALE_MAX)
        try_m = (m + step_m).clamp(0, SCALE_MAX)
        scale = d.unsqueeze(-1) * try_sc
        offset = -(dmin.unsqueeze(-1) * try_m)
        err = squared_error(sub, scale, nearest_affine(sub, scale, offset, qmax), offset)
        best = keep_better(best, err, (try_sc, try_m))
    _, sc, m = best
    scale = d.unsqueeze(-1) * sc
    offset = -(dmin.unsqueeze(-1) * m)
    levels = nearest_affine(sub, scale, offset, qmax).to(torch.int32)
    return d, dmin, sc.to(torch.int32), m.to(torch.int32), levels


# ---- Q4_K ----------------------------------------------------------------------------------------------


def dequantize_q4_k(blocks: torch.Tensor) -> torch.Tensor:
    return _dequantize_affine(blocks, _low_levels(blocks[:, 16:144]))


def quantize_q4_k(x: torch.Tensor) -> torch.Tensor:
    d, dmin, sc, m, levels = _fit_affine_super(x, 15)
    return torch.cat((write_fp16(d), write_fp16(dmin), _pack_scales(sc, m), _pack_low_levels(levels)), dim=-1)


# ---- Q5_K ----------------------------------------------------------------------------------------------


def _high_bits(packed: torch.Tensor) -> torch.Tensor:
    """32 bytes -> `[N, 8, 32]` bit 4 of each level (bit k of byte l is weight 32k + l)."""
    return unpack_bits(packed).unflatten(-1, (32, 8)).transpose(1, 2)


def dequantize_q5_k(blocks: torch.Tensor) -> torch.Tensor:
    levels = _low_levels(blocks[:, 48:176]) | (_high_bits(blocks[:, 16:48]) << 4)
    return _dequantize_affine(blocks, levels)


def quantize_q5_k(x: torch.Tensor) -> torch.Tensor:
    d, dmin, sc, m, levels = _fit_affine_super(x, 31)
    high = pack_bits((levels >> 4).transpose(1, 2).flatten(1))
    return torch.cat(
        (write_fp16(d), write_fp16(dmin), _pack_scales(sc, m), high, _pack_low_levels(levels)), dim=-1
    )


# ---- Q6_K ----------------------------------------------------------------------------------------------


def dequantize_q6_k(blocks: torch.Tensor) -> torch.Tensor:
    low = blocks[:, :128].unflatten(-1, (2, 2, 32))  # [N, half, k % 2, l]
    low = torch.cat((low_nibbles(low), high_nibbles(low)), dim=2)  # [N, half, k, l]
    high = blocks[:, 128:192].unflatten(-1, (2, 1, 32)).to(torch.int32)
    shifts = torch.arange(0, 8, 2, device=blocks.device, dtype=torch.int32).view(1, 1, 4, 1)
    levels = (low | (((high >> shifts) & 3) << 4)).reshape(-1, 16, 16)
    scales = blocks[:, 192:208].view(torch.int8).float()
    d = read_fp16(blocks[:, 208:210])
    return ((d.unsqueeze(-1) * scales).unsqueeze(-1) * (levels - 32).float()).flatten(1)


def quantize_q6_k(x: torch.Tensor) -> torch.Tensor:
    sub = x.unflatten(-1, (16, 16))
    s = fit_symmetric(sub, -32, 31, identity)
    peak = s.gather(-1, s.abs().argmax(-1, keepdim=True)).squeeze(-1)
    d = round_fp16(peak / -128)
    sc = (s * safe_reciprocal(d).unsqueeze(-1)).round().clamp(-128, 127)
    best: tuple[torch.Tensor, ...] = (torch.full_like(s, float("inf")), sc)
    for step in STEPS:
        try_sc = (sc + step).clamp(-128, 127)
        scale = d.unsqueeze(-1) * try_sc
        err = squared_error(sub, scale, nearest_symmetric(sub, scale, -32, 31))
        best = keep_better(best, err, (try_sc,))
    sc = best[1]
    levels = (nearest_symmetric(sub, d.unsqueeze(-1) * sc, -32, 31).to(torch.int32) + 32).reshape(
        -1, 2, 4, 32
    )
    low = levels & 0xF
    packed_low = join_nibbles(low[:, :, :2], low[:, :, 2:]).flatten(1)
    high = levels >> 4
    packed_high = (high[:, :, 0] | (high[:, :, 1] << 2) | (high[:, :, 2] << 4) | (high[:, :, 3] << 6)).to(
        torch.uint8
    )
    scales = sc.to(torch.int8).view(torch.uint8)
    return torch.cat((packed_low, packed_high.flatten(1), scales, write_fp16(d)), dim=-1)
