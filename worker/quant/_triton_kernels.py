"""The Triton kernels of `triton_dequant.py`, in a module of their own so that importing onestream never
imports triton: this one is imported on the first dequantization on a CUDA device."""

import triton
import triton.language as tl

from .types import QuantType


@triton.jit
def _fp16_at(ptr, offset, mask):  # type: ignore[no-untyped-def]
    """The fp16 field at byte `offset` (little-endian), as fp32: read as bytes, so no alignment is assumed."""
    lo = tl.load(ptr + offset, mask=mask, other=0).to(tl.int32)
    hi = tl.load(ptr + offset + 1, mask=mask, other=0).to(tl.int32)
    return (lo | (hi << 8)).to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _q4_k_kernel(raw, out, n_blocks, BLOCKS: tl.constexpr):  # type: ignore[no-untyped-def]
    # 144 bytes: fp16 d, fp16 dmin, 12 bytes of 6-bit (scale, min) pairs, 128 bytes of nibbles
    block = tl.program_id(0).to(tl.int64) * BLOCKS + tl.arange(0, BLOCKS).to(tl.int64)[:, None]
    e = tl.arange(0, 256)[None, :]
    mask = (block < n_blocks) & (e < 256)
    base = raw + block * 144 + 0 * e  # full-shape pointers, the shape of every mask
    j = e // 32  # sub-block
    low_half = j < 4
    jj = j % 4
    first = tl.load(base + 4 + jj, mask=mask, other=0).to(tl.int32)
    second = tl.load(base + 8 + jj, mask=mask, other=0).to(tl.int32)
    low = tl.load(base + 12 + jj, mask=mask, other=0).to(tl.int32)
    sc = tl.where(low_half, first & 63, (low & 0xF) | ((first >> 6) << 4))
    m = tl.where(low_half, second & 63, (low >> 4) | ((second >> 6) << 4))
    # each 64 weights share 32 bytes: the low nibbles are sub-block 2g, the high ones 2g + 1
    byte = tl.load(base + 16 + 32 * (j // 2) + e % 32, mask=mask, other=0).to(tl.int32)
    q = (byte >> (4 * (j % 2))) & 0xF
    d = _fp16_at(base, 0, mask)
    dmin = _fp16_at(base, 2, mask)
    w = (d * sc.to(tl.float32)) * q.to(tl.float32) - dmin * m.to(tl.float32)
    tl.store(out + block * 256 + e, w.to(out.dtype.element_ty), mask=mask)


@triton.jit
def _q6_k_kernel(raw, out, n_blocks, BLOCKS: tl.constexpr):  # type: ignore[no-untyped-def]
    # 210 bytes: 128 of low nibbles, 64 of 2-bit high parts, 16 int8 scales, fp16 d
    block = tl.program_id(0).to(tl.int64) * BLOCKS + tl.arange(0, BLOCKS).to(tl.int64)[:, None]
    e = tl.arange(0, 256)[None, :]
    mask = (block < n_blocks) & (e < 256)
    base = raw + block * 210 + 0 * e
    half = e // 128
    k = (e % 128) // 32
    lane = e % 32
    low_byte = tl.load(base + 64 * half + 32 * (k % 2) + lane, mask=mask, other=0).to(tl.int32)
    low = tl.where(k < 2, low_byte & 0xF, low_byte >> 4)
    high_byte = tl.load(base + 128 + 32 * half + lane, mask=mask, other=0).to(tl.int32)
    q = low | (((high_byte >> (2 * k)) & 3) << 4)
    sc = tl.load(base + 192 + e // 16, mask=mask, other=0).to(tl.int32)
    sc = tl.where(sc >= 128, sc - 256, sc)  # int8
    d = _fp16_at(base, 208, mask)
    w = (d * sc.to(tl.float32)) * (q - 32).to(tl.float32)
    tl.store(out + block * 256 + e, w.to(out.dtype.element_ty), mask=mask)


@triton.jit
def _q8_0_kernel(raw, out, n_blocks, BLOCKS: tl.constexpr):  # type: ignore[no-untyped-def]
    # 34 bytes: fp16 d, 32 int8
    block = tl.program_id(0).to(tl.int64) * BLOCKS + tl.arange(0, BLOCKS).to(tl.int64)[:, None]
    e = tl.arange(0, 32)[None, :]
    mask = (block < n_blocks) & (e < 32)
    base = raw + block * 34 + 0 * e
    q = tl.load(base + 2 + e, mask=mask, other=0).to(tl.int32)
    q = tl.where(q >= 128, q - 256, q)
    d = _fp16_at(base, 0, mask)
    w = d * q.to(tl.float32)
    tl.store(out + block * 32 + e, w.to(out.dtype.element_ty), mask=mask)


KERNELS = {
    QuantType.Q4_K: _q4_k_kernel,
    QuantType.Q6_K: _q6_k_kernel,
    QuantType.Q8_0: _q8_0_kernel,
}


def launch(qtype: QuantType, raw, out, n_blocks: int, blocks: int) -> None:  # type: ignore[no-untyped-def]
    KERNELS[qtype][(triton.cdiv(n_blocks, blocks),)](raw, out, n_blocks, BLOCKS=blocks)
