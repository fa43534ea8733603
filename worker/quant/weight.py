"""Quantized weights in the model: the weight type, and the modules that stand in for nn.Linear/nn.Embedding.

The model's layers call their projections as modules (`self.q_proj(x)`) and read `lm_head_weight`, so a
quantized model is the same model with those modules swapped (`install_quantized_weights`, the one place
that does it). Each module keeps its GGUF bytes on the model's device and dequantizes per call into the
compute dtype (only that layer's weight exists in full precision at a time), or once at install when the
caller has the memory for the dequantized model (`dequantize_once`). Inside a `DequantScratch.active()` (the
fast prefill) a linear layer dequantizes into that one reused buffer instead (scratch.py).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from .codec import dequantize, quantize
from .scratch import active_scratch
from .types import QuantShapeError, QuantType


@dataclass(frozen=True)
class QuantizedWeight:
    """A tensor of `shape` (torch order: `[out, in]` for a linear weight) stored as GGUF blocks of `qtype`."""

    qtype: QuantType
    shape: tuple[int, ...]
    raw: torch.Tensor  # uint8, GGUF's byte layout, any shape with the right number of bytes

    def __post_init__(self) -> None:
        object.__setattr__(self, "qtype", QuantType.of(self.qtype))
        object.__setattr__(self, "shape", tuple(int(n) for n in self.shape))
        expected = self.qtype.nbytes(self.shape)
        if self.raw.dtype != torch.uint8 or self.raw.numel() != expected:
            raise QuantShapeError(
                f"{self.qtype.name} weight of shape {list(self.shape)} needs {expected} uint8 bytes, "
                f"got {self.raw.numel()} of {self.raw.dtype}"
            )

    @classmethod
    def from_float(cls, qtype: QuantType | int | str, weights: torch.Tensor) -> QuantizedWeight:
        """Quantize `weights` (on their device) to `qtype`."""
        qtype = QuantType.of(qtype)
        return cls(qtype, tuple(weights.shape), quantize(qtype, weights))

    @property
    def nbytes(self) -> int:
        return self.raw.numel()

    @property
    def device(self) -> torch.device:
        return self.raw.device

    def to(self, device: torch.device | str) -> QuantizedWeight:
        return QuantizedWeight(self.qtype, self.shape, self.raw.to(device))

    def dequantize(
        self, dtype: torch.dtype = torch.float32, device: torch.device | str | None = None
    ) -> torch.Tensor:
        raw = self.raw if device is None else self.raw.to(device)
        return dequantize(self.qtype, raw, self.shape, dtype)

    def rows(self, index: torch.Tensor | slice, dtype: torch.dtype) -> torch.Tensor:
        """Rows `index` (any shape of ids into the first dimension) of a 2-D weight -> `[*index.shape, cols]`; a
        slice reads a range of rows without a gather -> `[rows, cols]`."""
        table = self.raw.reshape(self.shape[0], -1)
        if isinstance(index, slice):
            picked = table[index]
            return dequantize(self.qtype, picked, (picked.shape[0], self.shape[-1]), dtype)
        picked = table[index.reshape(-1).to(table.device)]
        return dequantize(self.qtype, picked, (picked.shape[0], self.shape[-1]), dtype).reshape(
            *index.shape, self.shape[-1]
        )


class WeightSource(Protocol):
    """Another holder of a module's weight, in its own layout (the megakernel's repacked copy,
    kernels/quant_weights.py): what the module reads once it has handed its bytes over."""

    @property
    def nbytes(self) -> int: ...

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        """The whole weight in `dtype`, bit for bit what the GGUF bytes dequantize to."""
        ...

    def rows(self, index: torch.Tensor | slice, dtype: torch.dtype) -> torch.Tensor:
        """Rows `index` of a 2-D weight in `dtype` -> `[*index.shape, cols]` (a slice: `[rows, cols]`)."""
        ...


class _QuantizedModule(nn.Module):
    """Holds a weight's bytes as a buffer (moves with `.to(device)`) and its compute dtype (follows
    `.to(dtype)`); with `dequantize_once` also the dequantized weight, as a buffer that follows both."""

    def __init__(self, weight: QuantizedWeight, dtype: torch.dtype, dequantize_once: bool) -> None:
        super().__init__()
        self.qtype = weight.qtype
        self.shape = weight.shape
        self.compute_dtype = dtype
        self.register_buffer("raw", weight.raw)
        self.dequantized: torch.Tensor | None
        self.register_buffer(
            "dequantized", weight.dequantize(dtype) if dequantize_once else None, persistent=False
        )
        self.source: WeightSource | None = None  # set by `hand_over`: the bytes live there, not in `raw`

    @property
    def quantized(self) -> QuantizedWeight:
        if self.source is not None:
            raise RuntimeError(
                f"this {self.qtype.name} weight handed its GGUF bytes over (to the megakernel's copy); "
                "read it with dequantize()"
            )
        return QuantizedWeight(self.qtype, self.shape, self.raw)

    @property
    def nbytes(self) -> int:
        """Bytes of the weight's blocks, wherever they live."""
        return self.source.nbytes if self.source is not None else self.raw.numel()

    def hand_over(self, source: WeightSource) -> None:
        """Drop our bytes (`raw` becomes empty) and read the weight from `source`, which holds the same values
        in its own layout: the device then holds one copy. Irreversible; `source` must stay where it is (it
        does not follow `.to(device)`)."""
        self.source = source
        self.raw = torch.empty(0, dtype=torch.uint8, device=self.raw.device)

    def read_rows(self, index: torch.Tensor | slice, dtype: torch.dtype) -> torch.Tensor:
        """Rows `index` (ids, or a slice: a range) of a 2-D weight in `dtype` (only those rows dequantized)."""
        if self.dequantized is not None:
            if isinstance(index, slice):
                return self.dequantized[index].to(dtype)
            return self.dequantized[index.to(self.dequantized.device)].to(dtype)
        if self.source is not None:
            return self.source.rows(index, dtype)
        return self.quantized.rows(index, dtype)

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        """The full weight in `dtype`, from whichever copy holds it."""
        if self.source is not None:
            return self.source.dequantize(dtype)
        return self.quantized.dequantize(dtype)

    @property
    def weight(self) -> torch.Tensor:
        """The full-precision weight in the compute dtype: the kept copy, or dequantized now."""
        if self.dequantized is not None:
            return self.dequantized
        return self.dequantize(self.compute_dtype)

    def _apply(self, fn, recurse=True):  # type: ignore[no-untyped-def]
        super()._apply(fn, recurse)
        # A probe shows what the conversion does to float tensors (uint8 bytes are left alone by .to(dtype)).
        self.compute_dtype = fn(torch.empty(0, dtype=self.compute_dtype, device=self.raw.device)).dtype
        return self

    def extra_repr(self) -> str:
        once = ", dequantized once" if self.dequantized is not None else ""
        return f"{self.qtype.name}, shape={list(self.shape)}, compute_dtype={self.compute_dtype}{once}"


