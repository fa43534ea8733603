"""`dequantize` and `quantize`: tensors to and from the byte layout GGUF files store, for every QuantType.

Both work on whole tensors in torch order (the last dimension is the row the blocks run along, GGUF's
first dimension), on whatever device the input is, in chunks of rows so that their temporaries stay a few
hundred MB whatever the tensor's size.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from . import kquants, legacy
from .types import QuantShapeError, QuantType

BlockFn = Callable[[torch.Tensor], torch.Tensor]

# (dequantize blocks [N, type_size] uint8 -> [N, block_size] float32, quantize the reverse)
BLOCK_CODECS: dict[QuantType, tuple[BlockFn, BlockFn]] = {
    QuantType.Q8_0: (legacy.dequantize_q8_0, legacy.quantize_q8_0),
    QuantType.Q4_0: (legacy.dequantize_q4_0, legacy.quantize_q4_0),
    QuantType.Q5_0: (legacy.dequantize_q5_0, legacy.quantize_q5_0),
    QuantType.Q5_1: (legacy.dequantize_q5_1, legacy.quantize_q5_1),
    QuantType.Q4_K: (kquants.dequantize_q4_k, kquants.quantize_q4_k),
    QuantType.Q5_K: (kquants.dequantize_q5_k, kquants.quantize_q5_k),
    QuantType.Q6_K: (kquants.dequantize_q6_k, kquants.quantize_q6_k),
}
FLOAT_DTYPES = {QuantType.F32: torch.float32, QuantType.F16: torch.float16, QuantType.BF16: torch.bfloat16}
# Elements per chunk: the searches keep about ten float32 temporaries of this size. On the CPU a chunk that
# stays in cache is fastest; on a GPU each chunk costs some hundred kernel launches, so chunks are large.
CHUNK_ELEMENTS = {"cpu": 1 << 18, "cuda": 1 << 25}


def _rows(shape: tuple[int, ...]) -> int:
    rows = 1
    for n in shape[:-1]:
        rows *= n
    return rows


def _chunk_rows(row: int, device: torch.device) -> int:
    elements = CHUNK_ELEMENTS.get(device.type, CHUNK_ELEMENTS["cuda"])
    return max(1, elements // max(row, 1))


def dequantize(
    qtype: QuantType | int | str,
    raw: torch.Tensor,
    shape: tuple[int, ...] | torch.Size,
    dtype: torch.dtype = torch.float32,
    *,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """The tensor of `shape` (torch order) stored as `raw` (uint8, any shape, GGUF's byte layout), as `dtype`
    (float32 by default: exact, every format's values are float32 products), on `raw`'s device.

    `out` (contiguous, `shape`'s element count, on `raw`'s device) receives the result instead of a new
    tensor, in its own dtype: a caller that dequantizes one matrix after another reuses one buffer."""
    qtype = QuantType.of(qtype)
    shape = tuple(int(n) for n in shape)
    if raw.dtype != torch.uint8:
        raise QuantShapeError(f"{qtype.name} data must be uint8 bytes, got {raw.dtype}")
    row = shape[-1] if shape else 1
    expected = _rows(shape) * qtype.row_bytes(row)
    if raw.numel() != expected:
        raise QuantShapeError(
            f"{qtype.name} tensor of shape {list(shape)} takes {expected} bytes, got {raw.numel()}"
        )
    flat = raw.reshape(-1, qtype.row_bytes(row)) if expected else raw.reshape(0, max(qtype.row_bytes(row), 1))
    if out is not None:
        if out.numel() != flat.shape[0] * row or not out.is_contiguous() or out.device != raw.device:
            raise QuantShapeError(
                f"out must be a contiguous tensor of {flat.shape[0] * row} elements on {raw.device}, got "
                f"{list(out.shape)} on {out.device}"
            )
        rows_out = out.view(flat.shape[0], row)
    if qtype.is_float:
        values = flat.view(FLOAT_DTYPES[qtype])
        if out is None:
            return values.to(dtype).reshape(shape)
        rows_out.copy_(values)
        return out.view(shape)
    decode = BLOCK_CODECS[qtype][0]
    if out is None:
        rows_out = torch.empty((flat.shape[0], row), dtype=dtype, device=raw.device)
    step = _chunk_rows(row, raw.device)
    for start in range(0, flat.shape[0], step):
        chunk = flat[start : start + step]
        blocks = chunk.reshape(-1, qtype.type_size)
        rows_out[start : start + step] = decode(blocks).reshape(chunk.shape[0], row)
    return rows_out.view(shape)


def quantize(qtype: QuantType | int | str, weights: torch.Tensor) -> torch.Tensor:
    """`weights [..., row]` (any float dtype, any device) -> uint8 `[..., row_bytes]` in GGUF's byte layout."""
    qtype = QuantType.of(qtype)
    if not weights.is_floating_point():
        raise QuantShapeError(f"quantizing to {qtype.name} needs float weights, got {weights.dtype}")
    shape = tuple(weights.shape) or (1,)
    row = shape[-1]
    row_bytes = qtype.row_bytes(row)
    flat = weights.reshape(-1, row)
    if qtype.is_float:
        stored = flat.to(FLOAT_DTYPES[qtype]).contiguous()
        return stored.view(torch.uint8).reshape(*shape[:-1], row_bytes)
    if not bool(torch.isfinite(weights).all()):
        raise QuantShapeError(f"cannot quantize to {qtype.name}: the weights contain inf or NaN")
    encode = BLOCK_CODECS[qtype][1]
    out = torch.empty((flat.shape[0], row_bytes), dtype=torch.uint8, device=weights.device)
    step = _chunk_rows(row, weights.device)
    for start in range(0, flat.shape[0], step):
        chunk = flat[start : start + step].float()
        out[start : start + step] = encode(chunk.reshape(-1, qtype.block_size)).reshape(
            chunk.shape[0], row_bytes
        )
    return out.reshape(*shape[:-1], row_bytes)
