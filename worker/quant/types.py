"""The tensor types of GGUF files that onestream reads and writes, with their block layouts."""

from __future__ import annotations

import enum
from dataclasses import dataclass

from ..errors import CheckpointError, OnestreamError


class UnsupportedQuantTypeError(CheckpointError):
    """A tensor type (GGUF type id or name) that onestream does not implement."""


class QuantShapeError(OnestreamError, ValueError):
    """A tensor or byte buffer whose size does not fit the type's blocks."""


@dataclass(frozen=True)
class BlockLayout:
    block_size: int  # elements per block, along the last (row) dimension
    type_size: int  # bytes per block
    fp16_fields: tuple[
        int, ...
    ] = ()  # byte offsets of the block's fp16 scales (every other byte is integers)


class QuantType(enum.IntEnum):
    """GGUF tensor types by their GGML type id (the ids are the file format's, so they are the values)."""

    F32 = 0
    F16 = 1
    Q4_0 = 2
    Q5_0 = 6
    Q5_1 = 7
    Q8_0 = 8
    Q4_K = 12
    Q5_K = 13
    Q6_K = 14
    BF16 = 30

    @classmethod
    def of(cls, value: object) -> QuantType:
        """The type named by an id, a name (`"q4_k"`), or a `gguf.GGMLQuantizationType`; an unsupported one
        raises UnsupportedQuantTypeError naming it."""
        if isinstance(value, QuantType):
            return value
        name = getattr(value, "name", None)  # a gguf.GGMLQuantizationType (an IntEnum of the same ids)
        if isinstance(value, str) or name is not None:
            key = (value if isinstance(value, str) else str(name)).upper()
            if key in cls.__members__:
                return cls[key]
            raise UnsupportedQuantTypeError(f"tensor type {key} is not supported (supported: {_supported()})")
        try:
            return cls(int(value))  # type: ignore[call-overload]
        except (TypeError, ValueError):
            raise UnsupportedQuantTypeError(
                f"tensor type id {value!r} is not supported (supported: {_supported()})"
            ) from None

    @property
    def layout(self) -> BlockLayout:
        return LAYOUTS[self]

    @property
    def block_size(self) -> int:
        return LAYOUTS[self].block_size

    @property
    def type_size(self) -> int:
        return LAYOUTS[self].type_size

    @property
    def is_float(self) -> bool:
        return self in (QuantType.F32, QuantType.F16, QuantType.BF16)

    def row_bytes(self, row: int) -> int:
        """Bytes of one row of `row` elements; raises QuantShapeError when `row` is not whole blocks."""
        if row % self.block_size:
            raise QuantShapeError(
                f"{self.name} stores rows in blocks of {self.block_size}: a row of {row} elements does not fit"
            )
        return row // self.block_size * self.type_size

    def nbytes(self, shape: tuple[int, ...]) -> int:
        """Bytes of a tensor of `shape` (torch order: the last dimension is the row)."""
        count = 1
        for n in shape[:-1]:
            count *= n
        return count * self.row_bytes(shape[-1] if shape else 1)


# From ggml-common.h's block structs: scales first (fp16), then the packed quants (see legacy.py, kquants.py).
LAYOUTS: dict[QuantType, BlockLayout] = {
    QuantType.F32: BlockLayout(1, 4),
    QuantType.F16: BlockLayout(1, 2),
    QuantType.BF16: BlockLayout(1, 2),
    QuantType.Q8_0: BlockLayout(32, 2 + 32, (0,)),
    QuantType.Q4_0: BlockLayout(32, 2 + 16, (0,)),
    QuantType.Q5_0: BlockLayout(32, 2 + 4 + 16, (0,)),
    QuantType.Q5_1: BlockLayout(32, 2 + 2 + 4 + 16, (0, 2)),
    QuantType.Q4_K: BlockLayout(256, 2 + 2 + 12 + 128, (0, 2)),
    QuantType.Q5_K: BlockLayout(256, 2 + 2 + 12 + 32 + 128, (0, 2)),
    QuantType.Q6_K: BlockLayout(256, 128 + 64 + 16 + 2, (208,)),
}


def _supported() -> str:
    return ", ".join(t.name for t in QuantType)
