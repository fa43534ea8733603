"""How llama.cpp's converter lays out a `qwen35` GGUF, in both directions: the tensor names, and the value
transformations it applies on the way (read by `gguf.py`, written by `gguf_writer.py`).

- every zero-centred RMSNorm weight is stored as (1 + w); the DeltaNet output norm (`ssm_norm`) as it is;
- `ssm_a` is stored as -exp(A_log);
- `ssm_conv1d` is squeezed to [channels, kernel];
- with fewer key heads than value heads, the value heads are reordered from grouped-by-key-head order
  (value head j belongs to key head j // r) to tiled order (key head j % Hk) in every tensor that has them:
  the V rows of `attn_qkv` and of `ssm_conv1d`, the rows of `attn_gate`, `ssm_alpha`, `ssm_beta`, the
  entries of `ssm_a` and `ssm_dt.bias`, and the columns of `ssm_out`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from ..config import FULL_ATTENTION, ModelConfig

ARCHITECTURE = "qwen35"

# our name's suffix within a decoder layer -> llama.cpp's within a block
_LAYER_NAMES = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "post_attention_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "linear_attn.in_proj_qkv.weight": "attn_qkv.weight",
    "linear_attn.in_proj_z.weight": "attn_gate.weight",
    "linear_attn.in_proj_b.weight": "ssm_beta.weight",
    "linear_attn.in_proj_a.weight": "ssm_alpha.weight",
    "linear_attn.conv1d.weight": "ssm_conv1d.weight",
    "linear_attn.A_log": "ssm_a",
    "linear_attn.dt_bias": "ssm_dt.bias",
    "linear_attn.norm.weight": "ssm_norm.weight",
    "linear_attn.out_proj.weight": "ssm_out.weight",
}
_GLOBAL_NAMES = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}
_MTP_NAMES = {
    "mtp.fc.weight": "nextn.eh_proj.weight",  # input order [embedding, hidden], as HF stores it
    "mtp.pre_fc_norm_embedding.weight": "nextn.enorm.weight",
    "mtp.pre_fc_norm_hidden.weight": "nextn.hnorm.weight",
    "mtp.norm.weight": "nextn.shared_head_norm.weight",
}
_ZERO_CENTRED_NORMS = (
    "input_layernorm.weight",
    "post_attention_layernorm.weight",
    "q_norm.weight",
    "k_norm.weight",
    "model.norm.weight",
    "pre_fc_norm_embedding.weight",
    "pre_fc_norm_hidden.weight",
    "mtp.norm.weight",
)
_LAYER = re.compile(r"^(model\.layers|mtp\.layers)\.(\d+)\.(.+)$")


@dataclass(frozen=True)
class TensorPlace:
    """Where one of our tensors lives in a GGUF, and what was done to its values on the way."""

    gguf_name: str
    block: int | None  # the block index (the MTP block is the number of main layers), None for globals
    plus_one: bool = False  # stored as 1 + w
    neg_exp: bool = False  # stored as -exp(w)
    squeeze: bool = False  # conv1d [C, 1, K] stored as [C, K]
    reorder: str | None = None  # "rows", "v_rows" (the V part of qkv channels), "columns", "entries"
    head_dim: int = 1  # rows per value head of the reordered dimension


def tensor_place(name: str, config: ModelConfig) -> TensorPlace:
    """Where our tensor `name` is stored in a qwen35 GGUF written from `config`."""
    plus_one = name.endswith(_ZERO_CENTRED_NORMS)
    if name in _GLOBAL_NAMES:
        return TensorPlace(_GLOBAL_NAMES[name], None, plus_one=plus_one)
    mtp_block = config.num_hidden_layers
    if name in _MTP_NAMES:
        return TensorPlace(f"blk.{mtp_block}.{_MTP_NAMES[name]}", mtp_block, plus_one=plus_one)
    match = _LAYER.match(name)
    if match is None or match.group(3) not in _LAYER_NAMES:
        raise KeyError(f"no GGUF name for tensor {name!r}")
    prefix, index, suffix = match.group(1), int(match.group(2)), match.group(3)
    block = mtp_block + index if prefix == "mtp.layers" else index
    reorder, head_dim = _value_head_reorder(suffix, config)
    return TensorPlace(
        f"blk.{block}.{_LAYER_NAMES[suffix]}",
        block,
        plus_one=plus_one,
        neg_exp=suffix == "linear_attn.A_log",
        squeeze=suffix == "linear_attn.conv1d.weight",
        reorder=reorder,
        head_dim=head_dim,
    )


def _value_head_reorder(suffix: str, config: ModelConfig) -> tuple[str | None, int]:
    if config.linear_num_key_heads == config.linear_num_value_heads:
        return None, 1
    dv = config.linear_value_head_dim
    return {
        "linear_attn.in_proj_qkv.weight": ("v_rows", dv),
        "linear_attn.conv1d.weight": ("v_rows", dv),
        "linear_attn.in_proj_z.weight": ("rows", dv),
        "linear_attn.in_proj_b.weight": ("rows", 1),
        "linear_attn.in_proj_a.weight": ("rows", 1),
        "linear_attn.A_log": ("rows", 1),
        "linear_attn.dt_bias": ("rows", 1),
        "linear_attn.out_proj.weight": ("columns", dv),
    }.get(suffix, (None, 1))


def block_layer_type(block: int, config: ModelConfig) -> str:
    return config.layer_types[block] if block < config.num_hidden_layers else FULL_ATTENTION


# ---- the value-head permutation ------------------------------------------------------------------


def tiled_to_grouped(config: ModelConfig, head_dim: int) -> torch.Tensor:
    """Indices `idx` with grouped = tiled[idx] along a dimension of Hv * head_dim entries."""
    hk = config.linear_num_key_heads
    r = config.linear_num_value_heads // hk
    heads = torch.tensor([j * hk + k for k in range(hk) for j in range(r)])
    return (heads[:, None] * head_dim + torch.arange(head_dim)[None, :]).reshape(-1)


def grouped_to_tiled(config: ModelConfig, head_dim: int) -> torch.Tensor:
    """The inverse: tiled = grouped[idx]."""
    return torch.argsort(tiled_to_grouped(config, head_dim))


def reorder_index(place: TensorPlace, config: ModelConfig, length: int, *, to_gguf: bool) -> torch.Tensor:
    """The full index along the reordered dimension (`length` entries) for one direction."""
    perm = (grouped_to_tiled if to_gguf else tiled_to_grouped)(config, place.head_dim)
    if place.reorder != "v_rows":
        return perm
    v_start = length - perm.numel()  # q and k channels come first and keep their order
    return torch.cat((torch.arange(v_start), v_start + perm))


def to_gguf(tensor: torch.Tensor, place: TensorPlace, config: ModelConfig) -> torch.Tensor:
    """Our float tensor -> the values the GGUF stores (float32)."""
    t = tensor.float()
    if place.plus_one:
        t = t + 1.0
    if place.neg_exp:
        t = -torch.exp(t)
    if place.squeeze:
        t = t.reshape(t.shape[0], t.shape[-1])
    if place.reorder is not None:
        dim = 1 if place.reorder == "columns" else 0
        t = t.index_select(dim, reorder_index(place, config, t.shape[dim], to_gguf=True).to(t.device))
    return t.contiguous()


def from_gguf(
    tensor: torch.Tensor, place: TensorPlace, config: ModelConfig, shape: tuple[int, ...]
) -> torch.Tensor:
    """The values a GGUF stores (float) -> our tensor of `shape`, undoing `to_gguf` exactly."""
    t = tensor
    if place.reorder is not None:
        dim = 1 if place.reorder == "columns" else 0
        t = t.index_select(dim, reorder_index(place, config, t.shape[dim], to_gguf=False).to(t.device))
    if place.squeeze:
        t = t.reshape(shape)
    if place.neg_exp:
        t = torch.log(-t.float())
    if place.plus_one:
        t = t.float() - 1.0
    return t.reshape(shape)
