"""Quantization presets: per-tensor types on the 27B shapes and on the embedded model's (rows of 384 and 704
fall back to 32-block types), by GGUF tensor name."""

from __future__ import annotations

import pytest
from onestream.kernels.random_model import config_27b
from onestream.worker.config import FULL_ATTENTION, ModelConfig
from onestream.worker.errors import InvalidRequestError
from onestream.worker.loading import default_model_dir
from onestream.worker.quant import QuantType
from onestream.worker.quant.presets import PRESETS, choose_type, more_bits, plan_types

Q = QuantType


def gguf_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor of a `qwen35` GGUF of `config` (torch order: rows last), the MTP block as block L."""
    h, i = config.hidden_size, config.intermediate_size
    shapes: dict[str, tuple[int, ...]] = {
        "token_embd.weight": (config.vocab_size, h),
        "output_norm.weight": (h,),
    }
    if not config.tie_word_embeddings:
        shapes["output.weight"] = (config.vocab_size, h)
    kinds = list(config.layer_types) + [FULL_ATTENTION] * config.mtp_num_hidden_layers
    for n, kind in enumerate(kinds):
        b = f"blk.{n}."
        shapes |= {f"{b}attn_norm.weight": (h,), f"{b}post_attention_norm.weight": (h,)}
        shapes |= {f"{b}ffn_gate.weight": (i, h), f"{b}ffn_up.weight": (i, h), f"{b}ffn_down.weight": (h, i)}
        if kind == FULL_ATTENTION:
            q, kv, d = (
                config.num_attention_heads * config.head_dim,
                config.num_key_value_heads * config.head_dim,
                config.head_dim,
            )
            shapes |= {
                f"{b}attn_q.weight": (2 * q, h),
                f"{b}attn_k.weight": (kv, h),
                f"{b}attn_v.weight": (kv, h),
            }
            shapes |= {
                f"{b}attn_output.weight": (h, q),
                f"{b}attn_q_norm.weight": (d,),
                f"{b}attn_k_norm.weight": (d,),
            }
        else:
            hv, v = config.linear_num_value_heads, config.linear_value_dim
            shapes |= {f"{b}attn_qkv.weight": (config.linear_qkv_dim, h), f"{b}attn_gate.weight": (v, h)}
            shapes |= {
                f"{b}ssm_alpha.weight": (hv, h),
                f"{b}ssm_beta.weight": (hv, h),
                f"{b}ssm_out.weight": (h, v),
            }
            shapes |= {f"{b}ssm_conv1d.weight": (config.linear_qkv_dim, config.linear_conv_kernel_dim)}
            shapes |= {
                f"{b}ssm_a": (hv,),
                f"{b}ssm_dt.bias": (hv,),
                f"{b}ssm_norm.weight": (config.linear_value_head_dim,),
            }
        if n >= config.num_hidden_layers:  # the MTP block
            shapes |= {f"{b}nextn.eh_proj.weight": (h, 2 * h), f"{b}nextn.enorm.weight": (h,)}
            shapes |= {f"{b}nextn.hnorm.weight": (h,), f"{b}nextn.shared_head_norm.weight": (h,)}
    return shapes


def test_more_bits_layers_of_65_blocks() -> None:
    chosen = [i for i in range(65) if more_bits(i, 65)]
    assert chosen == [*range(8), *range(10, 56, 3), *range(56, 65)]


def test_q4_k_m_on_the_27b_shapes() -> None:
    shapes = gguf_shapes(config_27b(mtp=True))
    plan = plan_types("q4_k_m", shapes)
    assert plan["output.weight"] == Q.Q6_K and plan["token_embd.weight"] == Q.Q4_K
    for n in range(65):
        mixer = "attn_v" if (n + 1) % 4 == 0 or n == 64 else "attn_qkv"
        wide = Q.Q6_K if more_bits(n, 65) else Q.Q4_K
        assert plan[f"blk.{n}.{mixer}.weight"] == wide, n
        assert plan[f"blk.{n}.ffn_down.weight"] == wide, n
        assert plan[f"blk.{n}.ffn_up.weight"] == plan[f"blk.{n}.ffn_gate.weight"] == Q.Q4_K
    assert (
        plan["blk.0.attn_qkv.weight"]
        == plan["blk.10.attn_qkv.weight"]
        == plan["blk.63.attn_v.weight"]
        == Q.Q6_K
    )
    assert plan["blk.11.attn_v.weight"] == plan["blk.54.ffn_down.weight"] == Q.Q4_K
    for name in (
        "blk.0.ssm_out.weight",
        "blk.0.ssm_alpha.weight",
        "blk.3.attn_output.weight",
        "blk.64.nextn.eh_proj.weight",
    ):
        assert plan[name] == Q.Q4_K, name
    for name in ("blk.0.ssm_conv1d.weight", "blk.0.ssm_a", "blk.0.ssm_dt.bias", "blk.0.ssm_norm.weight"):
        assert plan[name] == Q.F32, name
    for name in ("blk.3.attn_q_norm.weight", "output_norm.weight", "blk.64.nextn.enorm.weight"):
        assert plan[name] == Q.F32, name
    nbytes = sum(plan[name].nbytes(shape) for name, shape in shapes.items())
    print(f"27B q4_k_m: {nbytes / 1e9:.2f} GB")
    assert (
        16.0e9 < nbytes < 17.5e9
    )  # llama.cpp's Q4_K_M files of this model: 16.5-16.8 GB (with the MTP head)


@pytest.mark.parametrize(
    ("name", "default", "wide"),
    [("q5_k_m", Q.Q5_K, Q.Q6_K), ("q6_k", Q.Q6_K, Q.Q6_K), ("q8_0", Q.Q8_0, Q.Q8_0)],
)
def test_other_presets_on_the_27b_shapes(name: str, default: QuantType, wide: QuantType) -> None:
    plan = plan_types(name, gguf_shapes(config_27b(mtp=True)))
    assert plan["output.weight"] == (Q.Q8_0 if name == "q8_0" else Q.Q6_K)
    assert (
        plan["token_embd.weight"] == plan["blk.9.ffn_down.weight"] == plan["blk.8.attn_qkv.weight"] == default
    )
    assert plan["blk.0.ffn_down.weight"] == plan["blk.64.attn_v.weight"] == wide
    assert plan["blk.0.ssm_conv1d.weight"] == plan["blk.0.attn_norm.weight"] == Q.F32


@pytest.mark.parametrize(
    ("name", "default", "wide"),
    [
        ("q4_k_m", Q.Q5_0, Q.Q8_0),
        ("q5_k_m", Q.Q5_1, Q.Q8_0),
        ("q6_k", Q.Q8_0, Q.Q8_0),
        ("q8_0", Q.Q8_0, Q.Q8_0),
    ],
)
def test_embedded_model_rows_fall_back(name: str, default: QuantType, wide: QuantType) -> None:
    config = ModelConfig.from_dir(default_model_dir())
    assert (config.hidden_size, config.intermediate_size, config.tie_word_embeddings) == (384, 704, True)
    shapes = gguf_shapes(config)
    plan = plan_types(name, shapes)
    n_layers = config.num_hidden_layers + config.mtp_num_hidden_layers
    assert plan["token_embd.weight"] == Q.Q8_0  # tied: the output's rule, and 384 is not whole 256-blocks
    for n in range(n_layers):
        expected = wide if more_bits(n, n_layers) and PRESETS[name].more_bits else default
        assert plan[f"blk.{n}.ffn_down.weight"] == expected, (n, plan[f"blk.{n}.ffn_down.weight"])
        assert plan[f"blk.{n}.ffn_up.weight"] == default
    for name_, qtype in plan.items():
        if qtype not in (Q.F32,):
            assert shapes[name_][-1] % qtype.block_size == 0, name_


def test_choose_type_reads_the_block_from_the_name_and_names_bad_presets() -> None:
    shape = (1024, 5120)
    assert choose_type("Q4_K_M", "blk.0.ffn_down.weight", shape, None, 65) == Q.Q6_K
    assert choose_type("q4_k_m", "blk.0.ffn_down.weight", shape, 9, 65) == Q.Q4_K
    assert choose_type("q4_k_m", "token_embd.weight", (248320, 5120), None, 65, has_output=False) == Q.Q6_K
    assert choose_type("q4_k_m", "blk.0.ffn_up.weight", (1024, 100), 0, 65) == Q.F16  # not even 32-blocks
    with pytest.raises(InvalidRequestError, match=r"q3_k_s.*q4_k_m, q5_k_m, q6_k, q8_0"):
        choose_type("q3_k_s", "blk.0.ffn_up.weight", shape, 0, 65)
