"""Loading Qwen3.5 checkpoints: safetensors shards, memory-mapped and cast tensor by tensor.

The model is built with its parameters on the `meta` device (no memory), each parameter is then
allocated in its final dtype and filled from a read-only view of the file, and the file pages of
that view are given back to the kernel before the next tensor. Peak host memory is therefore
the loaded weights plus the largest single stored tensor.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import mmap
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import nn

from .config import FULL_ATTENTION, ModelConfig
from .errors import CheckpointError

if TYPE_CHECKING:
    from .model import Qwen35ForCausalLM

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
MULTIMODAL_TEXT_PREFIX = "model.language_model."
# Tensors of a multimodal checkpoint that the text model does not use.
IGNORED_PREFIXES = ("model.visual.", "visual.", "model.vision_tower.", "model.multi_modal_projector.")
# Parameters kept in fp32 whatever the load dtype: the DeltaNet decay is computed in fp32.
FP32_PARAMETER_SUFFIXES = (".A_log", ".dt_bias")
DEFAULT_MODEL_DIR = Path(__file__).resolve().parent / "assets" / "default_model"

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


# ---- the names and shapes of a model's tensors -------------------------------------------------


def expected_tensor_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every text tensor of the model, in transformers' text-only naming, with its shape."""
    h = config.hidden_size
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (config.vocab_size, h)}
    for i, layer_type in enumerate(config.layer_types):
        shapes.update(_decoder_layer_shapes(config, f"model.layers.{i}.", layer_type))
    shapes["model.norm.weight"] = (h,)
    if not config.tie_word_embeddings:
        shapes["lm_head.weight"] = (config.vocab_size, h)
    if config.has_mtp:
        shapes["mtp.fc.weight"] = (h, 2 * h)
        shapes["mtp.pre_fc_norm_embedding.weight"] = (h,)
        shapes["mtp.pre_fc_norm_hidden.weight"] = (h,)
        for i in range(config.mtp_num_hidden_layers):
            shapes.update(_decoder_layer_shapes(config, f"mtp.layers.{i}.", FULL_ATTENTION))
        shapes["mtp.norm.weight"] = (h,)
    return shapes


def _decoder_layer_shapes(config: ModelConfig, prefix: str, layer_type: str) -> dict[str, tuple[int, ...]]:
    h = config.hidden_size
    shapes: dict[str, tuple[int, ...]] = {f"{prefix}input_layernorm.weight": (h,)}
    if layer_type == FULL_ATTENTION:
        hd = config.head_dim
        q_width = config.num_attention_heads * hd
        kv_width = config.num_key_value_heads * hd
        a = f"{prefix}self_attn."
        shapes |= {
            f"{a}q_proj.weight": (2 * q_width, h),  # query and output gate, interleaved per head
            f"{a}k_proj.weight": (kv_width, h),
            f"{a}v_proj.weight": (kv_width, h),
            f"{a}o_proj.weight": (h, q_width),
            f"{a}q_norm.weight": (hd,),
            f"{a}k_norm.weight": (hd,),
        }
    else:
        hv = config.linear_num_value_heads
        a = f"{prefix}linear_attn."
        shapes |= {
            f"{a}in_proj_qkv.weight": (config.linear_qkv_dim, h),
            f"{a}in_proj_z.weight": (config.linear_value_dim, h),
            f"{a}in_proj_b.weight": (hv, h),
            f"{a}in_proj_a.weight": (hv, h),
            f"{a}conv1d.weight": (config.linear_qkv_dim, 1, config.linear_conv_kernel_dim),
            f"{a}A_log": (hv,),
            f"{a}dt_bias": (hv,),
            f"{a}norm.weight": (config.linear_value_head_dim,),
            f"{a}out_proj.weight": (h, config.linear_value_dim),
        }
    m = f"{prefix}mlp."
    shapes |= {
        f"{prefix}post_attention_layernorm.weight": (h,),
        f"{m}gate_proj.weight": (config.intermediate_size, h),
        f"{m}up_proj.weight": (config.intermediate_size, h),
        f"{m}down_proj.weight": (h, config.intermediate_size),
    }
    return shapes


