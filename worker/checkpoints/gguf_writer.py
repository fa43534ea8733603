"""Writing a checkpoint as a `qwen35` GGUF with the `gguf` package's writer, laid out as llama.cpp's converter
and quantizer write it (names, metadata, value transformations: `gguf_layout.py`), MTP head included."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch

from ..config import ModelConfig, default_layer_types
from ..errors import CheckpointError
from ..progress import LoadProgress
from .base import Checkpoint
from .gguf import SAMPLING_KEYS
from .gguf_layout import ARCHITECTURE, tensor_place, to_gguf
from .gguf_tokenizer import tokenizer_metadata
from .quantize import TypeChooser, is_plain, preset_chooser

# llama.cpp's loaders read the multimodal RoPE sections; for text positions any split is plain partial RoPE.
QWEN_ROPE_SECTIONS = [11, 11, 10, 0]


def write_gguf(
    source: Checkpoint,
    out: str | Path,
    *,
    preset: str | None = None,
    choose: TypeChooser | None = None,
    device: torch.device | str = "cpu",
    progress: LoadProgress | None = None,
    split_max_tensors: int = 0,
    quantizer: Callable[[Any, torch.Tensor], torch.Tensor] | None = None,
) -> Path:
    """Write `source` to `out`, each tensor in the type `choose(gguf_name, shape, block)` (or `preset`'s rule)
    returns; quantization runs on `device`. `split_max_tensors` > 0 writes shards `OUT-0000i-of-0000N.gguf` of
    at most that many tensors (as llama.cpp's gguf-split does). `quantizer(qtype, weights) -> bytes` replaces
    ours (`quant.quantize`). Returns the path written (the first shard)."""
    from ..quant import quantize

    quantizer = quantizer or quantize
    config = source.config
    if (preset is None) == (choose is None):
        raise ValueError("give exactly one of preset and choose")
    chooser = choose or preset_chooser(preset, config)  # type: ignore[arg-type]
    out = Path(out)
    writer = gguf.GGUFWriter(out, ARCHITECTURE, split_max_tensors=split_max_tensors)
    _write_model_metadata(writer, config, source.name)
    if preset is not None:
        from ..quant.presets import preset as find_preset

        writer.add_file_type(find_preset(preset).file_type)
    _write_tokenizer(writer, source, config)
    for key, field in SAMPLING_KEYS.items():
        value = source.generation_defaults().get(field)
        if value is not None:
            if isinstance(value, int) and field == "top_k":
                writer.add_int32(key, value)
            else:
                writer.add_float32(key, float(value))
    items = source.tensors(device)
    for name, value in progress.track(items) if progress is not None else items:
        if not isinstance(value, torch.Tensor):
            raise CheckpointError(
                f"{source.path}: tensor {name!r} is already quantized; write from full precision"
            )
        place = tensor_place(name, config)
        values = to_gguf(value.to(device), place, config)
        qtype = chooser(place.gguf_name, tuple(values.shape), place.block)
        ggml_type = gguf.GGMLQuantizationType[qtype.name]
        if is_plain(qtype):
            plain = values.to(torch.float16 if qtype.name == "F16" else torch.float32)
            if qtype.name == "BF16":
                raw = values.to(torch.bfloat16).view(torch.uint8).cpu().numpy()
                writer.add_tensor(place.gguf_name, raw, raw_dtype=ggml_type)
            else:
                writer.add_tensor(place.gguf_name, plain.cpu().numpy())
        else:
            raw = quantizer(qtype, values).cpu().numpy().astype(np.uint8, copy=False)
            writer.add_tensor(place.gguf_name, raw.reshape(values.shape[0], -1), raw_dtype=ggml_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    shards = len(writer.tensors)
    return out if shards <= 1 else out.with_name(f"{out.stem}-00001-of-{shards:05d}.gguf")


def full_attention_interval(config: ModelConfig) -> int:
    """The interval llama.cpp's `full_attention_interval` expresses `config.layer_types` with."""
    for interval in range(1, config.num_hidden_layers + 1):
        if default_layer_types(config.num_hidden_layers, interval) == config.layer_types:
            return interval
    raise CheckpointError(
        f"layer types {list(config.layer_types)} are not every n-th layer full attention: "
        "qwen35.full_attention_interval cannot express them"
    )


def _write_model_metadata(writer: gguf.GGUFWriter, config: ModelConfig, name: str) -> None:
    writer.add_name(name)
    writer.add_block_count(config.num_hidden_layers + config.mtp_num_hidden_layers)
    writer.add_nextn_predict_layers(config.mtp_num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_key_length(config.head_dim)
    writer.add_value_length(config.head_dim)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_rope_freq_base(config.rope_theta)
    writer.add_rope_dimension_count(config.rotary_dim)
    sections = (
        QWEN_ROPE_SECTIONS
        if sum(QWEN_ROPE_SECTIONS) * 2 == config.rotary_dim
        else [config.rotary_dim // 2, 0, 0, 0]
    )
    writer.add_rope_dimension_sections(sections)
    writer.add_ssm_conv_kernel(config.linear_conv_kernel_dim)
    writer.add_ssm_state_size(config.linear_key_head_dim)
    writer.add_ssm_group_count(config.linear_num_key_heads)
    writer.add_ssm_time_step_rank(config.linear_num_value_heads)
    writer.add_ssm_inner_size(config.linear_value_dim)
    writer.add_full_attention_interval(full_attention_interval(config))


def _write_tokenizer(writer: gguf.GGUFWriter, source: Checkpoint, config: ModelConfig) -> None:
    meta = tokenizer_metadata(source.tokenizer(), config.vocab_size)
    if len(meta.tokens) > config.vocab_size:
        raise CheckpointError(
            f"the tokenizer has {len(meta.tokens)} tokens, more than the embedding's {config.vocab_size} rows"
        )
    writer.add_tokenizer_model(meta.model)
    writer.add_tokenizer_pre(meta.pre)
    writer.add_token_list(meta.tokens)
    writer.add_token_types(meta.token_types)
    writer.add_token_merges(meta.merges)
    ids = meta.special_ids
    if "bos_token" in ids:
        writer.add_bos_token_id(ids["bos_token"])
    if "eos_token" in ids:
        writer.add_eos_token_id(ids["eos_token"])
    if "pad_token" in ids:
        writer.add_pad_token_id(ids["pad_token"])
    if "unk_token" in ids:
        writer.add_unk_token_id(ids["unk_token"])
    writer.add_add_bos_token(False)
    if meta.chat_template:
        writer.add_chat_template(meta.chat_template)
