"""Per-tensor types of the quantization presets (q4_k_m, q5_k_m, q6_k, q8_0), by GGUF tensor name.

Our rules, written to give what llama.cpp's `llama-quantize` gives a `qwen35` model (its current tensor
categories, where the DeltaNet `attn_qkv` counts as an `attn_v`-like tensor), so that a file we write and
a model we quantize on load match the files users download:

1. Only 2-D `*.weight` tensors are quantized. Norms (`*_norm.weight`, `nextn.enorm/hnorm`), `ssm_conv1d`,
   `ssm_a`, `ssm_dt.bias` and every other 1-D tensor stay F32.
2. `output.weight` (and `token_embd.weight` when the model has no `output`: tied embeddings) is Q6_K in the
   K-quant presets, Q8_0 in q8_0, and Q8_0 whenever its rows do not fit the preset's default blocks.
3. q4_k_m and q5_k_m give `attn_v` / `attn_qkv` and `ffn_down` Q6_K in the "more bits" layers: the first
   and last eighth of the blocks and every third block in between (`more_bits`). `n_layers` counts every
   block of the file, the MTP block included (GGUF's `block_count`).
4. Everything else takes the preset's default type (Q4_K, Q5_K, Q6_K or Q8_0): `token_embd` of an untied
   model, `attn_q/k/output`, `attn_gate`, `ssm_alpha/beta/out`, `ffn_gate/up`, `nextn.eh_proj`.
5. A K-quant needs rows (the last dimension) that are whole 256-blocks; otherwise the tensor falls back to
   a 32-block type of about the same size: Q4_K -> Q5_0, Q5_K -> Q5_1, Q6_K -> Q8_0 (and F16 if the row
   is not even a multiple of 32).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass

import gguf

from ..errors import InvalidRequestError
from .types import QuantType


@dataclass(frozen=True)
class Preset:
    name: str
    default: QuantType
    file_type: gguf.LlamaFileType  # GGUF's `general.file_type` for a file of this preset
    more_bits: bool  # attn_v / attn_qkv / ffn_down get Q6_K in the "more bits" layers


PRESETS: dict[str, Preset] = {
    p.name: p
    for p in (
        Preset("q4_k_m", QuantType.Q4_K, gguf.LlamaFileType.MOSTLY_Q4_K_M, more_bits=True),
        Preset("q5_k_m", QuantType.Q5_K, gguf.LlamaFileType.MOSTLY_Q5_K_M, more_bits=True),
        Preset("q6_k", QuantType.Q6_K, gguf.LlamaFileType.MOSTLY_Q6_K, more_bits=False),
        Preset("q8_0", QuantType.Q8_0, gguf.LlamaFileType.MOSTLY_Q8_0, more_bits=False),
    )
}
FALLBACKS = {QuantType.Q4_K: QuantType.Q5_0, QuantType.Q5_K: QuantType.Q5_1, QuantType.Q6_K: QuantType.Q8_0}
KEPT_AS_IS = ("_norm.weight", "ssm_conv1d")  # 2-D or named like weights, but never quantized
MORE_BITS_TENSORS = ("attn_v.weight", "attn_qkv.weight", "ffn_down.weight")
BLOCK_INDEX = re.compile(r"^blk\.(\d+)\.")


def preset(name: str) -> Preset:
    """The preset named `name` (case-insensitive); an unknown one raises InvalidRequestError listing them."""
    found = PRESETS.get(name.lower())
    if found is None:
        raise InvalidRequestError(f"unknown quantization preset {name!r}; choose one of {', '.join(PRESETS)}")
    return found


def more_bits(layer_index: int, n_layers: int) -> bool:
    """The layers that q4_k_m / q5_k_m give more bits: the first and last eighth, every third in between."""
    eighth = n_layers // 8
    return layer_index < eighth or layer_index >= 7 * n_layers // 8 or (layer_index - eighth) % 3 == 2


def block_index(tensor_name: str) -> int | None:
    """N of a `blk.N.` tensor name, else None."""
    match = BLOCK_INDEX.match(tensor_name)
    return int(match.group(1)) if match else None


def choose_type(
    preset_name: str,
    tensor_name: str,
    shape: tuple[int, ...],
    layer_index: int | None,
    n_layers: int,
    *,
    has_output: bool = True,
) -> QuantType:
    """The type `preset_name` stores GGUF tensor `tensor_name` of `shape` (torch order, rows last) as.

    `layer_index` is the tensor's block (None: parsed from `blk.N.`), `n_layers` the file's block count
    (MTP block included), `has_output` whether the model has its own `output.weight` (False when tied).
    """
    chosen = preset(preset_name)
    if len(shape) != 2 or not tensor_name.endswith(".weight") or any(k in tensor_name for k in KEPT_AS_IS):
        return QuantType.F32
    row = shape[-1]
    if tensor_name == "output.weight" or (tensor_name == "token_embd.weight" and not has_output):
        if row % chosen.default.block_size or chosen.default == QuantType.Q8_0:
            return QuantType.Q8_0
        return QuantType.Q6_K
    qtype = chosen.default
    if chosen.more_bits and tensor_name.endswith(MORE_BITS_TENSORS):
        index = block_index(tensor_name) if layer_index is None else layer_index
        if index is not None and more_bits(index, n_layers):
            qtype = QuantType.Q6_K
    return fitting_type(qtype, row)


def fitting_type(qtype: QuantType, row: int) -> QuantType:
    """`qtype`, or its 32-block fallback when `row` is not whole blocks of it (F16 when not even that fits)."""
    if row % qtype.block_size == 0:
        return qtype
    fallback = FALLBACKS.get(qtype, QuantType.F16)
    return fallback if row % fallback.block_size == 0 else QuantType.F16


def plan_types(preset_name: str, shapes: Mapping[str, tuple[int, ...]]) -> dict[str, QuantType]:
    """`choose_type` for every tensor of a model (GGUF names -> shapes), with the block count and whether
    the embeddings are tied read from the names."""
    blocks = [i for i in map(block_index, shapes) if i is not None]
    n_layers = max(blocks) + 1 if blocks else 0
    has_output = "output.weight" in shapes
    return {
        name: choose_type(preset_name, name, tuple(shape), None, n_layers, has_output=has_output)
        for name, shape in shapes.items()
    }
