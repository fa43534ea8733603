"""GGUF block formats: our dequantizer against the `gguf` package's bit for bit, our quantizer's blocks read
back by it, our quantization error against its quantizer's, and error bounds on Gaussian weights."""

from __future__ import annotations

import random

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as GGMLType
from gguf import quants as gguf_quants
from onestream.worker.quant import QuantShapeError, QuantType, UnsupportedQuantTypeError, dequantize, quantize

BLOCK_TYPES = [t for t in QuantType if not t.is_float]
# gguf's own quantizers (it has none for the K-quants).
GGUF_QUANTIZERS = (QuantType.Q8_0, QuantType.Q4_0, QuantType.Q5_0, QuantType.Q5_1)
# Relative RMS error on Gaussian weights, (lowest, highest) plausible: ~ the grid step / sqrt(12).
GAUSSIAN_ERROR = {
    QuantType.Q8_0: (0.004, 0.0052),
    QuantType.Q4_0: (0.07, 0.084),
    QuantType.Q5_0: (0.035, 0.042),
    QuantType.Q5_1: (0.03, 0.036),
    QuantType.Q4_K: (0.06, 0.072),
    QuantType.Q5_K: (0.03, 0.036),
    QuantType.Q6_K: (0.014, 0.018),
    QuantType.F16: (1e-4, 3e-4),
    QuantType.BF16: (1e-3, 3e-3),
    QuantType.F32: (0.0, 0.0),
}


@pytest.fixture
def generator() -> torch.Generator:
    seed = random.SystemRandom().randrange(2**31)
    print(f"seed {seed}")
    return torch.Generator().manual_seed(seed)


def random_blocks(qtype: QuantType, count: int, generator: torch.Generator) -> torch.Tensor:
    """`count` blocks of random bytes whose fp16 fields are any finite half (subnormals and signs included)."""
    blocks = torch.randint(0, 256, (count, qtype.type_size), dtype=torch.uint8, generator=generator)
    for offset in qtype.layout.fp16_fields:
        bits = torch.randint(0, 1 << 16, (count,), dtype=torch.int32, generator=generator)
        finite = torch.where((bits >> 10) & 0x1F == 0x1F, bits & ~(1 << 14), bits)  # exponent 31 -> 15
        blocks[:, offset : offset + 2] = finite.to(torch.int16).view(torch.uint8).reshape(count, 2)
    return blocks


def gguf_dequantize(qtype: QuantType, raw: torch.Tensor) -> np.ndarray:
    return gguf_quants.dequantize(raw.numpy(), GGMLType(qtype.value))


def gaussian(rows: int, cols: int, generator: torch.Generator) -> torch.Tensor:
    return torch.randn(rows, cols, generator=generator) * 0.02


def test_layouts_agree_with_gguf() -> None:
    for qtype in QuantType:
        assert gguf.GGML_QUANT_SIZES[GGMLType(qtype.value)] == (qtype.block_size, qtype.type_size)


@pytest.mark.parametrize("qtype", BLOCK_TYPES, ids=lambda t: t.name)
def test_dequantize_matches_gguf_bit_for_bit(qtype: QuantType, generator: torch.Generator) -> None:
    rows, blocks_per_row = 24, 3
    raw = random_blocks(qtype, rows * blocks_per_row, generator).reshape(rows, -1)
    ours = dequantize(qtype, raw, (rows, blocks_per_row * qtype.block_size))
    theirs = gguf_dequantize(qtype, raw)
    assert ours.dtype == torch.float32 and theirs.dtype == np.float32
    assert np.array_equal(ours.numpy().view(np.uint32), theirs.view(np.uint32))


@pytest.mark.parametrize("qtype", [QuantType.F32, QuantType.F16, QuantType.BF16], ids=lambda t: t.name)
def test_float_types_match_gguf(qtype: QuantType, generator: torch.Generator) -> None:
    weights = gaussian(8, 48, generator)
    raw = quantize(qtype, weights)
    assert raw.shape == (8, 48 * qtype.type_size)
    theirs = (
        gguf_dequantize(qtype, raw)
        if qtype != QuantType.BF16
        else gguf_quants.dequantize(raw.numpy(), GGMLType.BF16)
    )
    ours = dequantize(qtype, raw, weights.shape)
    assert np.array_equal(ours.numpy().view(np.uint32), theirs.reshape(8, 48).view(np.uint32))
    if qtype == QuantType.BF16:  # gguf's own rounding to bf16 is round-to-nearest-even, as torch's
        assert np.array_equal(
            raw.numpy(), gguf_quants.quantize(weights.numpy(), GGMLType.BF16).view(np.uint8)
        )