def parameter_dtype(name: str, dtype: torch.dtype) -> torch.dtype:
    """The dtype a parameter is loaded in: `dtype`, except the fp32 DeltaNet decay parameters."""
    return torch.float32 if name.endswith(FP32_PARAMETER_SUFFIXES) else dtype


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
        except (KeyError, TypeError, ValueError) as e:
            raise CheckpointError(f"{path}: bad header entry for tensor {name!r}: {info!r}") from e
        numel = 1
        for d in shape:
            numel *= d
        if end - begin != numel * dtype.itemsize or begin < 0:
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
        raise CheckpointError(f"{model_dir}: unexpected text tensors {_listing(unexpected)}")
    mismatched = [
        f"{found[name].stored_name!r} in {found[name].file.name}: expected {list(shape)}, found {list(found[name].shape)}"
        for name, shape in expected.items()
        if name in found and found[name].shape != shape
    ]
    if mismatched:
        raise CheckpointError(f"{model_dir}: shape mismatch: {_listing(mismatched, quote=False)}")
    missing = [name for name in expected if name not in found]
    if missing:
        raise CheckpointError(f"{model_dir}: missing tensors {_listing(missing)}")
    return found


def _ignorable(name: str, config: ModelConfig) -> bool:
    return (name == "lm_head.weight" and config.tie_word_embeddings) or (
        name.startswith("mtp.") and not config.has_mtp
    )


def _listing(names: list[str], limit: int = 8, quote: bool = True) -> str:
    shown = ", ".join(repr(n) if quote else n for n in names[:limit])
    return f"{shown} and {len(names) - limit} more" if len(names) > limit else shown


def checkpoint_has_mtp(model_dir: str | Path) -> bool:
    """Whether any `mtp.*` tensor is stored (transformers' save_pretrained drops them)."""
    return any((text_tensor_name(n) or "").startswith("mtp.") for n in stored_tensors(model_dir))


