"""GGUF files (llama.cpp's format) of the `qwen35` architecture, read through the `gguf` package's
memory-mapped reader: the config from the metadata, the tensors with llama.cpp's value transformations
undone (`gguf_layout.py`), the tokenizer and chat template from the metadata (`gguf_tokenizer.py`).

`--model` may name the file, a directory holding one GGUF (or one set of split shards), or the first shard
`NAME-00001-of-0000N.gguf` of a split model (metadata in the first shard, tensors spread over all).
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFReader, LlamaFileType, ReaderField, ReaderTensor

from ..config import ModelConfig, default_layer_types
from ..errors import CheckpointError, UnsupportedModelError
from ..layout import expected_tensor_shapes, listing
from ..tokenizer import Tokenizer
from .base import PLAIN, Checkpoint, ModelFormat, WeightValue
from .gguf_layout import ARCHITECTURE, TensorPlace, from_gguf, reorder_index, tensor_place
from .gguf_tokenizer import SPECIAL_ID_KEYS, TokenizerMetadata, build_tokenizer
from .reader import read_ahead

GGUF_MAGIC = b"GGUF"
SHARD_PATTERN = re.compile(r"^(?P<stem>.+)-(?P<index>\d{5})-of-(?P<count>\d{5})\.gguf$")
PLAIN_TYPES = {
    GGMLQuantizationType.F32: torch.float32,
    GGMLQuantizationType.F16: torch.float16,
    GGMLQuantizationType.BF16: torch.bfloat16,
}
BLOCK_TYPES = (
    GGMLQuantizationType.Q8_0,
    GGMLQuantizationType.Q4_0,
    GGMLQuantizationType.Q5_0,
    GGMLQuantizationType.Q5_1,
    GGMLQuantizationType.Q4_K,
    GGMLQuantizationType.Q5_K,
    GGMLQuantizationType.Q6_K,
)
SUPPORTED_TYPES = (*PLAIN_TYPES, *BLOCK_TYPES)
# general.sampling.* -> SamplingParams field
SAMPLING_KEYS = {
    "general.sampling.temp": "temperature",
    "general.sampling.top_k": "top_k",
    "general.sampling.top_p": "top_p",
    "general.sampling.min_p": "min_p",
    "general.sampling.penalty_repeat": "repetition_penalty",
}


def gguf_files(path: Path) -> list[Path]:
    """The GGUF file(s) `path` names: one file, or every shard of a split model in order."""
    if path.is_dir():
        found = sorted(p for p in path.glob("*.gguf") if not p.name.startswith("mmproj"))
        if not found:
            raise CheckpointError(f"{path}: no .gguf file in the directory")
        shards = {SHARD_PATTERN.match(p.name).group("stem") for p in found if SHARD_PATTERN.match(p.name)}  # type: ignore[union-attr]
        if len(found) > 1 and not (len(shards) == 1 and all(SHARD_PATTERN.match(p.name) for p in found)):
            raise CheckpointError(
                f"{path}: holds several GGUF models ({listing([p.name for p in found])}); name one file"
            )
        path = found[0]
    match = SHARD_PATTERN.match(path.name)
    if match is None:
        return [path]
    count = int(match.group("count"))
    files = [
        path.with_name(f"{match.group('stem')}-{i:05d}-of-{count:05d}.gguf") for i in range(1, count + 1)
    ]
    missing = [f.name for f in files if not f.is_file()]
    if missing:
        raise CheckpointError(f"{path}: split GGUF of {count} shards is missing {listing(missing)}")
    return files


def open_reader(path: Path) -> GGUFReader:
    """A memory-mapped reader, or an error that says what is wrong with the file."""
    try:
        with path.open("rb") as f:
            magic = f.read(4)
    except OSError as e:
        raise CheckpointError(f"{path}: cannot read ({e})") from e
    if magic != GGUF_MAGIC:
        raise CheckpointError(f"{path}: not a GGUF file (it starts with {magic!r}, not {GGUF_MAGIC!r})")
    size = path.stat().st_size
    try:
        reader = GGUFReader(path, "r")
    except (ValueError, IndexError, KeyError, OverflowError) as e:
        raise CheckpointError(f"{path}: truncated or corrupt GGUF file ({size} bytes): {e}") from e
    for tensor in reader.tensors:
        end = tensor.data_offset + tensor.n_bytes
        if end > size:
            raise CheckpointError(
                f"{path}: truncated GGUF file: tensor {tensor.name!r} ends at byte {end}, the file has {size}"
            )
    return reader


def field_value(field: ReaderField) -> Any:
    value = field.contents()
    return value.item() if isinstance(value, np.generic) else value


def read_metadata(reader: GGUFReader, path: Path) -> dict[str, Any]:
    """Every metadata key's value; a value the file does not hold intact (a string that is not UTF-8, an
    array cut short) is a CheckpointError naming the key."""
    metadata = {}
    for name, field in reader.fields.items():
        try:
            metadata[name] = field_value(field)
        except (ValueError, IndexError, TypeError) as e:  # UnicodeDecodeError is a ValueError
            raise CheckpointError(f"{path}: metadata {name!r} is corrupt: {e}") from e
    return metadata


@dataclass(frozen=True)
class StoredGGUFTensor:
    name: str  # our model's name
    place: TensorPlace
    reader: GGUFReader
    tensor: ReaderTensor
    file: Path  # the shard that holds it

    @property
    def qtype(self) -> GGMLQuantizationType:
        return self.tensor.tensor_type

    @property
    def shape(self) -> tuple[int, ...]:
        """The logical shape, outermost first (GGUF stores dimensions innermost first)."""
        return tuple(int(d) for d in reversed(self.tensor.shape.tolist()))


class GGUFCheckpoint(Checkpoint):
    """A `qwen35` GGUF model (one file or split shards)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.files = gguf_files(self.path)
        self.readers = [open_reader(f) for f in self.files]
        self.metadata = read_metadata(self.readers[0], self.files[0])
        self._check_shards()
        architecture = self.metadata.get("general.architecture")
        if architecture != ARCHITECTURE:
            raise UnsupportedModelError(
                f"{self.files[0]}: general.architecture is {architecture!r}; this engine runs {ARCHITECTURE!r} "
                "(Qwen3.5 / Qwen3.6 dense) models"
            )
        stored = {t.name: (reader, t) for reader in self.readers for t in reader.tensors}
        self.config = config_from_metadata(self.metadata, stored, str(self.files[0]))
        self.stored = self._validated(stored)

    @property
    def name(self) -> str:
        match = SHARD_PATTERN.match(self.files[0].name)
        return match.group("stem") if match else self.files[0].stem

    def _check_shards(self) -> None:
        if len(self.files) == 1:
            return
        for index, (path, reader) in enumerate(zip(self.files, self.readers, strict=True)):
            count, number = reader.fields.get("split.count"), reader.fields.get("split.no")
            if count is None or number is None:
                raise CheckpointError(
                    f"{path}: a shard of a split GGUF without split.count / split.no metadata"
                )
            if field_value(count) != len(self.files) or field_value(number) != index:
                raise CheckpointError(
                    f"{path}: split metadata says shard {field_value(number)} of {field_value(count)}, "
                    f"but its name says {index} of {len(self.files)}"
                )

    def _validated(self, stored: dict[str, tuple[GGUFReader, ReaderTensor]]) -> dict[str, StoredGGUFTensor]:
        source = str(self.path)
        expected = expected_tensor_shapes(self.config)
        places = {name: tensor_place(name, self.config) for name in expected}
        by_gguf = {place.gguf_name: name for name, place in places.items()}
        unused = (
            "nextn.embed_tokens.weight",
            "nextn.shared_head_head.weight",
        )  # copies of token_embd / output
        unexpected = [n for n in stored if n not in by_gguf and not n.endswith(unused)]
        if unexpected:
            raise CheckpointError(f"{source}: unexpected tensors {listing(unexpected)}")
        missing = [place.gguf_name for place in places.values() if place.gguf_name not in stored]
        if missing:
            raise CheckpointError(f"{source}: missing tensors {listing(missing)}")
        found: dict[str, StoredGGUFTensor] = {}
        problems = []
        for gguf_name, name in by_gguf.items():
            reader, tensor = stored[gguf_name]
            entry = StoredGGUFTensor(
                name, places[name], reader, tensor, self.files[self.readers.index(reader)]
            )
            if entry.qtype not in SUPPORTED_TYPES:
                raise CheckpointError(
                    f"{source}: tensor {gguf_name!r} has type {entry.qtype.name}, which this loader does not "
                    f"support (supported: {', '.join(t.name for t in SUPPORTED_TYPES)})"
                )
            want = stored_shape(expected[name], entry.place)
            if entry.shape != want:
                problems.append(
                    f"{gguf_name!r}: the metadata implies {list(want)}, the file has {list(entry.shape)}"
                )
            found[name] = entry
        if problems:
            raise CheckpointError(
                f"{source}: tensors disagree with the metadata's shapes: {listing(problems, quote=False)}"
            )
        return found

    @property
    def format(self) -> ModelFormat:
        types = [entry.qtype.name for entry in self.stored.values()]
        file_type = self.metadata.get("general.file_type")
        try:
            weights = LlamaFileType(file_type).name.removeprefix("MOSTLY_").removeprefix("ALL_")
        except ValueError:
            matrices = [e.qtype.name for e in self.stored.values() if len(e.shape) == 2]
            weights = ModelFormat.count_types(matrices)[0][0]
        nbytes = sum(f.stat().st_size for f in self.files)
        return ModelFormat("gguf", weights, nbytes, ModelFormat.count_types(types))

    def stored_sizes(self) -> dict[str, int]:
        return {name: int(entry.tensor.n_bytes) for name, entry in self.stored.items()}

    def stored_types(self) -> dict[str, str]:
        return {
            name: PLAIN if e.qtype in PLAIN_TYPES or _dequantized_on_load(e.place, e.shape) else e.qtype.name
            for name, e in self.stored.items()
        }

    def tensors(self, device: torch.device | str = "cpu") -> Iterator[tuple[str, WeightValue]]:
        expected = expected_tensor_shapes(self.config)
        entries = sorted(
            self.stored.values(), key=lambda e: (self.readers.index(e.reader), e.tensor.data_offset)
        )
        ranges = [(i, _ByteRange(e)) for i, e in enumerate(entries)]
        for i, raw in read_ahead(ranges):
            entry = entries[int(i)]
            yield entry.name, self._value(entry, raw, expected[entry.name], torch.device(device))

    def _value(
        self, entry: StoredGGUFTensor, raw: torch.Tensor, shape: tuple[int, ...], device: torch.device
    ) -> WeightValue:
        from ..layers.quantized import PermutedInputWeight
        from ..quant import QuantizedWeight, QuantType

        # The tensor's bytes as the reader's array types them (float32, float16, or bytes for the rest); the
        # array itself is only looked at, never read: its bytes came through read_ahead.
        data = raw.view(_torch_dtype(entry.tensor.data.dtype)).reshape(entry.tensor.data.shape)
        place = entry.place
        if entry.qtype in PLAIN_TYPES:
            if entry.qtype == GGMLQuantizationType.BF16:  # the reader hands BF16 over as bytes
                data = data.view(torch.bfloat16).reshape(entry.shape)
            return from_gguf(data, place, self.config, shape)
        qtype = QuantType[entry.qtype.name]
        if _dequantized_on_load(place, shape):
            dense = QuantizedWeight(qtype, entry.shape, data).dequantize(torch.float32, torch.device("cpu"))
            return from_gguf(dense, place, self.config, shape)
        if place.reorder in ("rows", "v_rows"):  # block rows are independent: permute the bytes
            data = data.index_select(
                0, reorder_index(place, self.config, shape[0], to_gguf=False).to(data.device)
            )
        weight = QuantizedWeight(qtype, entry.shape, data.to(device, copy=True))
        if place.reorder == "columns":  # blocks span heads: keep the columns and permute the layer's input
            return PermutedInputWeight(
                weight, reorder_index(place, self.config, shape[1], to_gguf=True).to(device)
            )
        return weight

    def own_tokenizer(self) -> Tokenizer:
        meta = self.metadata
        source = str(self.files[0])
        if "tokenizer.ggml.tokens" not in meta:
            raise CheckpointError(f"{source}: no tokenizer in the metadata; pass --tokenizer DIR")
        tokens = list(meta["tokenizer.ggml.tokens"])
        vocab = self.config.vocab_size
        if len(tokens) > vocab:
            raise CheckpointError(
                f"{source}: the metadata lists {len(tokens)} tokens, but token_embd has only {vocab} rows"
            )
        special_ids = {key: int(meta[k]) for key, k in SPECIAL_ID_KEYS.items() if k in meta}
        tokenizer = TokenizerMetadata(
            model=str(meta.get("tokenizer.ggml.model")),
            pre=str(meta.get("tokenizer.ggml.pre", "gpt2")),
            tokens=tokens,
            token_types=[int(t) for t in meta.get("tokenizer.ggml.token_type", [1] * len(tokens))],
            merges=list(meta.get("tokenizer.ggml.merges", [])),
            special_ids=special_ids,
            chat_template=meta.get("tokenizer.chat_template"),
        )
        return build_tokenizer(tokenizer, source)

    def generation_defaults(self) -> dict[str, Any]:
        from ..api import SamplingParams
        from ..errors import InvalidRequestError

        defaults = {  # float32 in the file: keep the 7 digits it holds
            field: float(f"{value:.7g}") if isinstance(value, float) else value
            for key, field in SAMPLING_KEYS.items()
            if (value := self.metadata.get(key)) is not None
        }
        try:
            SamplingParams(**defaults).validate()
        except InvalidRequestError as e:
            raise CheckpointError(f"{self.files[0]}: invalid general.sampling default: {e}") from e
        return defaults


