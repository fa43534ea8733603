"""The names and shapes of the model's tensors (transformers' text-only naming plus `mtp.*`), shared by the
loader, every checkpoint format and the memory accounting."""

from __future__ import annotations

import torch

from .config import FULL_ATTENTION, ModelConfig

# Parameters kept in fp32 whatever the load dtype: the DeltaNet decay is computed in fp32.
FP32_PARAMETER_SUFFIXES = (".A_log", ".dt_bias")


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


def listing(names: list[str], limit: int = 8, quote: bool = True) -> str:
    shown = ", ".join(repr(n) if quote else n for n in names[:limit])
    return f"{shown} and {len(names) - limit} more" if len(names) > limit else shown
