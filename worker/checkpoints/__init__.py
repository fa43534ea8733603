"""Model checkpoint formats behind one interface.

What `--model` names picks the format: a directory of Hugging Face files (`hf.py`), a `.gguf` file, a
directory holding one GGUF, or the first of a GGUF's split shards (`gguf.py`). Every format gives the same
things: the text model's config, its weights in our model's names and value conventions (plain tensors or
`QuantizedWeight`s), its tokenizer with chat template and EOS ids, its generation defaults, and a
description of the format. A new format is one more module here and one more line in `open_checkpoint`.
"""

from __future__ import annotations

from pathlib import Path

from ..errors import CheckpointError
from .base import Checkpoint, ModelFormat, WeightValue

__all__ = ["Checkpoint", "ModelFormat", "WeightValue", "is_gguf_path", "open_checkpoint"]

GGUF_SUFFIX = ".gguf"


def is_gguf_path(path: Path) -> bool:
    """A `.gguf` file, or a directory whose weights are GGUF files (and that has no safetensors)."""
    if path.suffix == GGUF_SUFFIX:
        return True
    return path.is_dir() and any(path.glob(f"*{GGUF_SUFFIX}")) and not any(path.glob("*.safetensors"))


def open_checkpoint(
    model: str | Path | None = None,
    *,
    tokenizer_dir: str | Path | None = None,
    quantize: str | None = None,
) -> Checkpoint:
    """The checkpoint `model` names (default: the embedded model), read lazily: headers now (every tensor's
    name and shape checked against the config), weights when iterated. `tokenizer_dir` replaces the
    checkpoint's own tokenizer; `quantize` (a preset such as `q4_k_m`) quantizes a full-precision
    checkpoint's weights as they load."""
    from . import hf

    path = Path(model) if model is not None else hf.default_model_dir()
    if not path.exists():
        raise CheckpointError(f"{path}: no such file or directory")
    if is_gguf_path(path):
        from .gguf import GGUFCheckpoint

        checkpoint: Checkpoint = GGUFCheckpoint(path)
    else:
        checkpoint = hf.HFCheckpoint(path)
    if tokenizer_dir is not None:
        checkpoint.tokenizer_dir = Path(tokenizer_dir)
    if quantize is not None:
        from .quantize import QuantizingCheckpoint

        checkpoint = QuantizingCheckpoint(checkpoint, quantize)
    return checkpoint
