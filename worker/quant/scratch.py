"""One reused buffer that quantized linear layers dequantize their weight into right before their GEMM.

A prefill multiplies thousands of tokens by every matrix: the GEMM wants the weight in the compute dtype
for the tensor cores, and dequantizing it on the device costs a small fraction of the GEMM. Inside
`with scratch.active():` every `QuantizedLinear` (without a kept dequantized copy) decodes its bytes into
the scratch and multiplies from there, so one matrix exists in full precision at a time, in memory that is
allocated once; a matrix larger than the scratch (a quantized lm_head) goes through it in row slices.

The decoder is Triton's (`triton_dequant.py`) on a CUDA device for the types it has, each kernel checked
against the torch codec on the first weight of its type (a mismatch falls back to the codec, with a
warning), and the torch codec (`codec.dequantize(..., out=)`) everywhere else.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator
from contextvars import ContextVar
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from ..errors import InvalidRequestError
from . import triton_dequant
from .codec import dequantize
from .types import QuantType

if TYPE_CHECKING:
    from .weight import QuantizedWeight

log = logging.getLogger(__name__)

DEQUANT_ENV = "ONESTREAM_PREFILL_DEQUANT"  # pins the decoder: triton, torch, or auto (triton where it runs)
DECODERS = ("auto", "triton", "torch")
PROBE_BLOCKS = 4096  # blocks of a weight decoded both ways before its type's Triton kernel is trusted
# bf16 keeps 8 significant bits: two correct roundings of products that differ by one fused multiply-add
# land at most one bf16 step apart; where scale * q and the offset cancel, that fp32 step is relative to the
# terms, not to the (small) result, hence the second, absolute, part at the sample's scale
PROBE_RELATIVE = 2.0**-7
PROBE_ABSOLUTE = 2.0**-20

_ACTIVE: ContextVar[DequantScratch | None] = ContextVar("onestream_dequant_scratch", default=None)


def active_scratch() -> DequantScratch | None:
    """The scratch of the enclosing `DequantScratch.active()`, if any."""
    return _ACTIVE.get()


def decoder_choice(name: str | None = None) -> str:
    name = name or os.environ.get(DEQUANT_ENV, "auto")
    if name not in DECODERS:
        raise InvalidRequestError(f"dequantizer must be one of {DECODERS}, got {name!r}")
    return name


class DequantScratch:
    """`elements` weights of `dtype` on `device`, reused by every quantized GEMM inside `active()`."""

    def __init__(
        self, elements: int, dtype: torch.dtype, device: torch.device, decoder: str | None = None
    ) -> None:
        if elements < 1:
            raise InvalidRequestError(f"a dequantization scratch needs at least one element, got {elements}")
        self.decoder = decoder_choice(decoder)
        if self.decoder == "triton" and (device.type != "cuda" or not triton_dequant.importable()):
            raise InvalidRequestError("dequantizer 'triton' needs triton and a CUDA device")
        self.buffer = torch.empty(elements, dtype=dtype, device=device)
        self.dtype = dtype
        self.device = device
        self.triton_types: dict[QuantType, bool] = {}  # per type: its kernel passed the probe
        self.probe_errors: dict[str, float] = {}

    @property
    def description(self) -> str:
        trusted = sorted(t.name for t, ok in self.triton_types.items() if ok)
        failed = sorted(t.name for t, ok in self.triton_types.items() if not ok)
        where = f"triton for {','.join(trusted)}" if trusted else "torch codec"
        if trusted and failed:
            where += f", torch codec for {','.join(failed)} (probe failed)"
        return f"dequantize into a {self.buffer.numel() * self.buffer.element_size() / 2**20:.1f} MiB scratch ({where})"

    @contextlib.contextmanager
    def active(self) -> Iterator[DequantScratch]:
        token = _ACTIVE.set(self)
        try:
            yield self
        finally:
            _ACTIVE.reset(token)

    def accepts(self, weight: QuantizedWeight, dtype: torch.dtype) -> bool:
        """Whether a layer computing in `dtype` over `weight` can multiply through this scratch."""
        return dtype == self.dtype and weight.device == self.device and len(weight.shape) == 2

    def _use_triton(self, qtype: QuantType, raw: torch.Tensor, cols: int) -> bool:
        if self.decoder == "torch" or not triton_dequant.available(qtype, self.device):
            return False
        if qtype not in self.triton_types:
            self.triton_types[qtype] = self._probe(qtype, raw, cols)
        return self.triton_types[qtype]

    def _probe(self, qtype: QuantType, raw: torch.Tensor, cols: int) -> bool:
        """Decode the first blocks of a weight both ways; trust the kernel when they agree to a bf16 step."""
        blocks = min(PROBE_BLOCKS, raw.numel() // qtype.type_size)
        sample = raw.reshape(-1)[: blocks * qtype.type_size].contiguous()
        n = blocks * qtype.block_size
        want = dequantize(qtype, sample, (n,), torch.float32)
        try:
            got = triton_dequant.dequantize_into(
                qtype, sample, torch.empty(n, dtype=self.dtype, device=self.device)
            )
        except Exception as e:
            if self.decoder == "triton":
                raise
            log.warning("the Triton %s dequantizer failed (%s); using the torch codec", qtype.name, e)
            return False
        bound = PROBE_RELATIVE * want.abs() + PROBE_ABSOLUTE * float(want.abs().max())
        error = float(((got.float() - want).abs() / bound.clamp_min(1e-30)).max())  # 1 = the bound
        self.probe_errors[qtype.name] = error
        if not error <= 1.0:
            if self.decoder == "triton":
                raise InvalidRequestError(
                    f"the Triton {qtype.name} dequantizer disagrees with the codec ({error:.1e})"
                )
            log.warning(
                "the Triton %s dequantizer disagrees with the codec (%.1e); using the codec",
                qtype.name,
                error,
            )
            return False
        return True

    def fill(self, weight: QuantizedWeight, start: int, stop: int) -> torch.Tensor:
        """Rows `start:stop` of a 2-D `weight`, dequantized into the scratch: `[stop - start, cols]`, valid until
        the next fill (GEMMs on the same stream read it before the next fill overwrites it)."""
        rows, cols = weight.shape
        count = (stop - start) * cols
        if not 0 <= start < stop <= rows or count > self.buffer.numel():
            raise InvalidRequestError(
                f"rows {start}:{stop} of a {list(weight.shape)} weight do not fit a scratch of {self.buffer.numel()}"
            )
        row_bytes = weight.qtype.row_bytes(cols)
        raw = weight.raw.reshape(rows, row_bytes)[start:stop]
        out = self.buffer[:count]
        if self._use_triton(weight.qtype, raw, cols):
            triton_dequant.dequantize_into(weight.qtype, raw.contiguous().reshape(-1), out)
        else:
            dequantize(weight.qtype, raw, (stop - start, cols), out=out)
        return out.view(stop - start, cols)

    def linear(self, weight: QuantizedWeight, x: torch.Tensor) -> torch.Tensor:
        """`F.linear(x, weight)`, the weight dequantized into the scratch (in row slices when it is larger)."""
        rows, cols = weight.shape
        per = max(1, self.buffer.numel() // cols)
        if rows <= per:
            return F.linear(x, self.fill(weight, 0, rows))
        out = x.new_empty(*x.shape[:-1], rows)
        for start in range(0, rows, per):
            stop = min(rows, start + per)
            out[..., start:stop] = F.linear(x, self.fill(weight, start, stop))
        return out
