"""The weights the megakernel's GEMV streams, per kind: bf16 tensors as the model holds them, quantized ones
repacked once into kernels/quant_layout.py's device layout, and the table pointers that name them.

A quantized model (worker/quant's `install_quantized_weights`) keeps GGUF bytes in its QuantizedLinear /
QuantizedEmbedding modules. The runner repacks each into the kernel's layout and the module hands its bytes over
(`hand_over`): the reference back end (prefill, long steps) then dequantizes from the repacked copy, bit for bit
the same values, so the device holds one copy of every weight. Once the runner has its first build, that build's
mk_dequant (dequant.cuh) reads a matrix back to bf16 in one launch (`DeviceReader`); read_repacked's torch ops
(some thirty launches per piece of a matrix) remain the reader for other dtypes and devices. A weight slot of the
kernel's tables holds the device pointer with the format code (quant_layout.FORMAT_CODES) in its top byte, 0 for
bf16 (gemv_quant.cuh).

A GGUF's ssm_out (fewer key than value heads) keeps llama.cpp's tiled value-head columns, since its K-quant blocks
span heads (worker/layers/quantized.py's PermutedInputLinear permutes the input instead); the kernel stages that
GEMV's input in the same order (`dn_out_tiled`, model.cuh MK_DN_OUT_HEAD).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from onestream.worker.errors import UnsupportedModelError
from onestream.worker.layers.quantized import PermutedInputLinear
from onestream.worker.quant import QuantType
from onestream.worker.quant.weight import QuantizedEmbedding, QuantizedLinear

from .build import BuiltModule
from .plan import WeightFormat, weight_formats_of
from .quant_layout import FORMAT_CODES, RepackedWeight, read_repacked, repack

TAG_SHIFT = 56  # gemv_quant.cuh QF_TAG_SHIFT
READ_CHUNK_ELEMENTS = 1 << 24  # weights read at a time: the reader's int32 / fp32 temporaries stay ~0.3 GB


DEQUANT_THREADS = 256
# Blocks per SM of the dequantizer's grid: a full SM of 256-thread blocks (the module's launches are cooperative,
# so CuPy caps a grid at what is resident); a grid-stride loop does the rest.
DEQUANT_BLOCKS_PER_SM = 8


class DeviceReader:
    """A quantized build's mk_dequant (dequant.cuh): rows of a repacked weight back to bf16 in one launch, values
    bit for bit read_repacked's rounded to bf16. Holds the compiled module only, not the runner."""

    def __init__(self, built: BuiltModule, device: torch.device) -> None:
        self.kernel = built.kernel("mk_dequant")
        self.formats = built.plan.quant_union  # the format codes the build compiles
        self.device = device
        sms = torch.cuda.get_device_properties(device).multi_processor_count
        self.grid_limit = sms * DEQUANT_BLOCKS_PER_SM
        self._streams: dict[int, Any] = {}

    def reads(self, qtype: QuantType, data: torch.Tensor, dtype: torch.dtype) -> bool:
        return (
            dtype == torch.bfloat16
            and data.device == self.device
            and data.is_contiguous()
            and bool(self.formats >> FORMAT_CODES[qtype] & 1)
        )

    def read(self, qtype: QuantType, data: torch.Tensor, k: int) -> torch.Tensor:
        """`[rows, k]` bf16 values of repacked rows `data` (`[rows, row stride]` uint8, contiguous)."""
        import cupy

        rows = data.shape[0]
        out = torch.empty((rows, k), dtype=torch.bfloat16, device=data.device)
        units = rows * (k // 32)
        if units == 0:
            return out
        handle = torch.cuda.current_stream(self.device).cuda_stream
        stream = self._streams.get(handle)
        if stream is None:
            stream = self._streams[handle] = cupy.cuda.ExternalStream(handle, self.device.index or 0)
        grid = min(self.grid_limit, -(-units // DEQUANT_THREADS))
        args = (
            np.uint64(data.data_ptr()),
            np.int32(FORMAT_CODES[qtype]),
            np.int64(rows),
            np.int32(k),
            np.uint64(out.data_ptr()),
        )
        with stream:
            self.kernel((grid,), (DEQUANT_THREADS,), args)
        return out


class RepackedSource:
    """A module's weight read back from its repacked copy (worker/quant's WeightSource): what the reference
    back end dequantizes once the module has handed its GGUF bytes over."""

    def __init__(self, packed: RepackedWeight) -> None:
        self.packed = packed
        self.reader: DeviceReader | None = None  # set once a build that compiles mk_dequant exists

    @property
    def nbytes(self) -> int:
        return self.packed.data.numel()

    def _read(self, data: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        rows, k = data.shape[0], self.packed.shape[1]
        if self.reader is not None and self.reader.reads(self.packed.qtype, data, dtype):
            return self.reader.read(self.packed.qtype, data, k)
        out = torch.empty((rows, k), dtype=dtype, device=data.device)
        step = max(1, READ_CHUNK_ELEMENTS // k)
        for r0 in range(0, rows, step):
            part = data[r0 : r0 + step]
            out[r0 : r0 + part.shape[0]] = read_repacked(
                RepackedWeight(self.packed.qtype, (part.shape[0], k), part)
            ).to(dtype)
        return out

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        return self._read(self.packed.data, dtype)

    def rows(self, index: torch.Tensor | slice, dtype: torch.dtype) -> torch.Tensor:
        if isinstance(index, slice):  # a range of rows: read in place, no gather
            return self._read(self.packed.data[index], dtype)
        picked = self.packed.data[index.reshape(-1).to(self.packed.data.device)]
        return self._read(picked, dtype).reshape(*index.shape, self.packed.shape[1])


def tiled_columns(config: Any) -> torch.Tensor:
    """The column order of a GGUF's ssm_out (PermutedInputLinear.index) that MK_DN_OUT_HEAD stages."""
    hk, hv, dv = config.linear_num_key_heads, config.linear_num_value_heads, config.linear_value_head_dim
    r = hv // hk
    heads = torch.tensor([(p % hk) * r + p // hk for p in range(hv)])  # the grouped head at tiled position p
    return (heads[:, None] * dv + torch.arange(dv)[None, :]).reshape(-1)


def gemv_module(module: Any) -> Any:
    """The module that holds a GEMV weight (a PermutedInputLinear's inner layer)."""
    return module.inner if isinstance(module, PermutedInputLinear) else module


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


def embed_format(module: Any) -> WeightFormat:
    """How the kernel reads an embedding table's rows: a quantized table in its own format (the device layout; every
    quantized type the engine loads has one), else bf16."""
    return module_format(module) if isinstance(module, QuantizedEmbedding) else WeightFormat.BF16


def module_format(module: Any) -> WeightFormat:
    module = gemv_module(module)
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
        self.dn_out_tiled = _dn_out_tiled(model.config, self.kinds["dn_out"])
        formats: dict[str, set[WeightFormat]] = {}
        self._repacked: dict[int, RepackedWeight] = {}
        self._modules: dict[int, Any] = {}  # the quantized modules, by the same keys
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
        # The embedding rows the kernel reads: a quantized table in the device layout (repacked and handed over
        # like a GEMV weight, once if it is the tied lm_head), else the model's bf16 table.
        self.embed = model.model.embed_tokens
        self.embed_format = embed_format(self.embed)
        if self.embed_format is not WeightFormat.BF16:
            self._add(self.embed)
        self.quantized = bool(self._repacked)

    def _add(self, module: Any) -> int:
        module = gemv_module(module)
        if not isinstance(module, (QuantizedLinear, QuantizedEmbedding)):
            return module.weight.numel() * module.weight.element_size()
        if id(module) not in self._repacked:
            if isinstance(module.source, RepackedSource):  # another runner on this model repacked it
                packed = module.source.packed
            else:
                packed = repack(module.qtype, module.raw, tuple(module.shape))
                # One copy on the device: the reference dequantizes from this one from now on.
                module.hand_over(RepackedSource(packed))
            self._repacked[id(module)] = packed
            self._modules[id(module)] = module
        return self._repacked[id(module)].streamed_bytes

    def pointer(self, module: Any) -> int:
        """The table entry of a GEMV weight: its device pointer, tagged with its format code when quantized."""
        module = gemv_module(module)
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

    def embed_table(self) -> torch.Tensor:
        """The table the kernel's embedding rows are read from (plan.embed_format says how): the repacked copy of a
        quantized table, else the model's own bf16 table."""
        if self.embed_format is not WeightFormat.BF16:
            return self._repacked[id(self.embed)].data
        weight = self.embed.weight
        if weight.dtype != torch.bfloat16 or not weight.is_contiguous():
            raise UnsupportedModelError(
                f"megakernel: the embedding table must be contiguous bf16 or block-quantized, got {weight.dtype}"
            )
        return weight

    def attach_reader(self, reader: DeviceReader) -> None:
        """Let the repacked copies be read back on the device by `reader` (kept where one is attached: a copy
        shared with another runner of the model keeps that runner's reader, of the same formats)."""
        for module in self._modules.values():
            source = module.source
            if isinstance(source, RepackedSource) and source.reader is None:
                source.reader = reader

    @property
    def repacked_bytes(self) -> int:
        """Device bytes of the repacked copies (what the megakernel adds to the model's own weights)."""
        return sum(p.data.numel() for p in self._repacked.values())


def _dn_out_tiled(config: Any, groups: list[list[Any]]) -> bool:
    """Whether every DeltaNet layer's ssm_out keeps a GGUF's tiled columns (all or none: one build)."""
    permuted = [isinstance(m, PermutedInputLinear) for group in groups for m in group]
    if not any(permuted):
        return False
    if not all(permuted):
        raise UnsupportedModelError(
            "megakernel: some DeltaNet out_proj layers keep a GGUF's tiled value-head columns and others do not"
        )
    expected = tiled_columns(config)
    for group in groups:
        for module in group:
            if not torch.equal(module.index.cpu(), expected):
                raise UnsupportedModelError(
                    "megakernel: a DeltaNet out_proj permutes its input in an order other than llama.cpp's "
                    "tiled value heads"
                )
    return True
