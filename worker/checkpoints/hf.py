"""Hugging Face checkpoints: config.json, safetensors shards (read tensor by tensor, ahead of use: reader.py), the
tokenizer files and generation_config.json."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from ..api import SAMPLING_FIELDS, SamplingParams
from ..config import ModelConfig
from ..errors import CheckpointError, InvalidRequestError
from ..layout import expected_tensor_shapes, listing
from ..tokenizer import Tokenizer, load_tokenizer
from .base import PLAIN, Checkpoint, ModelFormat
from .reader import read_ahead

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
MULTIMODAL_TEXT_PREFIX = "model.language_model."
# Tensors of a multimodal checkpoint that the text model does not use.
IGNORED_PREFIXES = ("model.visual.", "visual.", "model.vision_tower.", "model.multi_modal_projector.")

DEFAULT_MODEL_DIR = Path(__file__).resolve().parents[1] / "assets" / "default_model"

SAFETENSORS_DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}
DTYPE_NAMES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}


# ---- reading safetensors files -----------------------------------------------------------------


@dataclass(frozen=True)
class StoredTensor:
    """One tensor as a safetensors file stores it: where its bytes are and how to read them."""

    stored_name: str
    file: Path
    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int  # absolute byte offsets in the file
    end: int


def read_safetensors_header(path: Path) -> dict[str, StoredTensor]:
    """The tensors a safetensors file holds, checked against the file's real size."""
    try:
        size = path.stat().st_size
        with path.open("rb") as f:
            prefix = f.read(8)
            if len(prefix) < 8:
                raise CheckpointError(f"{path}: truncated safetensors file ({size} bytes, no header)")
            header_len = int.from_bytes(prefix, "little")
            if 8 + header_len > size:
                raise CheckpointError(
                    f"{path}: truncated safetensors file: header claims {header_len} bytes, file has {size}"
                )
            raw_header = f.read(header_len)
    except OSError as e:
        raise CheckpointError(f"{path}: cannot read ({e})") from e
    try:
        header = json.loads(raw_header)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path}: safetensors header is not valid JSON ({e})") from e
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: safetensors header is not a JSON object")
    data_start = 8 + header_len
    tensors: dict[str, StoredTensor] = {}
    data_end = data_start
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype = SAFETENSORS_DTYPES[info["dtype"]]
            shape = tuple(int(d) for d in info["shape"])
            begin, end = (int(o) for o in info["data_offsets"])
        except (KeyError, TypeError, ValueError, OverflowError) as e:
            raise CheckpointError(f"{path}: bad header entry for tensor {name!r}: {info!r}") from e
        numel = 1
        for d in shape:
            numel *= d
        if end - begin != numel * dtype.itemsize or begin < 0 or min(shape, default=0) < 0:
            raise CheckpointError(
                f"{path}: tensor {name!r} has shape {list(shape)} {info['dtype']} but occupies bytes [{begin}, {end})"
            )
        tensors[name] = StoredTensor(name, path, dtype, shape, data_start + begin, data_start + end)
        data_end = max(data_end, data_start + end)
    if data_end > size:
        raise CheckpointError(
            f"{path}: truncated safetensors file: header says {data_end} bytes, file has {size}"
        )
    return tensors


def checkpoint_files(model_dir: str | Path) -> list[Path]:
    """The safetensors shards of a checkpoint directory (from its index when it has one)."""
    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise CheckpointError(f"{model_dir}: not a directory")
    index_path = model_dir / INDEX_FILE
    if index_path.is_file():
        weight_map = _read_index(index_path)
        files = []
        for file_name in dict.fromkeys(weight_map.values()):
            path = model_dir / file_name
            if not path.is_file():
                raise CheckpointError(f"{index_path}: names shard {file_name!r}, which is not in {model_dir}")
            files.append(path)
        return files
    if (model_dir / SINGLE_FILE).is_file():
        return [model_dir / SINGLE_FILE]
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        others = sorted(p.name for p in model_dir.glob("*.bin")) + sorted(
            p.name for p in model_dir.glob("*.pt")
        )
        hint = f" (found {others}: only safetensors are supported)" if others else ""
        raise CheckpointError(f"{model_dir}: no weights: no *.safetensors files{hint}")
    return files


