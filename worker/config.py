"""The text model's configuration, read from a Hugging Face `config.json` (nested or flat)."""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from .errors import CheckpointError, UnsupportedModelError

# `qwen3_5` is the multimodal wrapper (text under `text_config`); `qwen3_5_text` is what
# transformers' text-only Qwen3_5ForCausalLM writes.
SUPPORTED_MODEL_TYPES = ("qwen3_5", "qwen3_5_text")
FULL_ATTENTION = "full_attention"
LINEAR_ATTENTION = "linear_attention"
# The fields that size tensors (and the context): each must be a positive integer.
SIZE_FIELDS = (
    "vocab_size",
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "intermediate_size",
    "linear_num_key_heads",
    "linear_num_value_heads",
    "linear_key_head_dim",
    "linear_value_head_dim",
    "linear_conv_kernel_dim",
    "max_position_embeddings",
)


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int = 248320
    hidden_size: int = 1024
    num_hidden_layers: int = 24
    num_attention_heads: int = 8
    num_key_value_heads: int = 2
    head_dim: int = 256
    intermediate_size: int = 3584
    linear_num_key_heads: int = 16
    linear_num_value_heads: int = 16
    linear_key_head_dim: int = 128
    linear_value_head_dim: int = 128
    linear_conv_kernel_dim: int = 4
    layer_types: tuple[str, ...] = ()
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10_000_000.0
    partial_rotary_factor: float = 0.25
    max_position_embeddings: int = 262144
    tie_word_embeddings: bool = False
    mtp_num_hidden_layers: int = 0
    hidden_act: str = "silu"
    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None
    pad_token_id: int | None = None
    model_type: str = "qwen3_5_text"
    extra: dict[str, Any] = field(default_factory=dict, compare=False, hash=False, repr=False)

    def __post_init__(self) -> None:
        malformed = self._malformed()
        if malformed:
            raise CheckpointError("; ".join(malformed))
        for name in ("rms_norm_eps", "rope_theta", "partial_rotary_factor"):
            object.__setattr__(self, name, float(getattr(self, name)))
        if not self.layer_types:
            object.__setattr__(self, "layer_types", default_layer_types(self.num_hidden_layers, 4))
        problems = []
        if len(self.layer_types) != self.num_hidden_layers:
            problems.append(
                f"layer_types has {len(self.layer_types)} entries but num_hidden_layers is {self.num_hidden_layers}"
            )
        unknown = sorted(set(self.layer_types) - {FULL_ATTENTION, LINEAR_ATTENTION})
        if unknown:
            problems.append(f"unknown layer types {unknown}")
        if self.num_attention_heads % self.num_key_value_heads:
            problems.append("num_attention_heads must be a multiple of num_key_value_heads")
        if self.linear_num_value_heads % self.linear_num_key_heads:
            problems.append("linear_num_value_heads must be a multiple of linear_num_key_heads")
        if self.hidden_act != "silu":
            problems.append(f"hidden_act {self.hidden_act!r} is not supported (only 'silu')")
        if self.mtp_num_hidden_layers not in (0, 1):
            problems.append(f"mtp_num_hidden_layers={self.mtp_num_hidden_layers} is not supported (0 or 1)")
        if problems:
            raise UnsupportedModelError("; ".join(problems))

    def _malformed(self) -> list[str]:
        """Values no model can have (a size that is not a positive integer, a token id outside the
        vocabulary, ...): what a corrupt or hand-edited config holds, found before anything is allocated."""
        problems = [
            f"{name} must be a positive integer, got {value!r}"
            for name in SIZE_FIELDS
            if not _is_count(value := getattr(self, name))
        ]
        for name in ("rms_norm_eps", "rope_theta"):
            value = getattr(self, name)
            if not (_is_real(value) and math.isfinite(value) and value > 0):
                problems.append(f"{name} must be a positive number, got {value!r}")
        factor = self.partial_rotary_factor
        if not (_is_real(factor) and 0 < factor <= 1):
            problems.append(f"partial_rotary_factor must be in (0, 1], got {factor!r}")
        elif _is_count(self.head_dim) and (self.rotary_dim < 2 or self.rotary_dim % 2):
            problems.append(
                f"partial_rotary_factor {factor} rotates {self.rotary_dim} of head_dim {self.head_dim}'s "
                "dimensions; rotary embeddings need an even number, at least 2"
            )
        if isinstance(self.mtp_num_hidden_layers, bool) or not isinstance(self.mtp_num_hidden_layers, int):
            problems.append(f"mtp_num_hidden_layers must be an integer, got {self.mtp_num_hidden_layers!r}")
        if not isinstance(self.tie_word_embeddings, bool):
            problems.append(f"tie_word_embeddings must be true or false, got {self.tie_word_embeddings!r}")
        if not isinstance(self.layer_types, tuple) or not all(isinstance(t, str) for t in self.layer_types):
            problems.append(f"layer_types must be a list of layer type names, got {self.layer_types!r}")
        vocab = self.vocab_size if _is_count(self.vocab_size) else None
        ids = [("bos_token_id", self.bos_token_id), ("pad_token_id", self.pad_token_id)]
        if isinstance(self.eos_token_ids, tuple):
            ids += [("eos_token_id", token) for token in self.eos_token_ids]
        else:
            problems.append(f"eos_token_ids must be a tuple of token ids, got {self.eos_token_ids!r}")
        for name, token in ids:
            if token is not None and not (_is_id(token) and (vocab is None or token < vocab)):
                problems.append(f"{name} must be a token id below vocab_size {vocab}, got {token!r}")
        return problems

    # ---- derived shapes -------------------------------------------------------------------------
    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def full_attention_layers(self) -> list[int]:
        return [i for i, t in enumerate(self.layer_types) if t == FULL_ATTENTION]

    @property
    def linear_attention_layers(self) -> list[int]:
        return [i for i, t in enumerate(self.layer_types) if t == LINEAR_ATTENTION]

    @property
    def linear_qkv_dim(self) -> int:
        """Channels of `in_proj_qkv` (and of the causal conv): q and k per key head, v per value head."""
        return 2 * self.linear_num_key_heads * self.linear_key_head_dim + self.linear_value_dim

    @property
    def linear_value_dim(self) -> int:
        return self.linear_num_value_heads * self.linear_value_head_dim

    @property
    def has_mtp(self) -> bool:
        return self.mtp_num_hidden_layers > 0

    # ---- (de)serialisation ----------------------------------------------------------------------
    @classmethod
    def from_hf_dict(cls, raw: dict[str, Any]) -> ModelConfig:
        if not isinstance(raw, dict):
            raise CheckpointError(f"config.json: expected a JSON object, got {type(raw).__name__}")
        model_type = raw.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise UnsupportedModelError(
                f"config.json: model_type {model_type!r} is not supported; expected one of {SUPPORTED_MODEL_TYPES}"
            )
        text = raw.get("text_config") if model_type == "qwen3_5" and "text_config" in raw else raw
        if not isinstance(text, dict):
            raise CheckpointError("config.json: text_config is not an object")
        text_type = text.get("model_type", "qwen3_5_text")
        if text is not raw and text_type != "qwen3_5_text":
            raise UnsupportedModelError(
                f"config.json: text_config.model_type {text_type!r} is not 'qwen3_5_text'"
            )
        rope = text.get("rope_parameters") or text.get("rope_scaling") or {}
        if not isinstance(rope, dict):
            raise CheckpointError(f"config.json: rope_parameters must be an object, got {rope!r}")
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type not in ("default", "mrope", None):
            raise UnsupportedModelError(f"config.json: rope_type {rope_type!r} is not supported")
        known = {
            f
            for f in cls.__dataclass_fields__
            if f not in ("extra", "eos_token_ids", "model_type", "layer_types")
        }
        kwargs: dict[str, Any] = {k: text[k] for k in known if k in text and text[k] is not None}
        # __post_init__ checks these values' types and ranges, wherever they come from.
        kwargs["rope_theta"] = rope.get("rope_theta", text.get("rope_theta", 10_000_000.0))
        kwargs["partial_rotary_factor"] = rope.get(
            "partial_rotary_factor", text.get("partial_rotary_factor", 0.25)
        )
        # tie_word_embeddings lives on the outer config of multimodal checkpoints.
        kwargs["tie_word_embeddings"] = text.get("tie_word_embeddings", raw.get("tie_word_embeddings", False))
        kwargs["layer_types"] = _layer_types(text, kwargs.get("num_hidden_layers", cls.num_hidden_layers))
        kwargs["eos_token_ids"] = _eos_token_ids(text.get("eos_token_id", raw.get("eos_token_id")))
        kwargs["model_type"] = "qwen3_5_text"
        kwargs["extra"] = {k: v for k, v in text.items() if k not in known}
        try:
            return cls(**kwargs)
        except CheckpointError as e:  # UnsupportedModelError too, its type kept
            raise type(e)(f"config.json: {e}") from e

    @classmethod
    def from_dir(cls, path: str | Path) -> ModelConfig:
        cfg_path = Path(path) / "config.json"
        if not cfg_path.is_file():
            raise CheckpointError(f"{path}: no config.json")
        try:
            raw = json.loads(cfg_path.read_text())
        except json.JSONDecodeError as e:
            raise CheckpointError(f"{cfg_path}: not valid JSON ({e})") from e
        try:
            return cls.from_hf_dict(raw)
        except CheckpointError as e:  # UnsupportedModelError too, its type kept
            raise type(e)(f"{path}: {e}") from e

    def to_hf_text_dict(self) -> dict[str, Any]:
        """A flat `qwen3_5_text` config that transformers' Qwen3_5ForCausalLM / Qwen3_5TextConfig accepts."""
        d = asdict(self)
        d.pop("extra")
        eos = d.pop("eos_token_ids")
        d["eos_token_id"] = list(eos) if len(eos) != 1 else eos[0]
        d["layer_types"] = list(self.layer_types)
        d["rope_parameters"] = {
            "rope_type": "default",
            "rope_theta": d.pop("rope_theta"),
            "partial_rotary_factor": d.pop("partial_rotary_factor"),
        }
        d["model_type"] = "qwen3_5_text"
        d["architectures"] = ["Qwen3_5ForCausalLM"]
        return d