@pytest.mark.parametrize("qtype", BLOCK_TYPES, ids=lambda t: t.name)
def test_quantized_blocks_read_back_through_gguf(qtype: QuantType, generator: torch.Generator) -> None:
    weights = gaussian(16, 512, generator)
    weights[0, :256] = 0.0  # an all-zero block
    weights[1, :256] = 0.01  # a constant block
    weights[2, 7] = 0.5  # an outlier
    weights[3] *= 1e-4  # scales in fp16's subnormal range
    raw = quantize(qtype, weights)
    assert raw.dtype == torch.uint8 and raw.shape == (16, 512 // qtype.block_size * qtype.type_size)
    ours = dequantize(qtype, raw, weights.shape)
    assert np.array_equal(ours.numpy(), gguf_dequantize(qtype, raw))
    assert torch.equal(ours[0, :256], torch.zeros(256))
    assert (ours[1, :256] - 0.01).abs().max() < 1e-4
    rel = ((ours - weights).norm() / weights.norm()).item()
    assert rel < GAUSSIAN_ERROR[qtype][1] * 1.5, rel


@pytest.mark.parametrize("qtype", GGUF_QUANTIZERS, ids=lambda t: t.name)
def test_error_per_block_no_worse_than_gguf_quantizer(qtype: QuantType, generator: torch.Generator) -> None:
    weights = gaussian(64, 1024, generator)
    weights[::7, ::97] *= 8  # some outliers, where searching the scale pays most
    target = weights.numpy().reshape(-1, qtype.block_size)
    ours = dequantize(qtype, quantize(qtype, weights), weights.shape).numpy().reshape(-1, qtype.block_size)
    theirs = gguf_dequantize(
        qtype, torch.from_numpy(gguf_quants.quantize(weights.numpy(), GGMLType(qtype.value)))
    )
    theirs = theirs.reshape(-1, qtype.block_size)
    err_ours = np.square(ours.astype(np.float64) - target).sum(-1)
    err_theirs = np.square(theirs.astype(np.float64) - target).sum(-1)
    # Per block: never worse than gguf's choice beyond float rounding (our candidates include its scale).
    assert (err_ours <= err_theirs * (1 + 1e-5) + 1e-12).all()
    rel_ours = np.sqrt(err_ours.sum() / np.square(target).sum())
    rel_theirs = np.sqrt(err_theirs.sum() / np.square(target).sum())
    print(f"{qtype.name}: relative RMS error ours {rel_ours:.5f}, gguf {rel_theirs:.5f}")
    assert rel_ours < rel_theirs


@pytest.mark.parametrize("qtype", list(QuantType), ids=lambda t: t.name)
def test_gaussian_error_within_the_formats_range(qtype: QuantType, generator: torch.Generator) -> None:
    weights = gaussian(32, 1024, generator)
    back = dequantize(qtype, quantize(qtype, weights), weights.shape)
    rel = ((back - weights).norm() / weights.norm()).item()
    lo, hi = GAUSSIAN_ERROR[qtype]
    print(f"{qtype.name}: relative RMS error {rel:.5f}")
    assert lo <= rel <= hi


def test_dequantize_into_a_compute_dtype(generator: torch.Generator) -> None:
    weights = gaussian(4, 256, generator)
    raw = quantize(QuantType.Q4_K, weights)
    exact = dequantize(QuantType.Q4_K, raw, weights.shape)
    assert torch.equal(
        dequantize(QuantType.Q4_K, raw, weights.shape, torch.bfloat16), exact.to(torch.bfloat16)
    )


def test_types_by_id_name_and_gguf_enum() -> None:
    assert QuantType.of(12) is QuantType.Q4_K
    assert QuantType.of("q6_k") is QuantType.Q6_K
    assert QuantType.of(GGMLType.Q8_0) is QuantType.Q8_0
    with pytest.raises(UnsupportedQuantTypeError, match="Q2_K"):
        QuantType.of(GGMLType.Q2_K)
    with pytest.raises(UnsupportedQuantTypeError, match="99"):
        QuantType.of(99)
    with pytest.raises(UnsupportedQuantTypeError, match="IQ4_XS"):
        QuantType.of("iq4_xs")


def test_bad_shapes_and_values_are_named() -> None:
    with pytest.raises(QuantShapeError, match=r"Q4_K .* 384"):
        quantize(QuantType.Q4_K, torch.zeros(2, 384))
    with pytest.raises(QuantShapeError, match="inf or NaN"):
        quantize(QuantType.Q8_0, torch.tensor([[float("nan")] * 32]))
    with pytest.raises(QuantShapeError, match="takes 68 bytes, got 67"):
        dequantize(QuantType.Q8_0, torch.zeros(67, dtype=torch.uint8), (2, 32))
    with pytest.raises(QuantShapeError, match="uint8"):
        dequantize(QuantType.Q8_0, torch.zeros(17, dtype=torch.float32), (2, 32))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("qtype", BLOCK_TYPES, ids=lambda t: t.name)
def test_cuda_matches_cpu(qtype: QuantType, generator: torch.Generator) -> None:
    raw = random_blocks(qtype, 64, generator).reshape(8, -1)
    shape = (8, 8 * qtype.block_size)
    assert torch.equal(dequantize(qtype, raw.cuda(), shape).cpu(), dequantize(qtype, raw, shape))
    weights = gaussian(64, 1024, generator)
    on_gpu = quantize(qtype, weights.cuda())
    assert on_gpu.device.type == "cuda"
    rel_gpu = (dequantize(qtype, on_gpu.cpu(), weights.shape) - weights).norm() / weights.norm()
    rel_cpu = (dequantize(qtype, quantize(qtype, weights), weights.shape) - weights).norm() / weights.norm()
    # Sums reduce in another order on the GPU, so near-ties may go the other way: the same error, not the same bytes.
    assert abs(rel_gpu - rel_cpu) < 1e-3 * rel_cpu
