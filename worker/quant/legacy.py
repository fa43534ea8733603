"""The 32-element block formats (ggml's original quants): Q8_0, Q4_0, Q5_0, Q5_1.

Layouts (little-endian), per block of 32 weights:
- Q8_0: fp16 d, 32 int8 q; w = d q.
- Q4_0: fp16 d, 16 bytes: byte i holds q_i (low nibble) and q_{i+16} (high); w = d (q - 8).
- Q5_0: fp16 d, 4 bytes whose bit j (of the 32-bit word) is bit 4 of q_j, then nibbles as Q4_0; w = d (q - 16).
- Q5_1: fp16 d, fp16 m, then as Q5_0 with unsigned q; w = d q + m.
"""

from __future__ import annotations

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
from .search import fit_affine, fit_symmetric, nearest_affine, nearest_symmetric

HALF = 16


def _nibbles_to_levels(packed: torch.Tensor) -> torch.Tensor:
    """16 bytes -> the 32 low 4-bit levels (element i low nibble of byte i, element i + 16 the high)."""
    return torch.cat((low_nibbles(packed), high_nibbles(packed)), dim=-1)


def _levels_to_nibbles(levels: torch.Tensor) -> torch.Tensor:
    return join_nibbles(levels[:, :HALF] & 0xF, levels[:, HALF:] & 0xF)


def _five_bit_levels(high: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
    return _nibbles_to_levels(packed) | (unpack_bits(high) << 4)


# ---- Q8_0 ----------------------------------------------------------------------------------------------


def dequantize_q8_0(blocks: torch.Tensor) -> torch.Tensor:
    return read_fp16(blocks[:, :2]).unsqueeze(-1) * blocks[:, 2:].view(torch.int8).float()


def quantize_q8_0(x: torch.Tensor) -> torch.Tensor:
    d = fit_symmetric(x, -127, 127, round_fp16)
    q = nearest_symmetric(x, d, -127, 127).to(torch.int8).view(torch.uint8)
    return torch.cat((write_fp16(d), q), dim=-1)


# ---- Q4_0 ----------------------------------------------------------------------------------------------


def dequantize_q4_0(blocks: torch.Tensor) -> torch.Tensor:
    return read_fp16(blocks[:, :2]).unsqueeze(-1) * (_nibbles_to_levels(blocks[:, 2:]) - 8).float()


def quantize_q4_0(x: torch.Tensor) -> torch.Tensor:
    d = fit_symmetric(x, -8, 7, round_fp16)
    levels = nearest_symmetric(x, d, -8, 7).to(torch.int32) + 8
    return torch.cat((write_fp16(d), _levels_to_nibbles(levels)), dim=-1)


# ---- Q5_0 ----------------------------------------------------------------------------------------------


def dequantize_q5_0(blocks: torch.Tensor) -> torch.Tensor:
    levels = _five_bit_levels(blocks[:, 2:6], blocks[:, 6:])
    return read_fp16(blocks[:, :2]).unsqueeze(-1) * (levels - 16).float()


def quantize_q5_0(x: torch.Tensor) -> torch.Tensor:
    d = fit_symmetric(x, -16, 15, round_fp16)
    levels = nearest_symmetric(x, d, -16, 15).to(torch.int32) + 16
    return torch.cat((write_fp16(d), pack_bits(levels >> 4), _levels_to_nibbles(levels)), dim=-1)


# ---- Q5_1 ----------------------------------------------------------------------------------------------


def dequantize_q5_1(blocks: torch.Tensor) -> torch.Tensor:
    d, m = read_fp16(blocks[:, :2]), read_fp16(blocks[:, 2:4])
    levels = _five_bit_levels(blocks[:, 4:8], blocks[:, 8:])
    return d.unsqueeze(-1) * levels.float() + m.unsqueeze(-1)


def quantize_q5_1(x: torch.Tensor) -> torch.Tensor:
    d, m = fit_affine(x, 31, round_fp16, nonpositive_offset=False)
    levels = nearest_affine(x, d, m, 31).to(torch.int32)
    return torch.cat(
        (write_fp16(d), write_fp16(m), pack_bits(levels >> 4), _levels_to_nibbles(levels)), dim=-1
    )
