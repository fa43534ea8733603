"""Quantized weights: GGUF's block formats (dequantize / quantize), the weight type the model runs on, and
the per-tensor type presets (q4_k_m, q5_k_m, q6_k, q8_0)."""

from .codec import dequantize, quantize
from .presets import PRESETS, Preset, choose_type, plan_types
from .types import QuantShapeError, QuantType, UnsupportedQuantTypeError
from .weight import (
    QuantizedEmbedding,
    QuantizedLinear,
    QuantizedWeight,
    install_quantized_weights,
    quantized_nbytes,
)

__all__ = [
    "PRESETS",
    "Preset",
    "QuantShapeError",
    "QuantType",
    "QuantizedEmbedding",
    "QuantizedLinear",
    "QuantizedWeight",
    "UnsupportedQuantTypeError",
    "choose_type",
    "dequantize",
    "install_quantized_weights",
    "plan_types",
    "quantize",
    "quantized_nbytes",
]
