"""The device layout of quantized weights (kernels/quant_layout.py): repacking is lossless (the layout's reader
gives worker/quant's dequantization bit for bit) and streams no more bytes than the GGUF file holds."""

from __future__ import annotations

import random

import pytest
import torch
from onestream.kernels.quant_layout import (
    PLANES,
    REPACKED_TYPES,
    ROW_ALIGN,
    group_slot_xor,
    planes_of,
    read_repacked,
    repack,
    row_layout,
)
from onestream.worker.quant import QuantShapeError, QuantType, dequantize, quantize


@pytest.fixture
def generator() -> torch.Generator:
    seed = random.SystemRandom().randrange(2**31)
    print(f"seed {seed}")
    return torch.Generator().manual_seed(seed)


def random_raw(qtype: QuantType, rows: int, k: int, generator: torch.Generator) -> torch.Tensor:
    """GGUF bytes of a `[rows, k]` weight: random blocks whose fp16 fields are finite halves."""
    count = rows * k // qtype.block_size
    blocks = torch.randint(0, 256, (count, qtype.type_size), dtype=torch.uint8, generator=generator)
    for offset in qtype.layout.fp16_fields:
        bits = torch.randint(0, 1 << 16, (count,), dtype=torch.int32, generator=generator)
        finite = torch.where((bits >> 10) & 0x1F == 0x1F, bits & ~(1 << 14), bits)
        blocks[:, offset : offset + 2] = finite.to(torch.int16).view(torch.uint8).reshape(count, 2)
    return blocks.reshape(-1)


