"""The device layout of block-quantized weights: GGUF blocks repacked, losslessly, in the order the GEMV lanes
consume them.

Every format is cut into *units* of 32 consecutive elements of a row (one Q4_K / Q5_K sub-block, one 32-block of
Q8_0 / Q4_0 / Q5_0 / Q5_1, two 16-element sub-blocks of Q6_K): a GEMV lane multiplies whole units, and the 32
lanes of a warp read 32 consecutive units of a row with one 16-byte load each. A tensor `[rows, K]` becomes
`[rows, row_stride]` uint8: each row holds its *planes* one after another (`row_layout`: offsets that depend on
K only, so the kernel finds a row's planes from its index), the row padded to 16 bytes:

- nibble plane (all 4- and 5-bit formats, and Q6_K's low 4 bits), 16 bytes per unit: byte b holds elements 2b
  (low nibble) and 2b + 1 (high), so u32 word j holds elements 8j..8j+7 at bits 4i.
- high-bit plane (Q5_K, Q5_0, Q5_1), 4 bytes per unit: bit e of the u32 is bit 4 of element e's level.
- Q6_K high plane, 8 bytes per unit: the 2 high bits of element e at bits 2 (e % 16) of u32 word e / 16.
- Q8_0 plane, 32 bytes per unit: byte e is the int8 level of element e plus 128 (stored as q ^ 0x80, so that
  the kernel extracts an unsigned byte).
- scales: Q4_K / Q5_K keep 16 bytes per super-block: fp16 d, fp16 dmin, then byte 4 + j = sc_j | (m_j & 3) << 6
  and nibble j of bytes 12..15 = m_j >> 2 (the same 12 bytes as GGUF's, without its split of sub-blocks 0-3 and
  4-7); Q6_K two int8 scales per unit and fp16 d per super-block; Q8_0 / Q4_0 / Q5_0 fp16 d per unit; Q5_1 fp16
  d and fp16 m per unit.

Within a unit, the per-element planes (nibbles, high bits, Q8_0 bytes) are cut into four 8-element groups, and
slot G of unit v holds group G ^ r(v), r(v) = (v >> 1) & 3 (`group_slot_xor`; Q6_K's two per-16 scales swap with
their halves, slot h holding half h ^ (r(v) >> 1)). The kernel reads the input of slot G at group G ^ r(v): lane l
multiplies unit v = base + l, whose 32 staged inputs lie 64 bytes from its neighbour's, so without the swizzle
the 8 lanes of one 16-byte shared-memory wavefront would read only 2 of its 8 bank quads (a 4-way conflict on every
input load); with it they read all 8. The XOR keeps the halves {0, 1} and {2, 3} together, so per-16 sums and
scales only swap.

The planes hold exactly the file's bytes in another order (the padding at a row's end is never read), so a GEMV
streams no more bytes per token than the file holds. `read_repacked` is the pure-torch reader of this layout:
its values are bit-for-bit worker/quant's `dequantize` (the tests check it), and the kernel computes each weight
with the same float operations.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from onestream.worker.quant import QuantType
from onestream.worker.quant.bits import read_fp16
from onestream.worker.quant.kquants import _high_bits, _low_levels, _unpack_scales
from onestream.worker.quant.legacy import _nibbles_to_levels
from onestream.worker.quant.types import QuantShapeError

UNIT = 32  # elements per unit
SUPER = 256  # elements per K-quant super-block
ROW_ALIGN = 16

# Bytes per unit (or per super-block: "/super") of each plane, in buffer order.
PLANES: dict[QuantType, tuple[tuple[str, int, bool], ...]] = {
    # (name, bytes, per super-block)
    QuantType.Q4_K: (("nib", 16, False), ("head", 16, True)),
    QuantType.Q5_K: (("nib", 16, False), ("high", 4, False), ("head", 16, True)),
    QuantType.Q6_K: (("nib", 16, False), ("high2", 8, False), ("sc", 2, False), ("d", 2, True)),
    QuantType.Q8_0: (("q8", 32, False), ("d", 2, False)),
    QuantType.Q4_0: (("nib", 16, False), ("d", 2, False)),
    QuantType.Q5_0: (("nib", 16, False), ("high", 4, False), ("d", 2, False)),
    QuantType.Q5_1: (("nib", 16, False), ("high", 4, False), ("dm", 4, False)),
}
# The kernel's format codes (kernels/gemv_quant.cuh QF_*); 0 is bf16.
FORMAT_CODES: dict[QuantType, int] = {
    QuantType.Q4_K: 1,
    QuantType.Q5_K: 2,
    QuantType.Q6_K: 3,
    QuantType.Q8_0: 4,
    QuantType.Q4_0: 5,
    QuantType.Q5_0: 6,
    QuantType.Q5_1: 7,
}
REPACKED_TYPES = tuple(PLANES)
# The per-unit planes whose bytes are cut into slots (gemv_quant.cuh q_slot_xor): 4 groups of 8 elements, or
# (Q6_K's scales) 2 halves of 16.
SLOTTED: dict[str, int] = {"nib": 4, "high": 4, "high2": 4, "q8": 4, "sc": 2}


def group_slot_xor(units: torch.Tensor) -> torch.Tensor:
    """r(v) of units `v` (their indices in the row): slot G of unit v holds its group G ^ r(v) (gemv_quant.cuh
    q_slot_xor)."""
    return (units >> 1) & 3


@dataclass(frozen=True)
class RepackedWeight:
    """A `[rows, K]` weight of `qtype` in the device layout: `data` is `[rows, row_stride]` uint8."""

    qtype: QuantType
    shape: tuple[int, int]
    data: torch.Tensor

    @property
    def streamed_bytes(self) -> int:
        """Bytes a GEMV reads for the whole tensor (the planes without the rows' padding)."""
        return self.qtype.nbytes(self.shape)


def row_layout(qtype: QuantType, k: int) -> tuple[tuple[int, ...], int]:
    """Byte offsets of the planes within a row of `k` elements, and the row stride (gemv_quant.cuh mirrors it)."""
    check_shape(qtype, 1, k)
    offsets, at = [], 0
    for _, nbytes, per_super in PLANES[qtype]:
        offsets.append(at)
        at += plane_row_bytes(k, nbytes, per_super)
    return tuple(offsets), -(-at // ROW_ALIGN) * ROW_ALIGN


def plane_row_bytes(k: int, nbytes: int, per_super: bool) -> int:
    return (k // SUPER if per_super else k // UNIT) * nbytes


def check_shape(qtype: QuantType, rows: int, k: int) -> None:
    if qtype not in PLANES:
        raise QuantShapeError(f"{qtype.name} weights have no device layout (repacked: {_names()})")
    if rows < 0 or k <= 0 or k % qtype.block_size:
        raise QuantShapeError(f"{qtype.name} rows are whole {qtype.block_size}-blocks: got [{rows}, {k}]")


def _names() -> str:
    return ", ".join(t.name for t in PLANES)


# ---- packing helpers ------------------------------------------------------------------------------------


def _pack_nibbles(levels: torch.Tensor) -> torch.Tensor:
    """`[N, E]` levels (low 4 bits used) -> `[N, E / 2]` bytes, element 2b low, 2b + 1 high."""
    low = (levels & 0xF).to(torch.int32)
    return (low[:, 0::2] | (low[:, 1::2] << 4)).to(torch.uint8)


def _unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    p = packed.to(torch.int32)
    return torch.stack((p & 0xF, p >> 4), dim=-1).flatten(-2)


def _pack_u32_bits(values: torch.Tensor, bits: int) -> torch.Tensor:
    """`[N, E]` values of `bits` bits -> little-endian u32 words, 32 / bits values per word, as bytes."""
    per = 32 // bits
    v = values.to(torch.int64).unflatten(-1, (-1, per))
    shifts = torch.arange(per, device=values.device, dtype=torch.int64) * bits
    words = (v << shifts).sum(-1)  # disjoint bit fields: the sum is the OR
    out = torch.stack([(words >> (8 * b)) & 0xFF for b in range(4)], dim=-1)
    return out.to(torch.uint8).flatten(-2)


def _unpack_u32_bits(packed: torch.Tensor, bits: int) -> torch.Tensor:
    b = packed.to(torch.int64).unflatten(-1, (-1, 4))
    words = b[..., 0] | (b[..., 1] << 8) | (b[..., 2] << 16) | (b[..., 3] << 24)
    per = 32 // bits
    shifts = torch.arange(per, device=packed.device, dtype=torch.int64) * bits
    return ((words.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)).flatten(-2).to(torch.int32)


def _fp16_bytes(field: torch.Tensor) -> torch.Tensor:
    """`[N, 2]` bytes of an fp16 field, kept as they are (the repacking moves bits, never converts)."""
    return field.contiguous()


def _swizzle(plane: torch.Tensor, units: int, slots: int) -> torch.Tensor:
    """`[..., N, n]` bytes of N = rows * `units` consecutive units -> the same with slot G of unit v holding
    the unit's part G ^ r(v) (of `slots` equal parts). An involution: it also undoes itself."""
    shape = plane.shape
    parts = plane.reshape(-1, units, slots, shape[-1] // slots)
    v = torch.arange(units, device=plane.device)
    r = group_slot_xor(v) >> (0 if slots == 4 else 1)
    order = torch.arange(slots, device=plane.device).unsqueeze(0) ^ r.unsqueeze(1)  # [units, slots]
    return parts[:, v.unsqueeze(1), order].reshape(shape)


# ---- repacking ------------------------------------------------------------------------------------------


# Weights repacked at a time: the packers' int32 / int64 temporaries stay about 0.5 GB.
REPACK_CHUNK_ELEMENTS = 1 << 24


def repack(
    qtype: QuantType | int | str,
    raw: torch.Tensor,
    shape: tuple[int, int],
    *,
    chunk_elements: int = REPACK_CHUNK_ELEMENTS,
) -> RepackedWeight:
    """GGUF bytes `raw` of a `[rows, K]` weight -> the device layout (on `raw`'s device).

    Rows go `chunk_elements` weights at a time into the one output tensor: the packers' temporaries (int32
    levels, int64 bit words: some 30 bytes per weight) are bounded by a chunk, not by the tensor (a 248k-row
    lm_head would need some 30 GB of them at once)."""
    qtype = QuantType.of(qtype)
    rows, k = (int(n) for n in shape)
    check_shape(qtype, rows, k)
    if raw.dtype != torch.uint8 or raw.numel() != qtype.nbytes((rows, k)):
        raise QuantShapeError(
            f"{qtype.name} weight [{rows}, {k}] needs {qtype.nbytes((rows, k))} uint8 bytes, got {raw.numel()}"
        )
    offsets, stride = row_layout(qtype, k)
    data = torch.empty((rows, stride), dtype=torch.uint8, device=raw.device)
    data[:, offsets[-1] + plane_row_bytes(k, *PLANES[qtype][-1][1:]) :] = 0  # the rows' padding
    table = raw.reshape(rows, -1)
    step = max(1, chunk_elements // k)
    for r0 in range(0, rows, step):
        _repack_rows(qtype, table[r0 : r0 + step], k, offsets, data[r0 : r0 + step])
    return RepackedWeight(qtype, (rows, k), data)


def _repack_rows(
    qtype: QuantType, raw_rows: torch.Tensor, k: int, offsets: tuple[int, ...], out: torch.Tensor
) -> None:
    """GGUF rows `raw_rows` (`[n, row bytes]`) into their device-layout rows `out` (`[n, row stride]`)."""
    rows = raw_rows.shape[0]
    planes = _PACKERS[qtype](raw_rows.reshape(-1, qtype.type_size))
    for name, slots in SLOTTED.items():
        if name in planes:
            planes[name] = _swizzle(planes[name], k // UNIT, slots)
    for (name, nbytes, per_super), at in zip(PLANES[qtype], offsets, strict=True):
        width = plane_row_bytes(k, nbytes, per_super)
        plane = planes.pop(name).reshape(rows, -1)
        assert plane.shape[1] == width, (qtype, name, plane.shape, width)
        out[:, at : at + width] = plane


def _pack_kquant_head(blocks: torch.Tensor) -> torch.Tensor:
    """Q4_K / Q5_K super-block header: d, dmin, then the (sc, m) pairs in the kernel's order (16 bytes)."""
    sc, m = _unpack_scales(blocks[:, 4:16])
    low = (sc | ((m & 3) << 6)).to(torch.uint8)
    high = _pack_nibbles(m >> 2)
    return torch.cat((_fp16_bytes(blocks[:, 0:4]), low, high), dim=-1)


def _pack_q4_k(blocks: torch.Tensor) -> dict[str, torch.Tensor]:
    levels = _low_levels(blocks[:, 16:144]).reshape(-1, UNIT)
    return {"nib": _pack_nibbles(levels), "head": _pack_kquant_head(blocks)}


def _pack_q5_k(blocks: torch.Tensor) -> dict[str, torch.Tensor]:
    levels = (_low_levels(blocks[:, 48:176]) | (_high_bits(blocks[:, 16:48]) << 4)).reshape(-1, UNIT)
    return {
        "nib": _pack_nibbles(levels),
        "high": _pack_u32_bits(levels >> 4, 1),
        "head": _pack_kquant_head(blocks),
    }


def _q6_k_levels(blocks: torch.Tensor) -> torch.Tensor:
    """`[N, 256]` levels 0..63 (as worker/quant's dequantize_q6_k reads them)."""
    low = blocks[:, :128].unflatten(-1, (2, 2, 32))
    low = torch.cat((low.to(torch.int32) & 0xF, low.to(torch.int32) >> 4), dim=2)
    high = blocks[:, 128:192].unflatten(-1, (2, 1, 32)).to(torch.int32)
    shifts = torch.arange(0, 8, 2, device=blocks.device, dtype=torch.int32).view(1, 1, 4, 1)
    return (low | (((high >> shifts) & 3) << 4)).reshape(-1, SUPER)


def _pack_q6_k(blocks: torch.Tensor) -> dict[str, torch.Tensor]:
    levels = _q6_k_levels(blocks).reshape(-1, UNIT)
    return {
        "nib": _pack_nibbles(levels),
        "high2": _pack_u32_bits(levels >> 4, 2),
        "sc": blocks[:, 192:208].reshape(-1, 2),
        "d": _fp16_bytes(blocks[:, 208:210]),
    }


def _pack_q8_0(blocks: torch.Tensor) -> dict[str, torch.Tensor]:
    return {"q8": blocks[:, 2:34] ^ 0x80, "d": _fp16_bytes(blocks[:, 0:2])}


def _pack_q4_0(blocks: torch.Tensor) -> dict[str, torch.Tensor]:
    return {"nib": _pack_nibbles(_nibbles_to_levels(blocks[:, 2:18])), "d": _fp16_bytes(blocks[:, 0:2])}


def _pack_q5_0(blocks: torch.Tensor) -> dict[str, torch.Tensor]:
    return {
        "nib": _pack_nibbles(_nibbles_to_levels(blocks[:, 6:22])),
        "high": blocks[:, 2:6].contiguous(),  # GGUF's bit order is already the kernel's
        "d": _fp16_bytes(blocks[:, 0:2]),
    }


def _pack_q5_1(blocks: torch.Tensor) -> dict[str, torch.Tensor]:
    return {
        "nib": _pack_nibbles(_nibbles_to_levels(blocks[:, 8:24])),
        "high": blocks[:, 4:8].contiguous(),
        "dm": _fp16_bytes(blocks[:, 0:4]),
    }


_PACKERS = {
    QuantType.Q4_K: _pack_q4_k,
    QuantType.Q5_K: _pack_q5_k,
    QuantType.Q6_K: _pack_q6_k,
    QuantType.Q8_0: _pack_q8_0,
    QuantType.Q4_0: _pack_q4_0,
    QuantType.Q5_0: _pack_q5_0,
    QuantType.Q5_1: _pack_q5_1,
}


# ---- the reader -----------------------------------------------------------------------------------------


def planes_of(weight: RepackedWeight) -> dict[str, torch.Tensor]:
    """The planes of a repacked weight as `[rows, units or super-blocks, bytes]` views."""
    rows, k = weight.shape
    offsets, _ = row_layout(weight.qtype, k)
    out = {}
    for (name, nbytes, per_super), at in zip(PLANES[weight.qtype], offsets, strict=True):
        width = plane_row_bytes(k, nbytes, per_super)
        out[name] = weight.data[:, at : at + width].reshape(rows, -1, nbytes)
    return out


def read_repacked(weight: RepackedWeight) -> torch.Tensor:
    """The float32 `[rows, K]` values of a repacked weight, read from its planes alone, with worker/quant's
    float operations (so the result is bit-for-bit its `dequantize` of the GGUF bytes)."""
    rows, k = weight.shape
    units = k // UNIT
    p = {n: _swizzle(v, units, SLOTTED[n]) if n in SLOTTED else v for n, v in planes_of(weight).items()}
    qt = weight.qtype
    if qt == QuantType.Q8_0:
        levels = p["q8"].to(torch.int32) - 128
    else:
        levels = _unpack_nibbles(p["nib"])  # [rows, units, 32]
        if qt in (QuantType.Q5_K, QuantType.Q5_0, QuantType.Q5_1):
            levels = levels | (_unpack_u32_bits(p["high"], 1) << 4)
        elif qt == QuantType.Q6_K:
            levels = levels | (_unpack_u32_bits(p["high2"], 2) << 4)
    if qt in (QuantType.Q4_K, QuantType.Q5_K):
        head = p["head"]  # [rows, supers, 16]
        d = read_fp16(head[..., 0:2].reshape(-1, 2)).reshape(rows, -1, 1)
        dmin = read_fp16(head[..., 2:4].reshape(-1, 2)).reshape(rows, -1, 1)
        low = head[..., 4:12].to(torch.int32)
        sc = low & 63
        m = (low >> 6) | (_unpack_nibbles(head[..., 12:16]) << 2)
        scale = (d * sc.float()).reshape(rows, units, 1)
        offset = (dmin * m.float()).reshape(rows, units, 1)
        values = scale * levels.float() - offset
    elif qt == QuantType.Q6_K:
        d = read_fp16(p["d"].reshape(-1, 2)).reshape(rows, -1, 1)  # [rows, supers, 1]
        sc = p["sc"].reshape(rows, -1, 16).view(torch.int8).float()  # [rows, supers, 16]
        scale = (d * sc).reshape(rows, units, 2, 1)
        values = scale * (levels.reshape(rows, units, 2, 16) - 32).float()
    else:
        scales = p["dm" if qt == QuantType.Q5_1 else "d"]
        d = read_fp16(scales[..., 0:2].reshape(-1, 2)).reshape(rows, units, 1)
        if qt == QuantType.Q8_0:
            values = d * levels.float()
        elif qt == QuantType.Q4_0:
            values = d * (levels - 8).float()
        elif qt == QuantType.Q5_0:
            values = d * (levels - 16).float()
        else:
            mn = read_fp16(p["dm"][..., 2:4].reshape(-1, 2)).reshape(rows, units, 1)
            values = d * levels.float() + mn
    return values.reshape(rows, k)