class QuantizedLinear(_QuantizedModule):
    """`nn.Linear` without bias over a quantized `[out, in]` weight."""

    def __init__(self, weight: QuantizedWeight, dtype: torch.dtype, *, dequantize_once: bool = False) -> None:
        if len(weight.shape) != 2:
            raise QuantShapeError(f"a linear weight is 2-D, got shape {list(weight.shape)}")
        super().__init__(weight, dtype, dequantize_once)
        self.out_features, self.in_features = weight.shape

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scratch = active_scratch()
        if scratch is not None and self.dequantized is None and self.source is not None:
            # The scratch decodes GGUF bytes, which a handed-over weight no longer has: its source is read a
            # slab of rows at a time instead (the same bound on what exists in full precision at once).
            out = linear_in_slabs(self, x)
            assert out is not None
            return out
        if scratch is not None and self.dequantized is None:
            weight = self.quantized
            if scratch.accepts(weight, self.compute_dtype):
                return scratch.linear(weight, x)
        return F.linear(x, self.weight)


class QuantizedEmbedding(_QuantizedModule):
    """`nn.Embedding` over a quantized `[vocab, hidden]` table: a lookup dequantizes only the rows it reads."""

    def __init__(self, weight: QuantizedWeight, dtype: torch.dtype, *, dequantize_once: bool = False) -> None:
        if len(weight.shape) != 2:
            raise QuantShapeError(f"an embedding table is 2-D, got shape {list(weight.shape)}")
        super().__init__(weight, dtype, dequantize_once)
        self.num_embeddings, self.embedding_dim = weight.shape

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.dequantized is not None:
            return F.embedding(ids, self.dequantized)
        return self.read_rows(ids, self.compute_dtype)