def _dequantized_on_load(place: TensorPlace, shape: tuple[int, ...]) -> bool:
    """A norm or a DeltaNet parameter stored quantized: small, dequantized on load to undo its transform."""
    return place.plus_one or place.neg_exp or place.squeeze or len(shape) == 1


def stored_shape(shape: tuple[int, ...], place: TensorPlace) -> tuple[int, ...]:
    """The shape a GGUF stores our tensor of `shape` in."""
    return (shape[0], shape[-1]) if place.squeeze else shape


def config_from_metadata(
    meta: dict[str, Any], stored: dict[str, tuple[GGUFReader, ReaderTensor]], source: str
) -> ModelConfig:
    """Our config from `qwen35.*` metadata (the vocabulary size and tying from the tensors). A value of the
    wrong kind or out of range is a CheckpointError naming its key."""
    a = ARCHITECTURE

    def get(key: str, default: Any = None, *, required: bool = True) -> Any:
        full = f"{a}.{key}"
        if full not in meta:
            if required and default is None:
                raise CheckpointError(f"{source}: metadata has no {full}")
            return default
        value = meta[full]
        if isinstance(value, list):  # per-layer arrays: this architecture uses one value
            if not all(_is_number(v) for v in value):
                raise CheckpointError(f"{source}: {full} is not an array of numbers: {value!r}")
            distinct = {v for v in value if v}
            if len(distinct) > 1:
                raise UnsupportedModelError(
                    f"{source}: {full} varies by layer ({value}), which is not supported"
                )
            value = distinct.pop() if distinct else 0
        return value

    def count(key: str, default: int | None = None, *, required: bool = True, least: int = 1) -> int:
        value = get(key, default, required=required)
        if not (_is_number(value) and value == int(value) and value >= least):
            kind = "a positive integer" if least == 1 else f"an integer of at least {least}"
            raise CheckpointError(f"{source}: {a}.{key} must be {kind}, got {value!r}")
        return int(value)

    def positive(key: str) -> float:
        value = get(key)
        if not (_is_number(value) and value > 0):
            raise CheckpointError(f"{source}: {a}.{key} must be a positive number, got {value!r}")
        return float(value)

    blocks = count("block_count")
    nextn = count("nextn_predict_layers", 0, required=False, least=0)
    layers = blocks - nextn
    if layers <= 0:
        raise CheckpointError(
            f"{source}: {a}.block_count {blocks} leaves no main layers after {nextn} MTP layers"
        )
    head_dim = count("attention.key_length")
    rotary = count("rope.dimension_count", head_dim, required=False)
    if rotary > head_dim or rotary % 2:
        raise CheckpointError(
            f"{source}: {a}.rope.dimension_count {rotary} must be even and at most "
            f"{a}.attention.key_length {head_dim}"
        )
    value_heads = count("ssm.time_step_rank")
    inner = count("ssm.inner_size")
    if inner % value_heads:
        raise CheckpointError(
            f"{source}: {a}.ssm.inner_size {inner} is not a multiple of {a}.ssm.time_step_rank {value_heads}"
        )
    recurrent = meta.get(f"{a}.attention.recurrent_layers")
    if (
        isinstance(recurrent, list)
        and len(recurrent) >= layers
        and all(isinstance(v, bool) for v in recurrent)
    ):
        layer_types = tuple("linear_attention" if r else "full_attention" for r in recurrent[:layers])
    else:
        layer_types = default_layer_types(layers, count("full_attention_interval", 4, required=False))
    if "token_embd.weight" not in stored:
        raise CheckpointError(f"{source}: missing tensors 'token_embd.weight'")
    vocab = int(stored["token_embd.weight"][1].shape[1])  # GGUF dims: [hidden, vocab]
    special = {}
    for key, meta_key in SPECIAL_ID_KEYS.items():
        if meta_key in meta:
            token = meta[meta_key]
            if not (_is_number(token) and token == int(token) and 0 <= token < vocab):
                raise CheckpointError(f"{source}: {meta_key} must be a token id below {vocab}, got {token!r}")
            special[key] = int(token)
    try:
        return ModelConfig(
            vocab_size=vocab,
            hidden_size=count("embedding_length"),
            num_hidden_layers=layers,
            num_attention_heads=count("attention.head_count"),
            num_key_value_heads=count("attention.head_count_kv"),
            head_dim=head_dim,
            intermediate_size=count("feed_forward_length"),
            linear_num_key_heads=count("ssm.group_count"),
            linear_num_value_heads=value_heads,
            linear_key_head_dim=count("ssm.state_size"),
            linear_value_head_dim=inner // value_heads,
            linear_conv_kernel_dim=count("ssm.conv_kernel"),
            layer_types=layer_types,
            rms_norm_eps=float(f"{positive('attention.layer_norm_rms_epsilon'):.7g}"),  # stored as float32
            rope_theta=positive("rope.freq_base"),
            partial_rotary_factor=rotary / head_dim,
            max_position_embeddings=count("context_length"),
            tie_word_embeddings="output.weight" not in stored,
            mtp_num_hidden_layers=nextn,
            eos_token_ids=(special["eos_token"],) if "eos_token" in special else (),
            bos_token_id=special.get("bos_token"),
            pad_token_id=special.get("pad_token"),
        )
    except CheckpointError as e:  # UnsupportedModelError too, its type kept
        raise type(e)(f"{source}: {e}") from e


def _is_number(value: Any) -> bool:
    """A finite int or float (not a bool, a string or an array)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and np.isfinite(value)


@dataclass(frozen=True)
class _ByteRange:
    """A GGUF tensor's bytes as one flat range (reader.FileRange)."""

    entry: StoredGGUFTensor

    @property
    def file(self) -> Path:
        return self.entry.file

    @property
    def start(self) -> int:
        return int(self.entry.tensor.data_offset)

    @property
    def end(self) -> int:
        return self.start + int(self.entry.tensor.n_bytes)

    @property
    def dtype(self) -> torch.dtype:
        return torch.uint8

    @property
    def shape(self) -> tuple[int, ...]:
        return (int(self.entry.tensor.n_bytes),)


def _torch_dtype(dtype: np.dtype) -> torch.dtype:
    return torch.from_numpy(np.empty(0, dtype=dtype)).dtype