@pytest.mark.parametrize("qtype", REPACKED_TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("shape", [(3, 512), (16, 768)])
def test_repacked_blocks_read_back_as_worker_quant_dequantizes_them(
    qtype: QuantType, shape: tuple[int, int], generator: torch.Generator
) -> None:
    raw = random_raw(qtype, *shape, generator)
    packed = repack(qtype, raw, shape)
    expected = dequantize(qtype, raw, shape)
    got = read_repacked(packed)
    assert got.dtype == torch.float32 and got.shape == shape
    # Bit for bit, signed zeros included.
    assert torch.equal(got.view(torch.int32), expected.view(torch.int32))


@pytest.mark.parametrize("qtype", REPACKED_TYPES, ids=lambda t: t.name)
def test_quantized_weights_repack_losslessly(qtype: QuantType, generator: torch.Generator) -> None:
    weights = torch.randn((8, 1024), generator=generator)
    raw = quantize(qtype, weights).reshape(-1)
    packed = repack(qtype, raw, (8, 1024))
    assert torch.equal(read_repacked(packed), dequantize(qtype, raw, (8, 1024)))


@pytest.mark.parametrize("qtype", REPACKED_TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("k", [1280, 5120, 17408])
def test_planes_hold_exactly_the_files_bytes(qtype: QuantType, k: int) -> None:
    rows = 5
    offsets, stride = row_layout(qtype, k)
    packed = repack(qtype, torch.zeros(qtype.nbytes((rows, k)), dtype=torch.uint8), (rows, k))
    planes = planes_of(packed)
    assert sum(p.numel() for p in planes.values()) == qtype.nbytes((rows, k)) == packed.streamed_bytes
    assert stride % ROW_ALIGN == 0 and stride - ROW_ALIGN < qtype.row_bytes(k) <= stride
    assert packed.data.shape == (rows, stride)
    # Every plane a lane reads n bytes at a time starts n-aligned (16 at most: the kernel's vector loads).
    for (name, nbytes, _), at in zip(PLANES[qtype], offsets, strict=True):
        assert at % min(16, nbytes) == 0, name


def test_shapes_that_do_not_fit_the_blocks_are_refused() -> None:
    with pytest.raises(QuantShapeError, match="256-blocks"):
        repack(QuantType.Q4_K, torch.zeros(144, dtype=torch.uint8), (2, 128))
    with pytest.raises(QuantShapeError, match="no device layout"):
        row_layout(QuantType.F16, 32)
    with pytest.raises(QuantShapeError, match="uint8 bytes"):
        repack(QuantType.Q8_0, torch.zeros(10, dtype=torch.uint8), (1, 32))


def test_unit_slots_hold_their_groups_swizzled(generator: torch.Generator) -> None:
    """Slot G of unit v holds the unit's 8-element group G ^ r(v) (Q8_0's bytes show it directly), and Q6_K's
    scale slot h its half h ^ (r(v) >> 1)."""
    rows, k = 2, 1024
    raw = random_raw(QuantType.Q8_0, rows, k, generator)
    q8 = planes_of(repack(QuantType.Q8_0, raw, (rows, k)))["q8"]  # [rows, units, 32]
    levels = raw.reshape(rows, k // 32, 34)[..., 2:] ^ 0x80
    raw6 = random_raw(QuantType.Q6_K, rows, k, generator)
    sc = planes_of(repack(QuantType.Q6_K, raw6, (rows, k)))["sc"]  # [rows, units, 2]
    scales = raw6.reshape(rows, k // 256, 210)[..., 192:208].reshape(rows, k // 32, 2)
    for v in range(k // 32):
        r = int(group_slot_xor(torch.tensor(v)))
        for g in range(4):
            assert torch.equal(q8[:, v, 8 * g : 8 * g + 8], levels[:, v, 8 * (g ^ r) : 8 * (g ^ r) + 8]), (
                v,
                g,
            )
        for h in range(2):
            assert torch.equal(sc[:, v, h], scales[:, v, h ^ (r >> 1)]), (v, h)


def test_the_lanes_of_a_wavefront_read_distinct_banks() -> None:
    """Why the slots are swizzled: lane l multiplies unit base + l (64 bytes of staged input each); reading slot
    G's input at group G ^ r(v), the 8 lanes of one 16-byte shared-memory wavefront hit 8 distinct 16-byte bank
    quads of the 128 (without the swizzle: 2, a 4-way conflict)."""
    for base in (0, 32, 96):
        v = torch.arange(base, base + 32)
        for g in range(4):
            quad = ((64 * v + 16 * (g ^ group_slot_xor(v))) % 128) // 16
            for wave in quad.reshape(4, 8):
                assert len(set(wave.tolist())) == 8, (base, g, wave)


@pytest.mark.parametrize("qtype", REPACKED_TYPES, ids=lambda t: t.name)
def test_repacking_works_in_bounded_chunks_of_rows(
    qtype: QuantType, generator: torch.Generator, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The packers see at most a chunk of weights at a time (their temporaries, some 30 bytes per weight, are
    bounded by the chunk, not by the tensor: a 27B lm_head would need ~30 GB at once), and the chunked result is
    the whole tensor's byte for byte, rows left over after the last whole chunk included."""
    from onestream.kernels import quant_layout

    rows, k = 37, 1024
    raw = random_raw(qtype, rows, k, generator)
    whole = repack(qtype, raw, (rows, k), chunk_elements=rows * k)
    seen: list[int] = []
    packer = quant_layout._PACKERS[qtype]

    def counting(blocks: torch.Tensor) -> dict[str, torch.Tensor]:
        seen.append(blocks.shape[0] * qtype.block_size)
        return packer(blocks)

    monkeypatch.setitem(quant_layout._PACKERS, qtype, counting)
    chunk = 5 * k + 100  # five rows per chunk
    packed = repack(qtype, raw, (rows, k), chunk_elements=chunk)
    assert seen == [5 * k] * 7 + [2 * k]
    assert max(seen) <= chunk
    assert torch.equal(packed.data, whole.data)
    assert torch.equal(read_repacked(packed), dequantize(qtype, raw, (rows, k)))
    # The default chunk is small next to a 27B tensor: the 248,320 x 5,120 lm_head goes in about 76 pieces.
    assert quant_layout.REPACK_CHUNK_ELEMENTS <= 1 << 24