def install_quantized_weights(
    model: nn.Module,
    weights: Mapping[str, QuantizedWeight],
    *,
    dtype: torch.dtype,
    dequantize_once: bool = False,
) -> None:
    """Replace the module owning each `weights` entry (model parameter names, `...proj.weight`,
    `model.embed_tokens.weight`, `lm_head.weight`) by its quantized stand-in computing in `dtype`.

    Only nn.Linear (without bias) and nn.Embedding weights can be quantized; anything else, or a shape that
    differs from the module's, raises QuantShapeError naming the tensor. The replaced module's parameter is
    dropped (it may be on `meta`: nothing of it is read but its shape).
    """
    for name, weight in weights.items():
        module_name, _, leaf = name.rpartition(".")
        module = model.get_submodule(module_name) if module_name else model
        if leaf != "weight" or not isinstance(module, (nn.Linear, nn.Embedding)):
            raise QuantShapeError(f"{name}: only nn.Linear and nn.Embedding weights can be quantized")
        if isinstance(module, nn.Linear) and module.bias is not None:
            raise QuantShapeError(f"{name}: a quantized linear layer has no bias")
        if tuple(module.weight.shape) != weight.shape:
            raise QuantShapeError(
                f"{name}: the model expects shape {list(module.weight.shape)}, the weight has {list(weight.shape)}"
            )
        kind = QuantizedLinear if isinstance(module, nn.Linear) else QuantizedEmbedding
        parent_name, _, attr = module_name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, attr, kind(weight, dtype, dequantize_once=dequantize_once))


SLAB_ELEMENTS = 1 << 26  # weights `linear_in_slabs` dequantizes at a time: 128 MB in bf16


def linear_in_slabs(module: nn.Module, x: torch.Tensor) -> torch.Tensor | None:
    """`x @ W.T` for a block-quantized `[out, in]` weight without a kept dequantized copy, dequantizing SLAB_ELEMENTS
    weights' rows at a time, so that the transient is one slab rather than the whole matrix (the lm_head of a
    248k vocabulary: 2.5 GB in bf16). None for any other module (the caller multiplies as usual)."""
    if not isinstance(module, _QuantizedModule) or module.dequantized is not None or len(module.shape) != 2:
        return None
    rows, cols = module.shape
    step = max(1, SLAB_ELEMENTS // cols)
    if step >= rows:
        return F.linear(x, module.weight)
    out = torch.empty((*x.shape[:-1], rows), dtype=x.dtype, device=x.device)
    for r0 in range(0, rows, step):
        r1 = min(r0 + step, rows)
        out[..., r0:r1] = F.linear(x, module.read_rows(slice(r0, r1), module.compute_dtype))
    return out


def quantized_nbytes(model: nn.Module) -> int:
    """Bytes of the quantized weights a model holds (their GGUF blocks)."""
    return sum(m.nbytes for m in model.modules() if isinstance(m, _QuantizedModule))
