"""Block dequantization on a CUDA device in one Triton kernel per matrix: GGUF bytes in, bf16 (or any float)
weights out, written straight into the caller's buffer.

The torch codec (codec.py) is the reference and runs on any device, but it makes a dozen full-size
temporaries per chunk; a prefill that dequantizes every matrix right before its GEMM wants the weights at
close to the card's write bandwidth. Each program decodes `BLOCKS` blocks: every element computes its byte
and scale addresses from its index (the bytes are re-read from L1, not from memory) and stores its value in
the output dtype. Products are those of the codec (scale = d * sc, then scale * q - offset, in fp32), so the
result agrees with the codec's to the rounding of one fused multiply-add.

`triton` is optional and imported on first use (`_triton_kernels.py`): `available(qtype, device)` says
whether a kernel exists and imports for it; callers fall back to the codec otherwise (`DequantScratch`
also probes each kernel against the codec first).
"""

from __future__ import annotations

import functools
import importlib
import logging
from types import ModuleType

import torch

from .types import QuantType

BLOCKS = 8  # blocks per program: 2,048 outputs of a K-quant, 256 of Q8_0
TYPES = (QuantType.Q4_K, QuantType.Q6_K, QuantType.Q8_0)  # those with a kernel

log = logging.getLogger(__name__)


@functools.cache
def _kernels() -> ModuleType | None:
    try:
        return importlib.import_module("._triton_kernels", __package__)
    except Exception as e:  # absent on the CPU-only machines, or a triton that cannot build these
        log.debug("the Triton dequantizers are not usable: %s", e)
        return None


def importable() -> bool:
    """Whether triton imports and builds the kernels' module here."""
    return _kernels() is not None


def available(qtype: QuantType, device: torch.device) -> bool:
    """Whether a Triton kernel exists for `qtype` and can run on `device` (a CUDA device with triton)."""
    return qtype in TYPES and device.type == "cuda" and importable()


def dequantize_into(qtype: QuantType, raw: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """Decode `raw` (uint8, contiguous, whole blocks of `qtype`) into `out` (contiguous, float, one element per
    weight, any shape) and return `out`. Only for the types and devices `available` admits."""
    kernels = _kernels()
    if qtype not in TYPES or kernels is None:
        raise ValueError(
            f"no Triton dequantizer for {qtype.name} here (kernels for {[t.name for t in TYPES]})"
        )
    if raw.dtype != torch.uint8 or not raw.is_contiguous() or not out.is_contiguous():
        raise ValueError("dequantize_into needs contiguous uint8 bytes and a contiguous output")
    n_blocks, rest = divmod(raw.numel(), qtype.type_size)
    if rest or out.numel() != n_blocks * qtype.block_size:
        raise ValueError(
            f"{qtype.name}: {raw.numel()} bytes are not {out.numel()} weights' blocks "
            f"({qtype.type_size} bytes per {qtype.block_size})"
        )
    if n_blocks:
        kernels.launch(qtype, raw, out, n_blocks, BLOCKS)
    return out
