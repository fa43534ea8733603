"""The interface every checkpoint format implements, and the description of a model's format."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Union

import torch

from ..config import ModelConfig

if TYPE_CHECKING:
    from ..quant import QuantizedWeight
    from ..tokenizer import Tokenizer

# A weight as a format hands it over: a plain tensor (any float dtype; the loader casts it) or a block-quantized
# one, already in our model's names and value conventions.
WeightValue = Union[torch.Tensor, "QuantizedWeight"]
PLAIN = "PLAIN"  # a stored_types() entry: cast to the compute dtype on load


@dataclass(frozen=True)
class ModelFormat:
    """What a model's weights are stored as, for `GetModelInfo`, `onestream status` and the card metric."""

    container: str  # "safetensors" or "gguf"
    weights: str  # the file's overall type: "bf16", "Q4_K_M", ...; a quantize-on-load preset after "->"
    nbytes: int  # bytes of the weight files
    tensor_types: tuple[tuple[str, int], ...] = ()  # (stored type, tensor count), most common first

    @property
    def label(self) -> str:
        """One short string: `gguf Q4_K_M`, `safetensors bf16`, `safetensors bf16 -> q4_k_m`."""
        return f"{self.container} {self.weights}"

    def describe(self) -> str:
        types = ", ".join(f"{name} x{count}" for name, count in self.tensor_types)
        return f"{self.label} ({types}; {self.nbytes / 1e9:.2f} GB)" if types else self.label

    @staticmethod
    def count_types(types: list[str]) -> tuple[tuple[str, int], ...]:
        return tuple(Counter(types).most_common())


class Checkpoint(ABC):
    """A model on disk: its config now, its weights when iterated (one tensor at a time, never all at once)."""

    path: Path
    config: ModelConfig
    tokenizer_dir: Path | None = None  # `--tokenizer DIR`: a Hugging Face tokenizer instead of the file's own

    @property
    def name(self) -> str:
        """The model's name for users: the directory's or the file's (without `.gguf` and shard suffix)."""
        return self.path.name

    @property
    @abstractmethod
    def format(self) -> ModelFormat: ...

    @abstractmethod
    def tensors(self, device: torch.device | str = "cpu") -> Iterator[tuple[str, WeightValue]]:
        """Every text tensor as (our model's name, value), validated as a whole before the first is yielded.

        Plain tensors may be read-only views of a mapped file on the CPU (copy them, never write to them);
        quantized ones are on `device`. A view may stop being valid once the next tensor is requested.
        """

    @abstractmethod
    def stored_sizes(self) -> dict[str, int]:
        """Bytes each tensor occupies in the files, by our model's name (what load progress counts)."""

    @abstractmethod
    def stored_types(self) -> dict[str, str]:
        """Each tensor's type as it reaches the device, by our model's name: a GGML block type name (`Q4_K`)
        for a block-quantized weight, `PLAIN` for one the loader casts to the compute dtype."""

    def tokenizer(self) -> Tokenizer:
        """The tokenizer with its chat templates and EOS ids: from `tokenizer_dir` when set, else the format's."""
        if self.tokenizer_dir is not None:
            from ..tokenizer import load_tokenizer

            return load_tokenizer(self.tokenizer_dir)
        return self.own_tokenizer()

    @abstractmethod
    def own_tokenizer(self) -> Tokenizer: ...

    @abstractmethod
    def generation_defaults(self) -> dict[str, Any]:
        """Sampling defaults the model's authors recommend, as SamplingParams fields."""