def read_checkpoint_tensors(model_dir: str | Path, config: ModelConfig) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (model name, tensor view of the mapped file) for every text tensor, file by file.

    The whole checkpoint is validated before the first tensor is yielded. A view stays valid
    while referenced, but its pages are dropped from this process's memory when the next tensor
    is requested (reading it again re-reads the file). Copy from views; never write to them:
    writes are private to the process and may be discarded.
    """
    tensors = checkpoint_text_tensors(model_dir, config)
    by_file: dict[Path, list[tuple[str, StoredTensor]]] = {}
    for name, tensor in sorted(tensors.items(), key=lambda item: (str(item[1].file), item[1].start)):
        by_file.setdefault(tensor.file, []).append((name, tensor))
    for path, entries in by_file.items():
        yield from _file_views(path, entries)


def _file_views(path: Path, entries: list[tuple[str, StoredTensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    with path.open("rb") as f:
        # A private mapping: writable for torch.frombuffer, never written, so it never copies.
        mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
    # No explicit close: torch.frombuffer keeps the mmap object alive, and closing it would unmap
    # memory that views still handed out point to. It unmaps when the last view is freed.
    for name, tensor in entries:
        if tensor.end == tensor.start:
            view = torch.empty(tensor.shape, dtype=tensor.dtype)
        else:
            count = (tensor.end - tensor.start) // tensor.dtype.itemsize
            view = torch.frombuffer(mapped, dtype=tensor.dtype, count=count, offset=tensor.start)
        yield name, view.view(tensor.shape)
        del view
        _drop_pages(mapped, tensor.start, tensor.end)


def _drop_pages(mapped: mmap.mmap, start: int, end: int) -> None:
    """Give back the resident file pages of [start, end) so they do not add up in RSS."""
    if not hasattr(mmap, "MADV_DONTNEED"):
        return
    page_start = start - start % mmap.PAGESIZE
    if end > page_start:
        mapped.madvise(mmap.MADV_DONTNEED, page_start, end - page_start)


# ---- building and filling a model --------------------------------------------------------------


def load_model(
    model_dir: str | Path | None = None,
    *,
    dtype: torch.dtype = torch.bfloat16,
    device: str | torch.device = "cpu",
) -> Qwen35ForCausalLM:
    """Build the model of a checkpoint directory and load its weights (cast to `dtype`).

    A checkpoint without any `mtp.*` tensor (as transformers' save_pretrained writes) loads as
    a model without the MTP head; a partial MTP head is an error.
    """
    from .model import Qwen35ForCausalLM

    model_dir = Path(model_dir) if model_dir is not None else default_model_dir()
    config = ModelConfig.from_dir(model_dir)
    if config.has_mtp and not checkpoint_has_mtp(model_dir):
        config = dataclasses.replace(config, mtp_num_hidden_layers=0)
    with parameters_on_meta():
        model = Qwen35ForCausalLM(config)
    materialize_parameters(model, dtype=dtype, device=device)
    load_weights_into(model, model_dir, config=config)
    model.eval()
    return model


@contextlib.contextmanager
def parameters_on_meta() -> Iterator[None]:
    """Modules built inside get their parameters on `meta` (no memory, no init); buffers stay real.

    Unlike `with torch.device("meta")`, computed buffers and tensors (rotary frequencies) keep
    their values. Not thread-safe: it patches `nn.Module.register_parameter` while active.
    """
    register = nn.Module.register_parameter

    def register_on_meta(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        if param is not None and param.device.type != "meta":
            param = nn.Parameter(param.detach().to("meta"), requires_grad=param.requires_grad)
        register(module, name, param)

    nn.Module.register_parameter = register_on_meta  # type: ignore[method-assign]
    try:
        yield
    finally:
        nn.Module.register_parameter = register  # type: ignore[method-assign]


def materialize_parameters(model: nn.Module, *, dtype: torch.dtype, device: str | torch.device) -> None:
    """Give every parameter uninitialised storage on `device` in its load dtype; move buffers there.

    Parameters shared between modules (tied embeddings) stay shared.
    """
    device = torch.device(device)
    replaced: dict[int, nn.Parameter] = {}
    for module_name, module in model.named_modules(remove_duplicate=False):
        for name, param in list(module._parameters.items()):
            if param is None:
                continue
            full_name = f"{module_name}.{name}" if module_name else name
            if id(param) not in replaced:
                target = parameter_dtype(full_name, dtype) if param.is_floating_point() else param.dtype
                data = torch.empty(param.shape, dtype=target, device=device)
                replaced[id(param)] = nn.Parameter(data, requires_grad=False)
            module._parameters[name] = replaced[id(param)]
        for name, buffer in list(module._buffers.items()):
            if buffer is not None and buffer.device != device:
                module._buffers[name] = buffer.to(device)


def load_weights_into(model: nn.Module, model_dir: str | Path, *, config: ModelConfig | None = None) -> None:
    """Copy a checkpoint's text tensors into `model`'s parameters (same names), casting each.

    Parameters keep their dtype and device; the model's parameter names must be exactly
    `expected_tensor_shapes(config)` (a tied lm_head may share the embedding's parameter).
    """
    config = config or getattr(model, "config", None) or ModelConfig.from_dir(model_dir)
    params = dict(model.named_parameters())
    expected = expected_tensor_shapes(config)
    if set(params) != set(expected):
        raise CheckpointError(
            f"the model's parameters do not match the checkpoint layout: "
            f"model only {_listing(sorted(set(params) - set(expected)))}; "
            f"checkpoint only {_listing(sorted(set(expected) - set(params)))}"
        )
    with torch.no_grad():
        for name, view in read_checkpoint_tensors(model_dir, config):
            params[name].copy_(view)


def default_model_dir() -> Path:
    """The embedded model shipped with the package (used when no --model is given)."""
    if not (DEFAULT_MODEL_DIR / "config.json").is_file():
        raise CheckpointError(
            f"the default model is not installed: {DEFAULT_MODEL_DIR} has no config.json; pass a model directory"
        )
    return DEFAULT_MODEL_DIR


def directory_size_bytes(model_dir: str | Path) -> int:
    """Bytes of a checkpoint's weight files (for progress and memory estimates)."""
    return sum(os.path.getsize(p) for p in checkpoint_files(model_dir))
