"""Byte-level helpers shared by the block formats: fp16 fields, nibbles and bit planes, on uint8 tensors.

Every helper works on a batch of blocks `[N, ...]` and runs on any device; GGUF is little-endian, as are
the CPUs and GPUs onestream runs on, so fp16 fields are plain reinterpretations of their two bytes.
"""

from __future__ import annotations

import torch


def read_fp16(field: torch.Tensor) -> torch.Tensor:
    """`[N, 2]` bytes -> `[N]` float32."""
    return field.contiguous().view(torch.float16).squeeze(-1).float()


def write_fp16(values: torch.Tensor) -> torch.Tensor:
    """`[N]` float -> `[N, 2]` bytes of its fp16 rounding."""
    return values.to(torch.float16).unsqueeze(-1).view(torch.uint8)


def round_fp16(values: torch.Tensor) -> torch.Tensor:
    """The float32 value a field stores after its fp16 rounding."""
    return values.to(torch.float16).float()


def unpack_bits(packed: torch.Tensor) -> torch.Tensor:
    """`[..., k]` bytes -> `[..., 8k]` of 0/1 (int32), bit i of byte j at index 8j + i."""
    shifts = torch.arange(8, device=packed.device, dtype=torch.int32)
    bits = (packed.to(torch.int32).unsqueeze(-1) >> shifts) & 1
    return bits.flatten(-2)


def pack_bits(bits: torch.Tensor) -> torch.Tensor:
    """Inverse of `unpack_bits`: `[..., 8k]` of 0/1 -> `[..., k]` bytes."""
    shifts = torch.arange(8, device=bits.device, dtype=torch.int32)
    grouped = bits.to(torch.int32).unflatten(-1, (-1, 8)) << shifts
    return grouped.sum(-1).to(torch.uint8)


def low_nibbles(packed: torch.Tensor) -> torch.Tensor:
    return packed.to(torch.int32) & 0xF


def high_nibbles(packed: torch.Tensor) -> torch.Tensor:
    return packed.to(torch.int32) >> 4


def join_nibbles(low: torch.Tensor, high: torch.Tensor) -> torch.Tensor:
    """Two int tensors of values 0-15 -> bytes `low | high << 4`."""
    return (low.to(torch.int32) | (high.to(torch.int32) << 4)).to(torch.uint8)
