"""Random block-quantized models for kernel tests and benchmarks: a random bf16 model (random_model.py) whose GEMV
weights are replaced by fresh random GGUF blocks, typed tensor by tensor by a preset's rule (worker/quant's
presets, as llama.cpp's quantizer types a file) or by a caller's choice.

The blocks are random bytes drawn on the device with their fp16 scale fields set so that the weights have about
the spread of the bf16 model's (N(0, 1/fan_in)): quantizing 27B-shaped tensors with the real quantizer would
take minutes, and a kernel streams any bytes at the same speed.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from onestream.worker.checkpoints.gguf_layout import tensor_place
from onestream.worker.checkpoints.quantize import preset_chooser
from onestream.worker.quant import QuantizedWeight, QuantType, install_quantized_weights

from .plan import WEIGHT_KINDS, WeightFormat, weight_formats_of

# The largest |level x scale| product of each type's fp16 scales (at BlockLayout.fp16_fields), so
# that d = spread / that product gives weights of about `spread`.
_RANGE = {
    QuantType.Q8_0: 128.0,
    QuantType.Q4_0: 8.0,
    QuantType.Q5_0: 16.0,
    QuantType.Q5_1: 16.0,
    QuantType.Q4_K: 63.0 * 8.0,
    QuantType.Q5_K: 63.0 * 16.0,
    QuantType.Q6_K: 128.0 * 32.0,
}
# The GEMV weights of a layer (names relative to the layer) and of the model.
GEMV_SUFFIXES = (
    "linear_attn.in_proj_qkv.weight",
    "linear_attn.in_proj_z.weight",
    "linear_attn.in_proj_b.weight",
    "linear_attn.in_proj_a.weight",
    "linear_attn.out_proj.weight",
    "self_attn.q_proj.weight",
    "self_attn.k_proj.weight",
    "self_attn.v_proj.weight",
    "self_attn.o_proj.weight",
    "mlp.gate_proj.weight",
    "mlp.up_proj.weight",
    "mlp.down_proj.weight",
)


def random_blocks(
    qtype: QuantType, shape: tuple[int, int], *, generator: torch.Generator, device: torch.device | str
) -> torch.Tensor:
    """GGUF bytes of a random `[rows, K]` weight of `qtype` with values of about N(0, 1/K)'s spread."""
    rows, k = shape
    count = rows * k // qtype.block_size
    blocks = torch.randint(
        0, 256, (count, qtype.type_size), dtype=torch.uint8, device=device, generator=generator
    )
    spread = 2.0 / math.sqrt(k)
    d = spread / _RANGE[qtype]
    scale = torch.empty(count, device=device).uniform_(0.5 * d, 1.5 * d, generator=generator)
    fields = qtype.layout.fp16_fields
    blocks[:, fields[0] : fields[0] + 2] = scale.half().view(torch.uint8).reshape(count, 2)
    if len(fields) > 1:  # the offset: dmin of the K-quants (levels centred), m of Q5_1 (negative: centred)
        second = scale * (_RANGE[qtype] / 63.0 if qtype in (QuantType.Q4_K, QuantType.Q5_K) else -16.0)
        blocks[:, fields[1] : fields[1] + 2] = second.half().view(torch.uint8).reshape(count, 2)
    return blocks.reshape(-1)


def gemv_weight_names(model: Any) -> list[str]:
    """Parameter names of every weight the megakernel's GEMVs stream (the lm_head, the MTP fc)."""
    names = []
    for prefix, layers in (("model.layers", model.model.layers), ("mtp.layers", _mtp_layers(model))):
        for i, _ in enumerate(layers):
            for suffix in GEMV_SUFFIXES:
                name = f"{prefix}.{i}.{suffix}"
                if _has(model, name):
                    names.append(name)
    names.append("model.embed_tokens.weight" if model.config.tie_word_embeddings else "lm_head.weight")
    if _has(model, "mtp.fc.weight"):
        names.append("mtp.fc.weight")
    return names


def _mtp_layers(model: Any) -> list[Any]:
    mtp = getattr(model, "mtp", None)
    return [] if mtp is None else list(mtp.layers)


def _has(model: Any, name: str) -> bool:
    try:
        model.get_parameter(name)
    except AttributeError:
        return False
    return True


def preset_types(model: Any, preset: str) -> Callable[[str, tuple[int, int]], QuantType]:
    """The type `preset` gives each of our tensors (by its GGUF name and block: worker/quant's rule)."""
    choose = preset_chooser(preset, model.config)

    def pick(name: str, shape: tuple[int, int]) -> QuantType:
        place = tensor_place(name, model.config)
        return QuantType.of(choose(place.gguf_name, shape, place.block))

    return pick


@torch.no_grad()
def quantize_randomly(
    model: Any, types: Callable[[str, tuple[int, int]], QuantType], *, seed: int = 0
) -> dict[str, QuantType]:
    """Replace every GEMV weight of `model` by random blocks of the type `types(name, shape)` gives; returns
    the types. The model then runs in its dtype on the quantized weights (worker/quant's modules)."""
    device = model.model.embed_tokens.weight.device
    generator = torch.Generator(device=device).manual_seed(seed)
    chosen: dict[str, QuantType] = {}
    for name in gemv_weight_names(model):
        weight = model.get_parameter(name)
        shape = (int(weight.shape[0]), int(weight.shape[1]))
        qtype = types(name, shape)
        chosen[name] = qtype
        raw = random_blocks(qtype, shape, generator=generator, device=device)
        install_quantized_weights(model, {name: QuantizedWeight(qtype, shape, raw)}, dtype=weight.dtype)
    return chosen


def random_model_in(config: Any, weights: str = "bf16", *, seed: int = 7) -> Any:
    """A random model of `config` (random_model.py) with its GEMV weights in `weights`: bf16 as drawn, or random
    blocks typed by that quantization preset's rule (q4_k_m, q8_0, ...)."""
    from .random_model import random_model

    model = random_model(config, seed=seed)
    if weights != "bf16":
        quantize_randomly(model, preset_types(model, weights), seed=seed + 1)
    return model


def q4_k_m_formats() -> tuple[tuple[str, WeightFormat], ...]:
    """A plan's `weight_formats` for a Q4_K_M file of the 27B shapes, without a model: Q4_K in every kind, and
    Q6_K where the preset puts it (the lm_head, some layers' qkv, v and down projections). A superset (the
    lm_head is Q6_K alone in a file), so a plan made from it builds every path such a file can take."""
    kinds = {k: {WeightFormat.Q4_K} for k in WEIGHT_KINDS}
    for k in ("dn_in", "att_in", "mlp_down", "lm_head"):
        kinds[k].add(WeightFormat.Q6_K)
    return weight_formats_of(kinds)
