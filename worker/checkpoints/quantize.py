"""Quantize-on-load: a full-precision checkpoint whose weights are block-quantized one tensor at a time, on
the loading device, with the per-tensor types a llama.cpp preset (`q4_k_m`, `q5_k_m`, `q8_0`) chooses."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch

from ..config import ModelConfig
from ..errors import CheckpointError
from ..layout import expected_tensor_shapes
from ..tokenizer import Tokenizer
from .base import PLAIN, Checkpoint, ModelFormat, WeightValue
from .gguf_layout import tensor_place

PLAIN_TYPE_NAMES = ("F32", "F16", "BF16")

# (gguf name, shape, block index or None) -> the type to store a tensor in
TypeChooser = Callable[[str, tuple[int, ...], "int | None"], Any]


def preset_chooser(preset: str, config: ModelConfig) -> TypeChooser:
    """The preset's per-tensor type rule (`worker/quant/`'s choose_type) for a model of `config`; an unknown
    preset raises InvalidRequestError naming the presets there are."""
    from ..quant import choose_type
    from ..quant.presets import preset as find_preset

    find_preset(preset)
    blocks = config.num_hidden_layers + config.mtp_num_hidden_layers  # GGUF's block_count

    def choose(gguf_name: str, shape: tuple[int, ...], block: int | None) -> Any:
        return choose_type(preset, gguf_name, shape, block, blocks, has_output=not config.tie_word_embeddings)

    return choose


def is_plain(qtype: Any) -> bool:
    return qtype.name in PLAIN_TYPE_NAMES


class QuantizingCheckpoint(Checkpoint):
    """Wraps a full-precision checkpoint; its matrices come out as `QuantizedWeight`s of the preset's types."""

    def __init__(self, source: Checkpoint, preset: str) -> None:
        self.source = source
        self.preset = preset
        self.path = source.path
        self.config = source.config
        self.tokenizer_dir = source.tokenizer_dir
        self._choose = preset_chooser(preset, self.config)
        self._types = {
            name: self._choose(place.gguf_name, shape, place.block)
            for name, shape in expected_tensor_shapes(self.config).items()
            for place in [tensor_place(name, self.config)]
        }
        if source.format.container == "gguf" and any(
            t not in PLAIN_TYPE_NAMES for t, _ in source.format.tensor_types
        ):
            raise CheckpointError(
                f"{source.path}: --quantize needs full-precision weights; this file is already quantized"
            )

    @property
    def name(self) -> str:
        return self.source.name

    @property
    def format(self) -> ModelFormat:
        inner = self.source.format
        types = ModelFormat.count_types([t.name for t in self._types.values()])
        return ModelFormat(inner.container, f"{inner.weights} -> {self.preset}", inner.nbytes, types)

    def stored_types(self) -> dict[str, str]:
        return {name: PLAIN if is_plain(t) else t.name for name, t in self._types.items()}

    def stored_sizes(self) -> dict[str, int]:
        return self.source.stored_sizes()

    def tensors(self, device: torch.device | str = "cpu") -> Iterator[tuple[str, WeightValue]]:
        from ..quant import QuantizedWeight, quantize

        device = torch.device(device)
        for name, value in self.source.tensors(device):
            qtype = self._types[name]
            if isinstance(value, torch.Tensor) and not is_plain(qtype):
                weights = value.to(device=device, dtype=torch.float32)
                value = QuantizedWeight(qtype, tuple(weights.shape), quantize(qtype, weights))
            yield name, value

    def own_tokenizer(self) -> Tokenizer:
        return self.source.own_tokenizer()

    def generation_defaults(self) -> dict[str, Any]:
        return self.source.generation_defaults()