def default_layer_types(num_layers: int, full_attention_interval: int) -> tuple[str, ...]:
    """transformers' default: layer i is full attention iff (i + 1) % interval == 0."""
    return tuple(
        FULL_ATTENTION if (i + 1) % full_attention_interval == 0 else LINEAR_ATTENTION
        for i in range(num_layers)
    )


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def _is_id(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _is_real(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _layer_types(text: dict[str, Any], num_layers: Any) -> tuple[str, ...]:
    """config.json's layer types, or transformers' default for its full-attention interval; empty (the
    config then reports the layer count) when the count itself is malformed."""
    given = text.get("layer_types")
    if given:
        if not isinstance(given, list):
            raise CheckpointError(f"config.json: layer_types must be a list, got {given!r}")
        return tuple(given)
    interval = text.get("full_attention_interval", 4)
    if not _is_count(interval):
        raise CheckpointError(
            f"config.json: full_attention_interval must be a positive integer, got {interval!r}"
        )
    return default_layer_types(num_layers, interval) if _is_count(num_layers) else ()


def _eos_token_ids(eos: Any) -> tuple[Any, ...]:
    """config.json's eos_token_id (one id, a list of them, or none) as a tuple; the config checks each."""
    if eos is None:
        return ()
    return tuple(eos) if isinstance(eos, list) else (eos,)
