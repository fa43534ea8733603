"""The weights the megakernel's GEMV streams, per kind: bf16 tensors as the model holds them, quantized ones
repacked once into kernels/quant_layout.py's device layout, and the table pointers that name them.

A quantized model (worker/quant's `install_quantized_weights`) keeps GGUF bytes in its QuantizedLinear /
QuantizedEmbedding modules, which the reference back end still reads (prefill, long steps); the megakernel gets
its own repacked copy of each, uploaded when the runner is built. A weight slot of the kernel's tables holds the
device pointer with the format code (quant_layout.FORMAT_CODES) in its top byte, 0 for bf16 (gemv_quant.cuh).
"""

from __future__ import annotations

from typing import Any

import torch
from onestream.worker.errors import UnsupportedModelError
from onestream.worker.layers.quantized import PermutedInputLinear
from onestream.worker.quant import QuantType
from onestream.worker.quant.weight import QuantizedEmbedding, QuantizedLinear

from .plan import WeightFormat, weight_formats_of
from .quant_layout import FORMAT_CODES, RepackedWeight, repack

TAG_SHIFT = 56  # gemv_quant.cuh QF_TAG_SHIFT


def kind_modules(model: Any, layers: list[Any], has_mtp: bool) -> dict[str, list[list[Any]]]:
    """The modules of each weight kind (plan.WEIGHT_KINDS), grouped by GEMV: the tensors one phase streams
    together (a DeltaNet layer's four input projections, gate and up, ...)."""
    kinds: dict[str, list[list[Any]]] = {
        k: [] for k in ("dn_in", "dn_out", "att_in", "att_out", "mlp_in", "mlp_down", "lm_head", "mtp_fc")
    }
    for layer in layers:
        if layer.is_full_attention:
            sa = layer.self_attn
            kinds["att_in"].append([sa.q_proj, sa.k_proj, sa.v_proj])
            kinds["att_out"].append([sa.o_proj])
        else:
            la = layer.linear_attn
            kinds["dn_in"].append([la.in_proj_qkv, la.in_proj_z, la.in_proj_b, la.in_proj_a])
            kinds["dn_out"].append([la.out_proj])
        kinds["mlp_in"].append([layer.mlp.gate_proj, layer.mlp.up_proj])
        kinds["mlp_down"].append([layer.mlp.down_proj])
    tied = model.config.tie_word_embeddings
    kinds["lm_head"].append([model.model.embed_tokens if tied else model.lm_head])
    if has_mtp:
        kinds["mtp_fc"].append([model.mtp.fc])
    return kinds


def module_format(module: Any) -> WeightFormat:
    if isinstance(module, PermutedInputLinear):
        raise UnsupportedModelError(
            "megakernel: a GGUF file's ssm_out keeps llama.cpp's tiled value-head columns (the layer permutes its "
            "input), which the GEMV does not do yet"
        )
    if isinstance(module, (QuantizedLinear, QuantizedEmbedding)):
        qtype = QuantType.of(module.qtype)
        if qtype not in FORMAT_CODES:
            raise UnsupportedModelError(
                f"megakernel: {qtype.name} weights have no GEMV (it streams bf16, "
                f"{', '.join(t.name for t in FORMAT_CODES)})"
            )
        return WeightFormat(qtype.name.lower())
    weight = getattr(module, "weight", None)
    if not isinstance(weight, torch.Tensor) or weight.dtype != torch.bfloat16:
        dtype = getattr(weight, "dtype", None)
        raise UnsupportedModelError(f"megakernel: a GEMV weight must be bf16 or block-quantized, got {dtype}")
    return WeightFormat.BF16


class DeviceWeights:
    """The GEMV weights of a model for the megakernel: formats per kind (the plan's `weight_formats`), the
    repacked copies of the quantized ones, and their table pointers."""

    def __init__(self, model: Any, layers: list[Any], has_mtp: bool) -> None:
        self.kinds = kind_modules(model, layers, has_mtp)
        formats: dict[str, set[WeightFormat]] = {}
        self._repacked: dict[int, RepackedWeight] = {}
        self.gemv_bytes = 0  # bytes the GEMVs read of every weight (the MTP head's included)
        for kind, groups in self.kinds.items():
            for group in groups:
                fmts = [module_format(m) for m in group]
                quant = [f is not WeightFormat.BF16 for f in fmts]
                if any(quant) and not all(quant):
                    raise UnsupportedModelError(
                        f"megakernel: a {kind} GEMV mixes bf16 and quantized tensors ({[f.value for f in fmts]})"
                    )
                if kind == "mlp_in" and fmts[0] is not fmts[1]:
                    raise UnsupportedModelError(
                        f"megakernel: gate and up projections in different formats ({fmts[0].value}, "
                        f"{fmts[1].value}) share one GEMV loop"
                    )
                formats.setdefault(kind, set()).update(fmts)
                for module in group:
                    self.gemv_bytes += self._add(module)
        self.weight_formats = weight_formats_of(formats)
        self.quantized = bool(self._repacked)

    def _add(self, module: Any) -> int:
        if not isinstance(module, (QuantizedLinear, QuantizedEmbedding)):
            return module.weight.numel() * module.weight.element_size()
        if id(module) not in self._repacked:
            self._repacked[id(module)] = repack(module.qtype, module.raw, tuple(module.shape))
        return self._repacked[id(module)].streamed_bytes

    def pointer(self, module: Any) -> int:
        """The table entry of a GEMV weight: its device pointer, tagged with its format code when quantized."""
        packed = self._repacked.get(id(module))
        if packed is None:
            weight = module.weight
            if weight.dtype != torch.bfloat16 or not weight.is_contiguous():
                raise UnsupportedModelError("megakernel: a bf16 GEMV weight must be contiguous bf16")
            return int(weight.data_ptr())
        ptr = int(packed.data.data_ptr())
        if ptr >> TAG_SHIFT or ptr % 16:
            raise UnsupportedModelError(f"megakernel: device pointer {ptr:#x} cannot carry a format tag")
        return ptr | (FORMAT_CODES[packed.qtype] << TAG_SHIFT)

    @property
    def repacked_bytes(self) -> int:
        """Device bytes of the repacked copies (what the megakernel adds to the model's own weights)."""
        return sum(p.data.numel() for p in self._repacked.values())