def _read_index(index_path: Path) -> dict[str, str]:
    try:
        index = json.loads(index_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{index_path}: not valid JSON ({e})") from e
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise CheckpointError(f"{index_path}: no 'weight_map' object of tensor name -> shard file")
    if not weight_map:
        raise CheckpointError(f"{index_path}: no weights: 'weight_map' is empty")
    return weight_map


def stored_tensors(model_dir: str | Path) -> dict[str, StoredTensor]:
    """Every tensor of every shard, by stored name; checks the index agrees with the shards."""
    model_dir = Path(model_dir)
    tensors: dict[str, StoredTensor] = {}
    for path in checkpoint_files(model_dir):
        for name, tensor in read_safetensors_header(path).items():
            if name in tensors:
                raise CheckpointError(f"tensor {name!r} is stored twice: in {tensors[name].file} and {path}")
            tensors[name] = tensor
    index_path = model_dir / INDEX_FILE
    if index_path.is_file():
        for name, file_name in _read_index(index_path).items():
            if name not in tensors or tensors[name].file.name != file_name:
                raise CheckpointError(
                    f"{index_path}: says tensor {name!r} is in {file_name!r}, but it is not"
                )
    if not tensors:
        raise CheckpointError(f"{model_dir}: no weights: the safetensors files hold no tensors")
    return tensors


def text_tensor_name(stored_name: str) -> str | None:
    """The model's name for a stored tensor, or None for tensors the text model ignores."""
    if stored_name.startswith(IGNORED_PREFIXES):
        return None
    if stored_name.startswith(MULTIMODAL_TEXT_PREFIX):
        return "model." + stored_name[len(MULTIMODAL_TEXT_PREFIX) :]
    return stored_name


def checkpoint_text_tensors(model_dir: str | Path, config: ModelConfig) -> dict[str, StoredTensor]:
    """The stored tensors the text model loads, by model name, validated against `config`.

    Raises CheckpointError for a missing or unexpected tensor or a shape mismatch. Ignored:
    vision tensors, `lm_head.weight` of a tied model, and `mtp.*` when the config has no MTP head.
    """
    expected = expected_tensor_shapes(config)
    found: dict[str, StoredTensor] = {}
    unexpected = []
    for stored_name, tensor in stored_tensors(model_dir).items():
        name = text_tensor_name(stored_name)
        if name is None or (name not in expected and _ignorable(name, config)):
            continue
        if name in found:
            raise CheckpointError(
                f"tensor {name!r} is stored twice: as {found[name].stored_name!r} and {stored_name!r}"
            )
        if name not in expected:
            unexpected.append(stored_name)
            continue
        found[name] = tensor
    if unexpected:
        raise CheckpointError(f"{model_dir}: unexpected text tensors {listing(unexpected)}")
    mismatched = [
        f"{found[name].stored_name!r} in {found[name].file.name}: expected {list(shape)}, found {list(found[name].shape)}"
        for name, shape in expected.items()
        if name in found and found[name].shape != shape
    ]
    if mismatched:
        raise CheckpointError(f"{model_dir}: shape mismatch: {listing(mismatched, quote=False)}")
    missing = [name for name in expected if name not in found]
    if missing:
        raise CheckpointError(f"{model_dir}: missing tensors {listing(missing)}")
    return found


def _ignorable(name: str, config: ModelConfig) -> bool:
    return (name == "lm_head.weight" and config.tie_word_embeddings) or (
        name.startswith("mtp.") and not config.has_mtp
    )


def checkpoint_has_mtp(model_dir: str | Path) -> bool:
    """Whether any `mtp.*` tensor is stored (transformers' save_pretrained drops them)."""
    return any((text_tensor_name(n) or "").startswith("mtp.") for n in stored_tensors(model_dir))


def read_checkpoint_tensors(model_dir: str | Path, config: ModelConfig) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (model name, CPU tensor) for every text tensor in file order, read ahead of their use (reader.py).

    The whole checkpoint is validated before the first tensor is yielded; every tensor is the caller's own.
    """
    return read_stored_tensors(checkpoint_text_tensors(model_dir, config))


def read_stored_tensors(tensors: dict[str, StoredTensor]) -> Iterator[tuple[str, torch.Tensor]]:
    """`read_checkpoint_tensors` of tensors already validated."""
    ordered = sorted(tensors.items(), key=lambda item: (str(item[1].file), item[1].start))
    for name, tensor in read_ahead(ordered):
        yield str(name), tensor


# generation_config.json keys that set a SamplingParams field of the same name when a request leaves it
# out: every scalar field but the seed, which a checkpoint never fixes for all requests.
GENERATION_CONFIG_SAMPLING_KEYS = tuple(name for name in SAMPLING_FIELDS if name != "seed")


def generation_defaults(model_dir: Path) -> dict[str, Any]:
    """The sampling defaults of a checkpoint's generation_config.json, as SamplingParams fields.

    As in transformers, `do_sample` false (or absent) means greedy: temperature 0, whatever the file's
    temperature says; the other keys (penalties, top-k/p, min-p) apply either way. Only keys present in the
    file are returned (transformers' implicit top_k=50 is not applied, as in vLLM). No file: no defaults.
    """
    path = model_dir / "generation_config.json"
    if not path.is_file():
        return {}
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{path}: not readable JSON ({e})") from e
    if not isinstance(config, dict):
        raise CheckpointError(f"{path}: expected a JSON object, got {type(config).__name__}")
    defaults = {key: config[key] for key in GENERATION_CONFIG_SAMPLING_KEYS if config.get(key) is not None}
    if not config.get("do_sample", False):
        defaults["temperature"] = 0.0
    try:
        SamplingParams(**defaults).validate()
    except InvalidRequestError as e:
        raise CheckpointError(f"{path}: invalid sampling default: {e}") from e
    return defaults


def directory_size_bytes(model_dir: str | Path) -> int:
    """Bytes of a checkpoint's weight files (for progress and memory estimates)."""
    return sum(os.path.getsize(p) for p in checkpoint_files(model_dir))


class HFCheckpoint(Checkpoint):
    """A Hugging Face checkpoint directory."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        config = ModelConfig.from_dir(self.path)
        if config.has_mtp and not checkpoint_has_mtp(self.path):
            # transformers' save_pretrained drops mtp.*: such a checkpoint loads without the head
            config = replace(config, mtp_num_hidden_layers=0)
        self.config = config
        # Every tensor's name and shape checked against the config now, before a model of it is built: a
        # config whose sizes no tensor has must fail here, not in allocating them.
        self._stored = checkpoint_text_tensors(self.path, config)
        self._format: ModelFormat | None = None

    @property
    def format(self) -> ModelFormat:
        if self._format is None:
            types = [
                DTYPE_NAMES.get(t.dtype, str(t.dtype).removeprefix("torch.")) for t in self._stored.values()
            ]
            counted = ModelFormat.count_types(types)
            self._format = ModelFormat("safetensors", counted[0][0], directory_size_bytes(self.path), counted)
        return self._format

    def tensors(self, device: torch.device | str = "cpu") -> Iterator[tuple[str, torch.Tensor]]:
        return read_stored_tensors(self._stored)

    def stored_sizes(self) -> dict[str, int]:
        return {name: t.end - t.start for name, t in self._stored.items()}

    def stored_types(self) -> dict[str, str]:
        return dict.fromkeys(expected_tensor_shapes(self.config), PLAIN)

    def own_tokenizer(self) -> Tokenizer:
        return load_tokenizer(self.path)

    def generation_defaults(self) -> dict[str, Any]:
        return generation_defaults(self.path)


def default_model_dir() -> Path:
    """The embedded model shipped with the package (used when no --model is given)."""
    if not (DEFAULT_MODEL_DIR / "config.json").is_file():
        raise CheckpointError(
            f"the default model is not installed: {DEFAULT_MODEL_DIR} has no config.json; pass a model directory"
        )
    return DEFAULT_MODEL_DIR
